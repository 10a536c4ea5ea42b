"""Prompt-prefix reuse: sequences that remember what they have processed.

A :class:`lily.Session` is one sequence state (KV cache, DeltaNet and conv state) together with
the token ids it has processed and snapshots of its recurrent state. Given a new prompt it
keeps the longest usable common prefix (``Session.rewind``, by ``reusable_prefix`` here) and
prefills only the rest:

- attention KV can be cut back to any position, but Gated DeltaNet and conv state cannot be
  rewound, so a prefix is usable only up to the latest snapshot at or before the first
  differing token (or in full when the new prompt extends everything processed);
- snapshots are taken after each prompt's prefill (a turn boundary: the next request of the
  same conversation shares at least that much) and bounded by ``max_snapshots`` (oldest
  dropped first).

``Chat`` owns one session; the server owns a ``PrefixCache``: several sequences under a byte
budget, the best-matching one reused per request, least recently used evicted first.

Memory: a session's ``nbytes`` counts its native state (KV cache as allocated plus recurrent
state) and its snapshots (recurrent state only, no KV).

Disk (``lily serve --prompt-cache-dir``): a ``DiskCache`` under the ``PrefixCache`` keeps the
sequences evicted from memory, and at shutdown all of them, as session files
(lily.session_file: tokens, KV and recurrent state, and the recurrent state of each snapshot),
within a byte budget of its own, least recently used deleted first. At start it indexes the
files it finds (header and token ids only); a request whose prompt a file serves better than
any sequence in memory loads it — after the full checks and the checksum, so a truncated,
corrupted or foreign file is skipped with a warning and never reaches the engine — and the
file leaves the disk tier (its sequence is in memory now, and goes back to disk when evicted).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lily import session_file
from lily._core import CheckpointError, ConfigError, RequestError

if TYPE_CHECKING:
    from lily.model import Model, Session


log = logging.getLogger("lily.prefix_cache")


def reusable_prefix(tokens: Sequence[int], snapshot_positions: Sequence[int], ids: Sequence[int]) -> int:
    """Tokens of prompt ``ids`` a sequence holding ``tokens`` (with snapshots at the ascending
    ``snapshot_positions``) can keep: all of ``tokens`` when ``ids`` extends them, else the
    latest snapshot at or before the first difference. At least one prompt token is always
    left to prefill: its logits start the generation."""
    limit = min(len(ids) - 1, len(tokens))
    common = 0
    while common < limit and tokens[common] == ids[common]:
        common += 1
    if common == len(tokens):
        return common
    return max((p for p in snapshot_positions if p <= common), default=0)


@dataclass
class _DiskEntry:
    tokens: list[int]
    snapshot_positions: list[int]
    nbytes: int
    last_used: float


class DiskCache:
    """Session files of evicted sequences in ``directory``, within ``budget_bytes`` (least
    recently used deleted first). Files are named by a hash of their tokens; other files in
    the directory are left alone, and unreadable or foreign session files are skipped (with
    a warning) and left in place. Not thread-safe: the PrefixCache's lock guards it."""

    def __init__(self, model: Model, directory: str | os.PathLike, budget_bytes: int):
        self.model = model
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._index: dict[Path, _DiskEntry] = {}
        self.loads = 0
        self.writes = 0
        self.skipped = 0  # files found unusable (at start or when loaded)
        for path in sorted(self.directory.glob("*.safetensors")):
            try:
                tokens, snaps = session_file.peek(path, model)
            except (CheckpointError, ConfigError) as e:
                self._skip(path, e)
                continue
            st = path.stat()
            self._index[path] = _DiskEntry(tokens, snaps, st.st_size, st.st_mtime)
        self._fit()
        if self._index:
            log.info("prompt cache: %d sequences on disk in %s (%.1f MiB)", len(self._index), self.directory,
                     self.nbytes / 2**20)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    def _skip(self, path: Path, error: Exception) -> None:
        self.skipped += 1
        log.warning("prompt cache: skipping %s: %s", path, error)

    def best(self, ids: Sequence[int]) -> tuple[Path | None, int]:
        """The file whose sequence can keep the most of prompt ``ids``, and how many tokens."""
        best, best_len = None, 0
        for path, e in self._index.items():
            n = reusable_prefix(e.tokens, e.snapshot_positions, ids)
            if n > best_len:
                best, best_len = path, n
        return best, best_len

    def take(self, path: Path, max_context: int | None, max_snapshots: int) -> Session | None:
        """The sequence in ``path``, which leaves the disk tier; None (with a warning) if the file
        fails the checks (checksum included) or no longer fits this model's context."""
        self._index.pop(path, None)
        try:
            saved = session_file.read(path, self.model)
            seq = self.model._session_from(saved, max_context, str(path), max_snapshots)
        except (CheckpointError, ConfigError, RequestError) as e:
            self._skip(path, e)
            return None
        path.unlink(missing_ok=True)
        self.loads += 1
        return seq

    def put(self, seq: Session) -> None:
        """Writes ``seq`` (not in use by any request) as the most recently used file."""
        saved = seq.saved_state()
        if not saved.position:
            return
        path = self.directory / f"{hashlib.sha256(saved.tokens.tobytes()).hexdigest()[:32]}.safetensors"
        try:
            size = session_file.write(path, self.model, saved)
        except OSError as e:
            log.warning("prompt cache: could not write %s: %s", path, e)
            return
        self.writes += 1
        self._index[path] = _DiskEntry(saved.tokens.tolist(), sorted(saved.snapshots), size, time.time())
        self._fit()

    def _fit(self) -> None:
        while self._index and self.nbytes > self.budget_bytes:
            oldest = min(self._index, key=lambda p: self._index[p].last_used)
            del self._index[oldest]
            oldest.unlink(missing_ok=True)


class PrefixCache:
    """Sequences kept between requests, within ``budget_bytes``, least recently used evicted.

    ``acquire(ids)`` hands out the sequence that can reuse the most of ``ids`` (rewound to
    that prefix) or a fresh one; ``release(seq)`` puts it back as the most recently used and
    evicts others until the cache fits its budget. A sequence handed out belongs to one request
    until released (requests running at once get different sequences); the lock guards the
    bookkeeping.
    """

    def __init__(self, model: Model, budget_bytes: int, *, max_context: int | None = None,
                 max_snapshots: int = 8, min_reuse: int = 1):
        """Attach a :class:`DiskCache` as ``disk`` (lily serve --prompt-cache-dir) to keep
        evicted sequences on disk; ``spill()`` writes the rest there at shutdown."""
        self.model = model
        self.disk: DiskCache | None = None
        self.budget_bytes = int(budget_bytes)
        self.max_context = max_context or model.max_context
        self.max_snapshots = max_snapshots
        self.min_reuse = min_reuse
        self._entries: list[Session] = []  # least recently used first
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, ids: Sequence[int]) -> tuple[Session, int]:
        """A sequence for prompt ``ids`` and how many of its tokens are already processed."""
        with self._lock:
            best, best_len = None, 0
            for e in self._entries:
                n = e.reusable(ids)
                if n > best_len:
                    best, best_len = e, n
            if self.disk is not None and self.budget_bytes > 0:
                path, n = self.disk.best(ids)
                if path is not None and n > best_len and n >= self.min_reuse:
                    loaded = self.disk.take(path, self.max_context, self.max_snapshots)
                    if loaded is not None:
                        self.hits += 1
                        return loaded, loaded.rewind(ids)
            if best is not None and best_len >= self.min_reuse and self.budget_bytes > 0:
                self._entries.remove(best)
                self.hits += 1
                return best, best.rewind(ids)
            self.misses += 1
        return self.model.session(self.max_context, self.max_snapshots), 0

    def release(self, seq: Session) -> None:
        """Keeps ``seq`` as the most recently used; evicts until within budget (to the disk
        tier, if any)."""
        self.store(self.keep(seq))

    def keep(self, seq: Session) -> list[Session]:
        """The in-memory half of :meth:`release`: keeps ``seq``, evicts until within budget and
        returns the evicted sequences for :meth:`store` (the server answers its client between
        the two, so the answer does not wait for a file to be written)."""
        with self._lock:
            if self.budget_bytes <= 0 or not seq.position:
                return []
            self._entries.append(seq)
            evicted = []
            while self._entries and self.nbytes > self.budget_bytes:
                evicted.append(self._entries.pop(0))
                self.evictions += 1
            return evicted

    def store(self, evicted: list[Session]) -> None:
        """Writes sequences :meth:`keep` evicted to the disk tier (a no-op without one)."""
        if self.disk is not None:
            with self._lock:
                for seq in evicted:
                    self.disk.put(seq)

    def spill(self) -> None:
        """Writes every sequence in memory to the disk tier (at shutdown), most recent last."""
        with self._lock:
            if self.disk is not None:
                for seq in self._entries:
                    self.disk.put(seq)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
