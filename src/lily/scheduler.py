"""One engine, many requests: the server's generation worker.

Design choices:
- Up to ``model.max_batch`` worker threads each run one job at a time, taken from one bounded
  FIFO (``queue.Queue``): requests start in arrival order, and a full queue is refused at once
  (HTTP 503) instead of piling up. The jobs running at once share every engine pass
  (continuous batching, lily.batching): each worker's token loop calls the engine for its own
  sequence and those calls are taken together into one pass, prefill chunks beside decode rows,
  so a long prompt does not stall the others. A job's tokens do not depend on which others
  share its passes (bit-identical logits; on a GPU backend passes of several sequences stay
  within engine.batch_rows for that); on backends that do not batch, one worker runs and jobs
  take turns.
- The workers take the model's generation slots (``Model._generation``) per job, so Python-API
  calls on the same model in the same process share the slots and passes with the server.
- KV memory is admitted, not discovered: a job reserves the KV cache and recurrent state of its
  whole context (prompt + max_tokens) from ``kv_budget_bytes`` before it starts, and waits (at
  the head of the queue) until running jobs free enough; a job that could never fit is refused
  at submit with an error naming both sizes. A running job therefore never runs out mid-way.
- Every job carries a cancel flag. The HTTP side sets it when the client goes away; the worker
  checks it before each prefill chunk and each decode step, so a disconnect frees the engine
  within one step. ``Scheduler.stats`` records how many steps ran after the flag was set, and why.
- Back-pressure: a job holds at most ``buffer_chunks`` generated chunks that the HTTP side has
  not taken yet. When the buffer is full (a streaming client that stopped reading: its socket's
  buffers filled and the response's send blocks), the worker waits instead of generating
  ahead, and drops the job once it has waited ``stall_timeout_s``. Output therefore never piles
  up in memory, and a stalled reader holds the engine for at most that long.
- Prompt caching: each job asks the PrefixCache for the sequence sharing the longest usable
  prefix with its prompt, prefills only the rest, and hands the sequence back afterwards (the
  cache keeps it, LRU-evicted under a byte budget). Snapshots of the recurrent state are taken
  one token before the end of the prompt (its last token is prefilled on its own: a prompt
  sent again reuses all but that token, which must be prefilled for its logits), at the end of
  the prompt, and after 16, 32, 64, ... generated tokens (log-spaced, so a long answer costs
  few). Chunking never changes the logits (docs/architecture.md), so the split costs one engine
  call, not determinism.
- ``n`` > 1 choices run one after another on the job's sequence (``lily.generation.choice_loops``,
  which ``Model.generate(n=...)`` runs too): the prompt is prefilled once, and each further
  choice rewinds the sequence to the snapshot one token before the prompt's end (the recurrent
  state restored, the KV cut back) and prefills that last token again for its logits. Choice i
  samples with seed ``seed + i``, its grammar (if any) from the start.
- Results travel back as events through a callback; the HTTP layer turns the callback into
  an asyncio queue (``loop.call_soon_threadsafe``): each choice's chunks, then its "done".
- Metrics: the scheduler reports each event where it happens (queued, rejected, started with
  its prompt and cached tokens, first chunk, each generated token, finished with its outcome)
  to a ``SchedulerMetrics``; the server's implementation is Prometheus's
  (lily.server_metrics), the default does nothing. Each outcome is counted once, in
  ``SchedulerStats`` (/health) and the metrics alike (``_finish``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lily._core import RequestError
from lily.prefix_cache import PrefixCache
from lily.request import Generation, GenerationRequest


class Cancelled(Exception):
    """Raised inside the token loop when the job's client went away."""


@dataclass(eq=False, kw_only=True)  # identity: the running set holds jobs
class Job(GenerationRequest):
    """One generation request, ready to run (a :class:`lily.request.GenerationRequest`, checked
    by the server), with the server's own state: where its events go, its cancel flag, its
    output buffer."""

    emit: Callable[[str, Any], None]  # ("chunk", GenerationChunk) | ("done", result) | ("error", exc)
    buffer_chunks: int = 64  # chunks emitted but not yet taken (took_chunk) before the worker waits
    stall_timeout_s: float = 30.0  # how long the worker waits for room before dropping the job
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_time: float | None = None
    cancel_reason: str | None = None
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the worker took it (perf_counter)

    def __post_init__(self):
        self._room = threading.Semaphore(self.buffer_chunks)

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.cancelled.is_set():
            self.cancel_time = time.perf_counter()
            self.cancel_reason = reason
            self.cancelled.set()

    def took_chunk(self) -> None:
        """The consumer took one chunk: room for the worker to emit another."""
        self._room.release()

    def wait_for_room(self) -> None:
        """Blocks the worker until the consumer has room for one more chunk; raises Cancelled
        when the job is cancelled meanwhile or no room came for stall_timeout_s."""
        deadline = time.monotonic() + self.stall_timeout_s
        while not self._room.acquire(timeout=0.05):
            if self.cancelled.is_set():
                raise Cancelled
            if time.monotonic() > deadline:
                self.cancel("slow_reader")
                raise Cancelled


OUTCOMES = ("completed", "cancelled", "failed", "rejected")  # SchedulerStats' counters


class SchedulerMetrics:
    """What the scheduler reports as it runs; these defaults ignore it (the server's
    lily.server_metrics.PrometheusMetrics counts it). Called from the worker thread, except
    ``finished("rejected")`` (the submitting thread)."""

    def set_running(self, n: int) -> None:
        """How many jobs are generating now."""

    def started(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A job got its sequence: its prompt's tokens, of which the prompt cache held ``cached_tokens``."""

    def first_chunk(self, seconds: float) -> None:
        """A job emitted its first chunk, ``seconds`` after it was queued."""

    def token(self) -> None:
        """One generated token (``usage.completion_tokens`` counts the same ones)."""

    def finished(self, outcome: str, seconds: float | None = None) -> None:
        """A job ended (one of OUTCOMES), ``seconds`` after it was queued (None: never ran)."""


@dataclass
class SchedulerStats:
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    # For the last cancelled job: engine steps (prefill chunks or decode steps) that ran after
    # the cancel flag was set, and seconds from the flag to the engine being free.
    last_cancel_steps: int | None = None
    last_cancel_release_s: float | None = None
    # "client_disconnected", "slow_reader" (no room for stall_timeout_s) or "shutdown".
    last_cancel_reason: str | None = None
    last_cancel_tokens: int | None = None  # tokens the cancelled job had generated


class Scheduler:
    """Worker threads running queued Jobs on ``model``, up to ``model.max_batch`` at once."""

    def __init__(self, model, *, max_queue: int = 64, cache_bytes: int = 1 << 30,
                 max_snapshots: int = 12, metrics: SchedulerMetrics | None = None,
                 kv_budget_bytes: int | None = None):
        self.model = model
        self.metrics = metrics or SchedulerMetrics()
        self.cache = PrefixCache(model, cache_bytes, max_snapshots=max_snapshots)
        self.stats = SchedulerStats()
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Condition()  # guards _running, the stats' counters and the KV reservations
        self._running: set[Job] = set()
        # Per-sequence memory: its recurrent state (fixed) plus the KV cache of its context.
        with model._lock:  # (a GPU backend's new_state waits for the device: not inside another pass)
            self._recurrent_bytes = int(model._engine.new_state(1).nbytes)
        self.kv_budget_bytes = kv_budget_bytes if kv_budget_bytes is not None else default_kv_budget()
        self.kv_reserved = 0
        self._threads = [threading.Thread(target=self._run, name=f"lily-engine-{i}", daemon=True)
                         for i in range(model.max_batch)]
        for t in self._threads:
            t.start()

    @property
    def running(self) -> list[Job]:
        """The jobs generating now."""
        with self._lock:
            return list(self._running)

    def job_bytes(self, job: Job) -> int:
        """Memory a job's sequence can grow to: KV cache of its whole context, recurrent state."""
        positions = min(int(job.ids.size) + job.max_tokens, self.model.max_context)  # n choices reuse it
        return int(self.model._engine.kv_bytes(positions)) + self._recurrent_bytes

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        """Queues ``job``; raises ``queue.Full`` when the queue is at its limit, RequestError
        when its sequence could never fit the KV budget."""
        need = self.job_bytes(job)
        if need > self.kv_budget_bytes:
            raise RequestError(f"[server] the request's context (prompt {job.ids.size} + max_tokens {job.max_tokens}"
                               f" tokens) needs {need / 2**20:.1f} MiB of KV cache and state; the server's KV budget "
                               f"is {self.kv_budget_bytes / 2**20:.1f} MiB (--kv-budget-mb): ask for fewer tokens")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._finish(job, "rejected")
            raise

    def _finish(self, job: Job, outcome: str) -> None:
        """Counts a job's end, in the stats and the metrics alike."""
        with self._lock:
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        ran = outcome != "rejected" and job.started is not None
        self.metrics.finished(outcome, time.perf_counter() - job.enqueued if ran else None)

    def shutdown(self, timeout: float = 5.0) -> None:
        for job in self.running:
            job.cancel("shutdown")
        while True:  # drop waiting jobs, then wake the workers
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel("shutdown")
        with self._lock:
            self._lock.notify_all()  # a worker waiting for KV room sees its job cancelled
        deadline = time.monotonic() + timeout
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            need = self.job_bytes(job)
            with self._lock:  # at the head of the queue: wait for KV room (the others wait behind)
                while self.kv_reserved + need > self.kv_budget_bytes and not job.cancelled.is_set():
                    self._lock.wait(0.1)
                if not job.cancelled.is_set():
                    self.kv_reserved += need
                    self._running.add(job)
                    self.metrics.set_running(len(self._running))
            if job.cancelled.is_set():
                self._finish(job, "cancelled")
                continue
            try:
                self._generate(job)
            finally:
                with self._lock:
                    self.kv_reserved -= need
                    self._running.discard(job)
                    self.metrics.set_running(len(self._running))
                    self._lock.notify_all()

    def _generate(self, job: Job) -> None:
        """Runs ``job`` through the generation flow (lily.request.Generation) with the server's
        hooks: the prefix cache supplies the sequence and gets it back, the cancel flag is
        checked before each engine call, snapshots are taken for later requests, metrics counted."""
        steps_after_cancel = 0
        stream = None

        def sequence():
            seq, reused = self.cache.acquire(job.ids)
            job.started = time.perf_counter()
            self.metrics.started(int(job.ids.size), reused)
            return seq, reused

        def step(fn, arg):
            # The flag is checked before every engine call; a step already running when
            # the client leaves finishes (counted in steps_after_cancel), none starts after.
            nonlocal steps_after_cancel
            if job.cancelled.is_set():
                raise Cancelled
            out = fn(arg)
            if job.cancel_time is not None:
                steps_after_cancel += 1
            return out

        last = None  # the last choice's result, sent once the flow has closed
        evicted: list = []  # what the prefix cache evicted for this sequence, written after the answer
        try:
            with Generation(self.model, job, sequence, step=step, on_prefilled=lambda seq: seq.take_snapshot(),
                            on_close=lambda seq: evicted.extend(self.cache.keep(seq)),
                            snapshot_prompt=True, snapshot_decoded=True) as run:
                first = True
                for choice, stream in enumerate(run.streams()):
                    try:
                        for c in stream:
                            if c.token is not None:
                                self.metrics.token()
                            job.wait_for_room()
                            if first:
                                self.metrics.first_chunk(time.perf_counter() - job.enqueued)
                                first = False
                            job.emit("chunk", c)
                    finally:
                        stream.close()  # a job dropped between steps: close the token loop now
                    if choice == job.n - 1:  # counted before the client can see its answer (and scrape)
                        self._finish(job, "completed")
                        last = stream.result
                    else:
                        job.emit("done", stream.result)
            # After the flow closed: the prefix cache has the sequence back, so a client that sends
            # its next request the moment it has this answer finds the prompt cached (before, that
            # request could race the release and prefill everything again). Sequences that made
            # room for it go to the disk tier after the answer.
            job.emit("done", last)
        except Cancelled:
            self._finish(job, "cancelled")
            self.stats.last_cancel_reason = job.cancel_reason
            self.stats.last_cancel_tokens = stream.result.completion_tokens if stream is not None else 0
            self.stats.last_cancel_steps = steps_after_cancel
            self.stats.last_cancel_release_s = (time.perf_counter() - job.cancel_time
                                                if job.cancel_time is not None else None)
        except Exception as e:  # a bad request that got past validation; keep serving
            self._finish(job, "failed")
            job.emit("error", e)
        finally:
            self.cache.store(evicted)


def default_kv_budget() -> int:
    """Half the memory available now (the rest: weights not yet faulted in, the prompt cache,
    Python), at least 256 MiB."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8 << 30
    return max(avail // 2, 256 << 20)
