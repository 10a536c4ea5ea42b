"""Prompt-prefix reuse: sequences that remember what they have processed.

A ``CachedSequence`` is one sequence state (KV cache, DeltaNet and conv state) together with
the token ids it has processed and snapshots of its recurrent state. Given a new prompt it
keeps the longest usable common prefix and prefills only the rest:

- attention KV can be cut back to any position, but Gated DeltaNet and conv state cannot be
  rewound, so a prefix is usable only up to the latest snapshot at or before the first
  differing token (or in full when the new prompt extends everything processed);
- snapshots are taken after each prompt's prefill (a turn boundary: the next request of the
  same conversation shares at least that much) and bounded by ``max_snapshots`` (oldest
  dropped first).

``Chat`` owns one sequence; the server owns a ``PrefixCache``: several sequences under a byte
budget, the best-matching one reused per request, least recently used evicted first.

Memory: a sequence's ``nbytes`` counts its native state (KV cache as allocated plus recurrent
state) and its snapshots (recurrent state only, no KV).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lily.model import Model, Session


class CachedSequence:
    """One sequence state plus the tokens it holds and snapshots to go back to."""

    def __init__(self, model: Model, max_context: int | None = None, max_snapshots: int = 16):
        self.model = model
        self.max_snapshots = max_snapshots
        self.session: Session = model.session(max_context)
        self.tokens: list[int] = []  # tokens the state has processed, in order
        self.snapshots: list = []  # native Snapshots, ascending position

    @property
    def max_context(self) -> int:
        return self.session.max_context

    @property
    def position(self) -> int:
        return self.session.position

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    @property
    def nbytes(self) -> int:
        return self.session._state.nbytes + self.snapshot_bytes

    # -- state changes (the token loop calls these) ----------------------------------------

    # The tokens are recorded before the engine call: Ctrl-C can raise between any two Python
    # steps, and a state that moved on without its tokens recorded could not be matched again.
    # ``tokens`` may thus run ahead of the state, never behind; ``_sync`` trims it back.

    def prefill(self, chunk: np.ndarray) -> np.ndarray:
        self.tokens.extend(int(t) for t in chunk)
        return self.session.prefill(chunk)

    def decode(self, tok: int) -> np.ndarray:
        self.tokens.append(int(tok))
        return self.session.decode(tok)

    def _sync(self) -> None:
        """Drops recorded tokens the state never processed (an interrupted or failed step)."""
        del self.tokens[self.position :]

    def take_snapshot(self) -> None:
        if self.snapshots and self.snapshots[-1].position == self.position:
            return
        self.snapshots.append(self.session._state.snapshot())
        if len(self.snapshots) > self.max_snapshots:
            self.snapshots.pop(0)

    # -- prefix matching -------------------------------------------------------------------

    def _common(self, ids: Sequence[int]) -> int:
        # Keep >= 1 token of the prompt to prefill: its logits start the generation.
        limit = min(len(ids) - 1, len(self.tokens))
        common = 0
        while common < limit and self.tokens[common] == ids[common]:
            common += 1
        return common

    def reusable(self, ids: Sequence[int]) -> int:
        """Prompt tokens ``rewind(ids)`` would keep (no state change)."""
        self._sync()
        common = self._common(ids)
        if common == len(self.tokens):
            return common
        for snap in reversed(self.snapshots):
            if snap.position <= common:
                return snap.position
        return 0

    def rewind(self, ids: Sequence[int]) -> int:
        """Brings the state to the longest reusable prefix of ``ids``; returns its length."""
        self._sync()
        common = self._common(ids)
        if common == len(self.tokens):
            return common
        # The state holds tokens past the common prefix: go back to a snapshot at or before it.
        while self.snapshots and self.snapshots[-1].position > common:
            self.snapshots.pop()
        if self.snapshots:
            snap = self.snapshots[-1]
            self.session._state.restore(snap)
            del self.tokens[snap.position :]
            return snap.position
        self.reset()
        return 0

    def reset(self) -> None:
        self.session = self.model.session(self.session.max_context)
        self.tokens, self.snapshots = [], []


class PrefixCache:
    """Sequences kept between requests, within ``budget_bytes``, least recently used evicted.

    ``acquire(ids)`` hands out the sequence that can reuse the most of ``ids`` (rewound to
    that prefix) or a fresh one; ``release(seq)`` puts it back as the most recently used and
    evicts others until the cache fits its budget. One request uses a sequence at a time (the
    server runs one generation at a time); the lock only guards the bookkeeping.
    """

    def __init__(self, model: Model, budget_bytes: int, *, max_context: int | None = None,
                 max_snapshots: int = 8, min_reuse: int = 1):
        self.model = model
        self.budget_bytes = int(budget_bytes)
        self.max_context = max_context or model.max_context
        self.max_snapshots = max_snapshots
        self.min_reuse = min_reuse
        self._entries: list[CachedSequence] = []  # least recently used first
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, ids: Sequence[int]) -> tuple[CachedSequence, int]:
        """A sequence for prompt ``ids`` and how many of its tokens are already processed."""
        with self._lock:
            best, best_len = None, 0
            for e in self._entries:
                n = e.reusable(ids)
                if n > best_len:
                    best, best_len = e, n
            if best is not None and best_len >= self.min_reuse and self.budget_bytes > 0:
                self._entries.remove(best)
                self.hits += 1
                return best, best.rewind(ids)
            self.misses += 1
        return CachedSequence(self.model, self.max_context, self.max_snapshots), 0

    def release(self, seq: CachedSequence) -> None:
        """Keeps ``seq`` as the most recently used; evicts until within budget."""
        with self._lock:
            if self.budget_bytes <= 0 or not seq.tokens:
                return
            self._entries.append(seq)
            while self._entries and self.nbytes > self.budget_bytes:
                self._entries.pop(0)
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
