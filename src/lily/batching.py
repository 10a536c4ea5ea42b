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
- The device decode loop (GPU backends). A generation whose tokens may be chosen on the device
  (no penalties, logprobs, logit bias or token mask) asks for its next token through a
  :class:`DeviceRow` instead of for logits. When every call of a pass is such a row, the pass is
  a step of the engine's device loop over those rows (``Engine.begin_device_batch``): each row's
  token is chosen on the GPU by its own sampler's parameters and generator state and fed to the
  next step there, and the next step is committed before this one's tokens are read (depth 2).
  The loop holds the engine between its steps, so it ends (``end_device_batch``: the step in
  flight is undone) whenever the pass's rows change: a row ended, a thread was late, a new
  generation or any host call arrived. A pass that holds a host call (a prefill chunk, or a
  request that needs the logits) is a host pass for every row in it: the device rows' tokens
  are then drawn by their samplers on the host, the same algorithm on the same generator
  stream (the engine advances the host generator as the device draws), so a row's tokens do
  not depend on which kind of pass chose them.
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

from lily._core import LilyError, RequestError


@dataclass(eq=False)
class _Call:
    state: object  # lily._core.State
    tokens: np.ndarray  # int32 [n]
    alone: bool  # runs in a pass of its own (all_logits, or more tokens than a pass prefills)
    all_logits: bool = False
    row: DeviceRow | None = None  # a device row's call: its result is the next token, not logits
    thread: int = field(default_factory=threading.get_ident)
    result: Any = None
    error: BaseException | None = None
    done: bool = False


class DeviceRow:
    """A generation's decode row whose tokens are chosen by the sampling algorithm on the device
    where the pass allows it (see the module docstring); what ``lily.generation.token_loop``
    takes as its device loop. ``next()`` feeds the pending token (the last one returned, or the
    start token) and returns the next; ``close()`` takes the row out of the loop, leaving the
    state as host decoding of every returned token but the last would. ``on_fed(token)`` (a
    Session's record of its tokens) hears of each token the state takes, before the engine call
    that feeds it."""

    def __init__(self, batcher: Batcher, state, token: int, max_steps: int, sampler,
                 on_fed: Callable[[int], None] | None):
        self._batcher = batcher
        self.state = state
        self.sampler = sampler  # lily._core.Sampler (None: argmax); the device copies its parameters and generator
        self.pending = int(token)  # not yet in the state
        self.steps_left = int(max_steps)
        self._on_fed = on_fed
        self.thread = threading.get_ident()  # the generation's own (the one that calls next)
        self.closed = False

    def fed(self) -> None:
        if self._on_fed is not None:
            self._on_fed(self.pending)

    def next(self) -> int:
        if self.closed or self.steps_left <= 0:
            raise RuntimeError("this device row has ended")
        return self._batcher._run_call(_Call(self.state, np.array([self.pending], np.int32), False, row=self))

    def pause(self) -> bool:
        """Ends the device loop if it holds this row (the row stays open: its next ``next()``
        begins another), so the state holds every token the row returned but the pending one, as
        after host decoding: a snapshot of it can be taken (the server's prefix cache). False if
        the loop could not be ended (the engine lock stayed held by another thread for a second)."""
        with self._batcher._cv:
            return self._batcher._end_loop_of(self)

    def close(self) -> None:
        self._batcher._close_row(self)


@dataclass
class BatchStats:
    """Counts since the model was loaded (what the passes held; tests read max_sequences)."""

    passes: int = 0
    rows: int = 0  # decode rows and prefill tokens, summed over passes
    sequences: int = 0  # sequences, summed over passes (mean batch = sequences / passes)
    last_sequences: int = 0  # sequences in the latest pass
    max_sequences: int = 0
    retried_alone: int = 0  # passes that failed and were run again one sequence at a time
    device_steps: int = 0  # passes that were device-loop steps
    device_loops: int = 0  # device loops begun (each change of a loop's rows begins one)
    max_device_sequences: int = 0  # the most sequences in a device-loop step


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
        self._leader: int | None = None  # the leading thread
        self._last_threads: set[int] = set()  # threads served by the previous pass
        self.device_loops = bool(engine.has_device_loop)
        self._loop: list[DeviceRow] = []  # the rows of the engine's running device loop, in order
        self._loop_steps = 0  # steps that loop may still run

    def run(self, state, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Appends ``tokens`` (int32, at least one) to ``state`` in a coming pass; returns the
        last token's logits [vocab] (every token's [n, vocab] with ``all_logits``)."""
        alone = all_logits or len(tokens) > min(self.prefill_rows, self.pass_rows)
        return self._run_call(_Call(state, tokens, alone, all_logits))

    def device_row(self, state, token: int, max_steps: int, sampler,
                   on_fed: Callable[[int], None] | None = None) -> DeviceRow | None:
        """A decode row from ``token`` (not yet in ``state``) for at most ``max_steps`` more
        tokens, chosen by ``sampler`` (its parameters must allow the device: no penalties or
        logprobs, no logit bias or token mask); None where the backend has no device loop."""
        return DeviceRow(self, state, token, max_steps, sampler, on_fed) if self.device_loops else None

    def _run_call(self, call: _Call):
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
        self._leading, self._leader = True, threading.get_ident()
        batch: list[_Call] = []
        try:
            batch = self._gather()
            self._cv.release()
            try:
                self._pass(batch)
            finally:
                self._cv.acquire()
        except BaseException as e:  # Ctrl-C between the gather and the pass: its calls end with it
            for c in batch:
                if not c.done:
                    c.error, c.done = c.error or e, True
            raise
        finally:
            self._leading, self._leader = False, None
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
            for c in batch:
                if c.row is not None:
                    c.row.fed()
            if not (all(c.row is not None for c in batch) and self._device_pass(batch)):
                self._host_pass(batch)
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

    def _host_pass(self, batch: Sequence[_Call]) -> None:
        """One engine step over ``batch`` (a device row's call feeds its pending token and draws
        the next on the host); a failed pass is run again one call at a time."""
        try:
            with self._lock:
                self._end_loop()
                if len(batch) > 1:
                    out = list(self._engine.step([c.state for c in batch], [c.tokens for c in batch]))
                else:
                    out = [self._solo(batch[0])]
        except Exception as e:
            if len(batch) == 1:
                batch[0].error = e
                return
            # Nothing changed (the engine checks before it computes): again one at a time, so
            # the error reaches its own call.
            self.stats.retried_alone += 1
            out = []
            for c in batch:
                try:
                    with self._lock:
                        out.append(self._solo(c))
                except Exception as e1:
                    c.error = e1
                    out.append(None)
        for c, logits in zip(batch, out, strict=True):
            if logits is not None:
                self._complete(c, logits)

    def _complete(self, c: _Call, logits: np.ndarray) -> None:
        """The call's result from its logits (the step ran: an error here is the call's own)."""
        if c.row is None:
            c.result = logits
            return
        sampler = c.row.sampler
        try:  # the device sampler's algorithm on the host, continuing the row's generator
            token = int(np.argmax(logits)) if sampler is None else sampler.sample(logits)[0]
        except Exception as e:  # (bad logits: the CPU sampler's error, as on the device)
            c.error = e
        else:
            self._advance(c, token)

    @staticmethod
    def _advance(c: _Call, token: int) -> None:
        c.row.pending = c.result = int(token)
        c.row.steps_left -= 1

    def _device_pass(self, batch: Sequence[_Call]) -> bool:
        """One step of the device loop over ``batch``'s rows: the running loop's next step when
        it holds exactly these rows, else a new loop of them. False (nothing run) where the
        engine would not begin one; a step that fails ends the loop and fails every call."""
        if {c.row for c in batch} == set(self._loop):  # the running loop's rows (arrival order varies)
            batch = sorted(batch, key=lambda c: self._loop.index(c.row))
        rows = [c.row for c in batch]
        with self._lock:
            try:
                if rows != self._loop or self._loop_steps <= 0:
                    self._end_loop()
                    steps = min(min(r.steps_left, r.state.max_context - r.state.position) for r in rows)
                    try:
                        began = self._engine.begin_device_batch([r.state for r in rows], [r.pending for r in rows],
                                                                steps, [r.sampler for r in rows])
                    except RequestError:
                        return False  # refused before any compute: the host pass says by whom
                    if not began:
                        return False
                    self._loop, self._loop_steps = rows, steps
                    self.stats.device_loops += 1
                tokens, errors = self._engine.next_device_tokens()
            except BaseException as e:  # a failed step (or Ctrl-C): the loop ends, every call fails
                self._end_loop()
                if self._engine.device_loop_running:  # begun, then Ctrl-C before its rows were recorded
                    self._engine.end_device_batch()
                if not isinstance(e, Exception):
                    raise
                for c in batch:
                    c.error = e
                return True
            self._loop_steps -= 1
        for c, token, error in zip(batch, tokens, errors, strict=True):
            if error is None:
                self._advance(c, token)
            else:  # this row's logits were bad (the others' tokens are good): its call fails
                c.error = LilyError(error)
        self.stats.device_steps += 1
        self.stats.max_device_sequences = max(self.stats.max_device_sequences, len(batch))
        return True

    def _end_loop(self) -> None:
        """Ends the engine's device loop, if one runs (engine lock held): the step in flight is
        undone, so each row's state holds every token it returned but the pending one."""
        if self._loop:
            rows, self._loop, self._loop_steps = self._loop, [], 0
            self._engine.end_device_batch()
            del rows  # (held to here: the engine's loop points at their states and samplers)

    def _close_row(self, row: DeviceRow) -> None:
        """Takes ``row`` out: once no pass runs, the loop that holds it ends. Closed from where
        that cannot wait (a finalizer inside a pass, or in a thread holding the engine lock),
        the loop ends at the next pass or state operation instead (``settle``)."""
        with self._cv:
            if row.closed:
                return
            row.closed = True
            self._last_threads.discard(row.thread)  # a gathering leader need not wait for it
            self._cv.notify_all()
            if self._leader == threading.get_ident():
                return
            self._end_loop_of(row)

    def _end_loop_of(self, row: DeviceRow) -> bool:
        """Ends the engine's device loop if it holds ``row``, once no pass runs (condition's
        lock held); returns whether ``row`` is out of it."""
        while self._leading and row in self._loop:
            self._cv.wait()
        if row in self._loop and self._lock.acquire(timeout=1.0):  # (times out in a holder's finalizer)
            try:
                if row in self._loop:
                    self._end_loop()
            finally:
                self._lock.release()
        return row not in self._loop

    def settle(self, state) -> bool:
        """Before an operation on ``state`` (snapshot, restore, clone, export; engine lock held):
        ends the device loop if it holds a closed row, so no state's position and recurrent copy
        are those of a step in flight that a closed row will not read. Returns whether ``state``
        is still in the loop (a generation running on it)."""
        if any(r.closed for r in self._loop):
            self._end_loop()
        return any(r.state is state for r in self._loop)

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
