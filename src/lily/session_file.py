"""Sequence states in files that outlive the process.

``Session.save`` / ``Model.load_session``, ``lily cache`` and the server's on-disk prompt cache
all write one format: a single safetensors file holding

- ``tokens``: int32 [P], the token ids the state has processed;
- ``state.<name>``: the native state at position P, as ``State.export_tensors`` names it
  (``kv.<l>.k`` / ``kv.<l>.v`` [Hkv, P, D] per attention layer, ``gdn.<l>.conv`` [K-1, C] and
  ``gdn.<l>.S`` [Hv, Dk, Dv] per DeltaNet layer, all float32);
- ``snapshot.<p>.<name>``: the recurrent tensors of turn snapshots at earlier positions p (the
  server's cache keeps them so a prompt that diverges after p still reuses p tokens; the KV
  cache needs no copy for them);

and, in the safetensors metadata (strings), what the state is only valid with:

- the model's fingerprint: a hash of config.json's bytes and of each shard's name, size and
  safetensors header (tensor names, dtypes, shapes, offsets). Cheap — the headers are a few
  hundred KiB even for a 20 GB checkpoint — and it changes whenever the checkpoint is
  re-quantized, re-converted or swapped; an in-place edit of weight bytes that keeps every
  header would not show, which is the price of not hashing the weights;
- the engine settings that change the numbers in the state: backend, KV dtype and the CPU
  matmul mode (a state made with int8 matmuls continued with f32 ones would give tokens that
  neither mode alone gives);
- the format version, and a SHA-256 of the tensor bytes (a flipped byte is caught; safetensors
  itself catches a truncated file, but not corrupted contents).

Loading checks all of them before any tensor reaches the engine, and names the first mismatch.
The safetensors library reads and writes the file (a well-kept format with a Rust reader that
validates the header against the file size); files are written to a temporary name and renamed,
so an interrupted save never leaves a half-written file under the final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lily._core import CheckpointError, ConfigError

if TYPE_CHECKING:
    from lily.model import Model

FORMAT = "lily.session"
FORMAT_VERSION = "1"
_STATE = "state."
_SNAPSHOT = "snapshot."
_EXTRA = "extra."  # caller metadata keys (lily cache: the chat system prompt)


@dataclass
class SavedState:
    """A sequence state as it goes to and comes from a file."""

    tokens: np.ndarray  # int32 [P]
    tensors: dict[str, np.ndarray]  # State.export_tensors() at position P
    snapshots: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # position -> recurrent tensors
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def position(self) -> int:
        return int(self.tokens.size)


# -- what a state is only valid with --------------------------------------------------------


def _safetensors_header_sha256(path: str) -> str:
    """SHA-256 of a safetensors file's 8-byte length and JSON header (not of the tensor data)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"[session] checkpoint shard {path} is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        header = f.read(n)
        if len(header) < n:
            raise CheckpointError(f"[session] checkpoint shard {path} is truncated inside its header")
    return hashlib.sha256(head + header).hexdigest()


def model_identity(model: Model) -> dict[str, str]:
    """The metadata that ties a state to ``model`` (its checkpoint and engine settings).

    Computed once per model (the shard headers are read from disk the first time)."""
    cached = getattr(model, "_session_identity", None)
    if cached is not None:
        return cached
    config_sha = hashlib.sha256((Path(model.path) / "config.json").read_bytes()).hexdigest()
    shards = [[os.path.basename(p), os.path.getsize(p), _safetensors_header_sha256(p)]
              for p in model._weights.files]
    shards_json = json.dumps(shards, separators=(",", ":"))
    engine = model._engine
    identity = {
        "model_fingerprint": hashlib.sha256(f"{config_sha}\n{shards_json}".encode()).hexdigest(),
        "model_config_sha256": config_sha,
        "model_shards": shards_json,
        "backend": str(engine.backend),
        "kv_dtype": str(engine.kv_dtype),
        "cpu_matmul": str(engine.cpu_matmul or "none"),
    }
    model._session_identity = identity
    return identity


def _mismatch(path: Path, saved: dict[str, str], ours: dict[str, str]) -> str | None:
    """What differs between a file's identity and this model's, in words; None if nothing."""
    if saved.get("model_fingerprint") != ours["model_fingerprint"]:
        if saved.get("model_config_sha256") != ours["model_config_sha256"]:
            return "it was saved from a model with a different config.json"
        try:
            theirs = {s[0]: s[1:] for s in json.loads(saved.get("model_shards", "[]"))}
        except (ValueError, TypeError, IndexError):
            theirs = {}
        mine = {s[0]: s[1:] for s in json.loads(ours["model_shards"])}
        if set(theirs) != set(mine):
            return (f"it was saved from a checkpoint with shards {sorted(theirs)}, this model has "
                    f"{sorted(mine)}")
        for name in sorted(mine):
            if theirs[name][0] != mine[name][0]:
                return f"checkpoint shard {name} has changed size ({theirs[name][0]} bytes then, {mine[name][0]} now)"
            if theirs[name][1] != mine[name][1]:
                return f"checkpoint shard {name} has changed (its safetensors header differs)"
        return "it was saved from a different checkpoint (fingerprint differs)"
    for key, what in (("backend", "backend"), ("kv_dtype", "KV cache dtype"), ("cpu_matmul", "cpu_matmul mode")):
        if saved.get(key) != ours[key]:
            return f"it was made with {what} {saved.get(key)!r}, this model runs {ours[key]!r}"
    return None


def _payload_sha256(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(np.ascontiguousarray(tensors[name]).view(np.uint8).data)
    return h.hexdigest()


# -- files -----------------------------------------------------------------------------------


def write(path: str | os.PathLike, model: Model, saved: SavedState) -> int:
    """Writes ``saved`` (a state of ``model``) to ``path``; returns the file's size in bytes."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {"tokens": np.ascontiguousarray(saved.tokens, dtype=np.int32)}
    tensors.update({_STATE + k: v for k, v in saved.tensors.items()})
    for pos, snap in saved.snapshots.items():
        tensors.update({f"{_SNAPSHOT}{pos}.{k}": v for k, v in snap.items()})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **model_identity(model),
        "position": str(saved.position),
        "snapshots": json.dumps(sorted(saved.snapshots)),
        "payload_sha256": _payload_sha256(tensors),
        **{_EXTRA + k: v for k, v in saved.extra.items()},
    }
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _checked_metadata(path: Path, f, model: Model) -> dict[str, str]:
    """The metadata of an open safetensors file, checked to be a lily session of ``model``."""
    meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"[session] {path} is not a lily session file (no '{FORMAT}' format tag)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"[session] {path} has session format version {meta.get('format_version')!r}; "
                              f"this lily reads version {FORMAT_VERSION}")
    problem = _mismatch(path, meta, model_identity(model))
    if problem:
        raise ConfigError(f"[session] {path} cannot be loaded into this model: {problem}")
    return meta


def _open_error(path: Path, e: Exception) -> CheckpointError:
    if not path.is_file():
        return CheckpointError(f"[session] {path} does not exist or is not a file")
    return CheckpointError(f"[session] {path} is not a readable session file (truncated or corrupted?): {e}")


def _snapshot_positions(path: Path, meta: dict[str, str]) -> list[int]:
    try:
        return sorted(int(p) for p in json.loads(meta.get("snapshots", "[]")))
    except (ValueError, TypeError):
        raise CheckpointError(f"[session] {path} has malformed snapshot metadata") from None


def _check_tokens(path: Path, tokens: np.ndarray | None, meta: dict[str, str]) -> None:
    if tokens is None or tokens.dtype != np.int32 or tokens.ndim != 1 or str(tokens.size) != meta.get("position"):
        raise CheckpointError(f"[session] {path} has no valid 'tokens' tensor for its position {meta.get('position')}")


def peek(path: str | os.PathLike, model: Model) -> tuple[list[int], list[int]]:
    """(token ids, snapshot positions) of a session file of ``model``, reading the header and the
    token ids only (the server's cache index); raises as :func:`read` does for a file that is
    not one, except that damaged tensor bytes are found only by ``read``'s checksum."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="np") as f:
            meta = _checked_metadata(path, f, model)
            tokens = f.get_tensor("tokens") if "tokens" in f.keys() else None  # noqa: SIM118
    except (CheckpointError, ConfigError):
        raise
    except Exception as e:
        raise _open_error(path, e) from None
    _check_tokens(path, tokens, meta)
    return tokens.tolist(), _snapshot_positions(path, meta)


def read(path: str | os.PathLike, model: Model) -> SavedState:
    """Reads a state file written for ``model``.

    Raises CheckpointError when the file is missing, not a lily session file, truncated or
    corrupted, and ConfigError when it belongs to another model, a changed checkpoint or other
    engine settings (naming the difference)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="np") as f:
            meta = _checked_metadata(path, f, model)
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except (CheckpointError, ConfigError):
        raise
    except Exception as e:  # safetensors' own errors (a truncated file, a broken header), OSError
        raise _open_error(path, e) from None
    if _payload_sha256(tensors) != meta.get("payload_sha256"):
        raise CheckpointError(f"[session] {path} is corrupted: its tensor bytes do not match the checksum "
                              "recorded when it was saved")
    tokens = tensors.pop("tokens", None)
    _check_tokens(path, tokens, meta)
    saved = SavedState(tokens, {}, {p: {} for p in _snapshot_positions(path, meta)},
                       {k[len(_EXTRA):]: v for k, v in meta.items() if k.startswith(_EXTRA)})
    for name, t in tensors.items():
        if name.startswith(_STATE):
            saved.tensors[name[len(_STATE):]] = t
            continue
        pos, _, rest = name[len(_SNAPSHOT):].partition(".") if name.startswith(_SNAPSHOT) else ("", "", "")
        if not pos.isdigit() or int(pos) not in saved.snapshots:
            raise CheckpointError(f"[session] {path} holds an unexpected tensor {name!r}")
        saved.snapshots[int(pos)][rest] = t
    return saved
