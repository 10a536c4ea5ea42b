"""Continuous batching: every engine step of one model, from whatever thread, in shared passes.

Every entry point (``Model.generate``, ``Chat.send``, the server's jobs, ``Session.prefill`` /
``decode``) reaches the engine through :meth:`Batcher.run`: "append these tokens to this
sequence and give me the last one's logits". The calls that arrive while a pass runs are taken
together into the next pass, ``Engine.step``: the decode rows of every waiting sequence and
prefill chunks beside them, so the dense and expert weights are read once for all of them.

Design choices:
- No scheduler thread. The thread whose call finds no pass running leads the next one: it
  gathers the waiting calls, runs the pass (the engine releases the GIL), hands every caller
  its logits and wakes them. A generation's own token loop (sampling, detokenizing, stop
  strings, back-pressure) stays in its own thread, so streams, Ctrl-C and callbacks behave as
  they do for a single request, and every entry point shares one generation flow.
- Who to wait for. After a pass, each sequence's thread samples its next token and calls again
  within a few hundred microseconds; a leader that fired at once would split them into two
  alternating half-size batches. So the leader waits until every thread served by the previous
  pass is back, at most ``max_wait_s``. A thread that does not come back (its generation ended,
  or its stream was abandoned) costs that wait once: it was not in the pass that followed, so
  nobody waits for it again.
- Bit-identical results. A sequence's logits do not depend on which other rows share its pass
  (csrc/engine/engine.h, ``Engine::step``; tests/test_batching.py), so batching changes no
  token: on the CPU backend in any pass, on the GPU backends in passes of at most
  ``engine.batch_rows`` rows (7: from 8 rows projections take tiled GEMMs, whose sums run in
  another order). On a GPU backend every pass stays within that, so a step is one pass there
  too.
- Rows per pass, oldest call first: every waiting decode row (as many as generations run at
  once), and prefill chunks while they add up to at most the engine's ``prefill_chunk`` rows,
  all within ``engine.batch_rows``; a call of more rows than that runs alone. A long prompt thus
  prefills chunk by chunk inside the others' decode passes instead of stalling them (on a GPU
  backend only its chunks of at most 7 rows share a pass: the engine's 512-token chunks run
  alone, between the others' decode passes).
- The device decode loop (``Engine.begin_device_decode``, GPU backends) is single-sequence and
  holds the engine between its steps, so a model that batches generations on a GPU backend
  (``max_batch`` > 1) runs them on the host loop; ``max_batch=1`` gives the device loop back.
- A failed pass (a request error of one sequence, say) is retried one sequence at a time, so
  the error reaches the call that caused it and the others go on; the engine checks everything
  before it computes, so the failed pass changed nothing.
- ``all_logits`` calls (``Session.prefill(all_logits=True)``, ``Model.logits``) and calls of
  more tokens than a pass prefills run alone (the engine chunks those itself).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class _Call:
    state: object  # lily._core.State
    tokens: np.ndarray  # int32 [n]
    alone: bool  # runs in a pass of its own (all_logits, or more tokens than a pass prefills)
    all_logits: bool = False
    thread: int = field(default_factory=threading.get_ident)
    result: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    """Counts since the model was loaded (what the passes held; tests read max_sequences)."""

    passes: int = 0
    rows: int = 0  # decode rows and prefill tokens, summed over passes
    sequences: int = 0  # sequences, summed over passes (mean batch = sequences / passes)
    last_sequences: int = 0  # sequences in the latest pass
    max_sequences: int = 0
    retried_alone: int = 0  # passes that failed and were run again one sequence at a time


class Batcher:
    """The engine calls of one model (see the module docstring)."""

    def __init__(self, engine, lock: threading.Lock, *, prefill_rows: int, max_wait_s: float = 0.005):
        self._engine = engine
        self.batches = bool(engine.batches)
        # Rows in a pass of several calls: Engine.step would split more into passes, and a
        # failing one would leave those before it advanced (the retry below relies on a failed
        # pass changing nothing).
        self.pass_rows = max(1, int(engine.batch_rows))
        self._lock = lock  # the model's engine lock: also taken by clone, save, device loops
        self.prefill_rows = max(1, int(prefill_rows))  # prefill tokens in one pass (the engine's chunk)
        self.max_wait_s = float(max_wait_s)
        self.stats = BatchStats()
        self._cv = threading.Condition()
        self._waiting: list[_Call] = []  # in arrival order
        self._leading = False
        self._last_threads: set[int] = set()  # threads served by the previous pass

    def run(self, state, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Appends ``tokens`` (int32, at least one) to ``state`` in a coming pass; returns the
        last token's logits [vocab] (every token's [n, vocab] with ``all_logits``)."""
        alone = all_logits or len(tokens) > min(self.prefill_rows, self.pass_rows)
        call = _Call(state, tokens, alone, all_logits)
        with self._cv:
            self._waiting.append(call)
            self._cv.notify_all()  # a leader gathering a pass may be waiting for this thread
            try:
                while not call.done:
                    if self._leading:
                        self._cv.wait()
                    else:
                        self._lead()
            except BaseException:
                if call in self._waiting:  # not taken into a pass: nothing happened
                    self._waiting.remove(call)
                    raise
                while not call.done:  # in a pass that is running: it changes the state anyway
                    self._cv.wait()
                raise
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _lead(self) -> None:
        """Gathers and runs one pass (called with the condition's lock held, released while
        the pass runs); the leader's own call need not be in it (oldest first)."""
        self._leading = True
        batch: list[_Call] = []
        try:
            batch = self._gather()
            self._cv.release()
            try:
                self._pass(batch)
            finally:
                self._cv.acquire()
        finally:
            self._leading = False
            if batch:
                self._last_threads = {c.thread for c in batch}
            self._cv.notify_all()

    def _gather(self) -> list[_Call]:
        """Waits for the previous pass's threads to call again (at most max_wait_s), then takes
        the oldest call and every other that fits its pass."""
        deadline = time.monotonic() + self.max_wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._last_threads <= {c.thread for c in self._waiting}:
                break
            self._cv.wait(left)
        first = self._waiting[0]
        if first.alone or not self.batches:
            batch = [first]
        else:
            batch, prefill, rows = [], 0, 0
            for c in self._waiting:
                if c.alone or any(c.state is b.state for b in batch):
                    continue  # alone; or a second call on one sequence (a pass extends a state once)
                if rows + len(c.tokens) > self.pass_rows:
                    continue  # over the pass's rows: waits for a later pass
                if len(c.tokens) > 1:
                    if prefill + len(c.tokens) > self.prefill_rows:
                        continue  # a prefill chunk that does not fit waits for a later pass
                    prefill += len(c.tokens)
                rows += len(c.tokens)
                batch.append(c)
        for c in batch:
            self._waiting.remove(c)
        return batch

    def _pass(self, batch: Sequence[_Call]) -> None:
        """Runs one pass for ``batch`` (lock not held) and completes every call in it."""
        try:
            try:
                with self._lock:
                    if len(batch) > 1:
                        out = list(self._engine.step([c.state for c in batch], [c.tokens for c in batch]))
                    else:
                        out = [self._solo(batch[0])]
                for c, logits in zip(batch, out, strict=True):
                    c.result = logits
            except Exception as e:
                if len(batch) == 1:
                    batch[0].error = e
                else:  # nothing changed: again one at a time, so the error reaches its own call
                    self.stats.retried_alone += 1
                    for c in batch:
                        try:
                            with self._lock:
                                c.result = self._solo(c)
                        except Exception as e1:
                            c.error = e1
        except BaseException as e:  # KeyboardInterrupt in the leader: every call left ends with it
            for c in batch:
                if c.result is None and c.error is None:
                    c.error = e
            raise
        finally:
            for c in batch:
                c.done = True
            st = self.stats
            st.passes += 1
            st.sequences += len(batch)
            st.rows += sum(len(c.tokens) for c in batch)
            st.last_sequences = len(batch)
            st.max_sequences = max(st.max_sequences, len(batch))

    def _solo(self, c: _Call) -> np.ndarray:
        if len(c.tokens) == 1 and not c.all_logits:
            return self._engine.decode(c.state, int(c.tokens[0]))  # decode's cheaper file check
        return self._engine.prefill(c.state, c.tokens, c.all_logits)


def is_prompt_batch(prompt: Any) -> bool:
    """Whether ``Model.generate``'s prompt is several prompts: a list of strings, of token-id
    lists or of message lists (one prompt is a string, a token-id list or a message list)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and isinstance(prompt[0], (str, list, tuple, np.ndarray)))


class _Workers:
    """A BatchStream's worker threads and the queue they fill. The threads hold this, not the
    BatchStream, so a stream nobody references any more is garbage-collected, which stops them."""

    def __init__(self, start: Callable[[int], Any], count: int, workers: int, on_end: Callable[[], None] | None,
                 buffer_chunks: int, stall_timeout_s: float):
        self.results: list[Any] = [None] * count
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=buffer_chunks)
        self.cancel = threading.Event()
        self.abandoned = False  # the BatchStream was garbage-collected: nobody will read the queue
        self._start = start
        self._on_end = on_end
        self._stall_timeout_s = stall_timeout_s
        self._todo = iter(range(count))
        self._lock = threading.Lock()
        self.count = max(1, min(count, workers))
        self._working = self.count  # workers not yet ended (the last one runs on_end)
        for i in range(self.count):
            threading.Thread(target=self._work, daemon=True, name=f"lily-batch-{i}").start()

    def _next_index(self) -> int | None:
        with self._lock:
            return next(self._todo, None)

    def _put(self, item: tuple[str, Any]) -> bool:
        deadline = time.monotonic() + self._stall_timeout_s
        while not self.cancel.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                if time.monotonic() > deadline:
                    self.cancel.set()  # nobody reads: stop generating
        return False

    def _work(self) -> None:
        try:
            while not self.cancel.is_set() and (i := self._next_index()) is not None:
                stream = self._start(i)
                with stream:
                    for chunk in stream:
                        chunk.index = i
                        if not self._put(("chunk", chunk)):
                            break
                self.results[i] = stream.result
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.cancel.set()
            self._put_always(("error", e))
        finally:
            with self._lock:
                self._working -= 1
                last = self._working == 0
            try:
                if last and self._on_end is not None:
                    self._on_end()
            finally:
                self._put_always(("end", None))

    def _put_always(self, item: tuple[str, Any]) -> None:
        """Puts ``item`` even after a cancel (close() reads until every worker's end), unless
        the stream was garbage-collected (then nobody ever reads, and the worker just ends)."""
        while not self.abandoned:
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                pass


class BatchStream:
    """The chunks of several generations as they are generated, each tagged with its
    generation's position (``chunk.index``): ``Model.generate([prompt, ...], stream=True)`` (the
    prompt's position in the list) and ``Model.generate(prompt, n=N, stream=True)`` (the choice,
    OpenAI's ``choices[].index``).

    Worker threads run the generations: for a list of prompts up to the model's ``max_batch``
    at once, each in a thread of its own whose generation shares the engine passes with the
    others (so the order of chunks between prompts varies; each prompt's own chunks are in order
    and its tokens are those it gets alone); for ``n`` choices one thread runs them one after
    another from the prompt's prefilled state (lily.generation.choice_loops), as the server does.
    ``results[i]`` is generation i's GenerationResult once it ended. A failed generation raises
    its error from the iteration and ends the rest. ``close()`` (or leaving a ``with`` block)
    stops every generation within a step and returns once the model is free; garbage collection
    (no reference left, e.g. after ``break``) stops them too, within a step; so does a consumer
    that takes no chunk for ``stall_timeout_s`` (the workers then stop rather than generate into
    a buffer nobody reads).
    """

    def __init__(self, start: Callable[[int], Any], count: int, workers: int, *,
                 on_end: Callable[[], None] | None = None, buffer_chunks: int = 256, stall_timeout_s: float = 60.0):
        """``start(i)``: generation i's GenerationStream, called in a worker thread (a worker
        takes the next index when its generation ends, so a single worker takes them in order).
        ``on_end()`` runs once, in the last worker to end, before the stream reports its end."""
        self._w = _Workers(start, count, workers, on_end, buffer_chunks, stall_timeout_s)
        self._running = self._w.count  # workers whose end this side has not seen

    @classmethod
    def of_prompts(cls, model, prompts: Sequence[Any], options: dict[str, Any]) -> BatchStream:
        """``Model.generate([prompt, ...], stream=True)``."""
        return cls(lambda i: model.generate(prompts[i], stream=True, **options), len(prompts), model.max_batch)

    @property
    def results(self) -> list[Any]:
        return self._w.results

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self):
        while self._running:
            kind, item = self._w.queue.get()
            if kind == "chunk":
                return item
            if kind == "error":
                self.close()
                raise item
            self._running -= 1
        raise StopIteration

    def close(self) -> None:
        """Stops every generation (each within a step); ``results`` keeps what ended."""
        self._w.cancel.set()
        while self._running:  # let blocked workers finish their put and see the flag
            try:
                kind, _ = self._w.queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if kind == "end":
                self._running -= 1

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        w = getattr(self, "_w", None)
        if w is not None:
            w.abandoned = True
            w.cancel.set()


def generate_batch(model, prompts: Sequence[Any], options: dict[str, Any]) -> list[Any]:
    """``Model.generate([prompt, ...])``: one result per prompt, in order (see BatchStream)."""
    stream = BatchStream.of_prompts(model, prompts, options)
    with stream:
        for _ in stream:
            pass
    return stream.results
