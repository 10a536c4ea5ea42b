"""Stop strings over streamed text.

Text arrives in deltas (from IncrementalDetokenizer), and a stop string may span several of
them ("<|" + "end" + "|>"). `StopStringMatcher.feed(delta)` returns the text that is safe to
show now: everything except a tail that could still grow into a stop string. When a stop
string completes, the text before it is returned, `stopped` becomes True and `matched` names
it; the stop string itself is never emitted (OpenAI semantics). At the end of a generation
that did not stop on a string, `flush()` returns the held tail.

If several stop strings occur, the one that starts earliest wins (on a tie, the longest), so
the emitted text is the longest prefix free of every stop string. Cost per delta is
O(len(held + delta) * number of stops): the held tail is shorter than the longest stop string.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    def __init__(self, stops: Iterable[str] | str | None):
        if stops is None:
            stops = []
        elif isinstance(stops, str):
            stops = [stops]
        stops = list(stops)
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("a stop string must not be empty")
        self.stops: list[str] = stops
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        text = self._held + delta
        hit, hit_stop = -1, None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (hit < 0 or i < hit or (i == hit and len(s) > len(hit_stop))):
                hit, hit_stop = i, s
        if hit >= 0:
            self.stopped, self.matched, self._held = True, hit_stop, ""
            return text[:hit]
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held tail, for a generation that ended without completing a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
