"""Reading a checkpoint folder's small files safely: config.json, generation_config.json,
tokenizer_config.json, model.safetensors.index.json.

A model folder comes from the internet, so its entries may be anything: a FIFO named
config.json (an open() blocks until some writer appears, and Ctrl-C cannot interrupt it), a
device, a directory, a symbolic-link loop, a file of gigabytes, JSON nested a hundred thousand
deep. Every read here therefore
- opens with O_NONBLOCK (opening a FIFO returns at once) and checks, on the open descriptor,
  that it is a regular file before reading a byte (no race between a check and the open);
- reads at most ``max_bytes``;
- turns each failure, JSON too deep for Python's parser (RecursionError) and numbers it cannot
  convert (ValueError) included, into the caller's error class naming the file.
The native loader opens .safetensors files the same way (csrc/model/safetensors.cpp).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["MAX_JSON_BYTES", "check_regular", "read_json", "read_text"]

MAX_JSON_BYTES = 64 << 20  # tokenizer.json of a 250K vocabulary is ~10 MB; configs are KBs


def _describe(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _os_error(path: Path, e: OSError, error: type[Exception], prefix: str) -> Exception:
    if e.errno == errno.ELOOP:
        return error(f"{prefix}{path}: is a symbolic link loop")
    if e.errno == errno.ENOENT:
        return error(f"{prefix}{path}: no such file")
    return error(f"{prefix}{path}: cannot read ({os.strerror(e.errno or 0)})")


def check_regular(path: str | os.PathLike, error: type[Exception], prefix: str = "") -> None:
    """Raises ``error`` unless ``path`` (links followed) is a regular file."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise _os_error(p, e, error, prefix) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{prefix}{p}: is {_describe(st.st_mode)}, not a regular file")


def read_text(path: str | os.PathLike, error: type[Exception], *, prefix: str = "",
              max_bytes: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _os_error(p, e, error, prefix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{prefix}{p}: is {_describe(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise error(f"{prefix}{p}: is {st.st_size} bytes, more than the {max_bytes} a file of its kind may be")
        # Read from the descriptor itself: handing it to a file object would give it two owners,
        # and a KeyboardInterrupt between os.fdopen and the hand-over closed it twice (EBADF,
        # or a descriptor the process had reused meanwhile).
        parts, left = [], max_bytes + 1
        while left > 0:
            part = os.read(fd, min(left, 1 << 20))
            if not part:
                break
            parts.append(part)
            left -= len(part)
        data = b"".join(parts)
    except OSError as e:
        raise _os_error(p, e, error, prefix) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while being read
        raise error(f"{prefix}{p}: is more than {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{prefix}{p}: is not UTF-8 text (byte {e.start})") from None


def read_json(path: str | os.PathLike, error: type[Exception], *, prefix: str = "",
              max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in a regular file; every way it can fail is ``error`` naming the file."""
    text = read_text(path, error, prefix=prefix, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{prefix}{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{prefix}{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer past Python's 4,300-digit conversion limit
        raise error(f"{prefix}{path}: not valid JSON ({str(e).split(';')[0]})") from None
