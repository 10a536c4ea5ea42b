"""The token loop: prefill, sample, decode, detokenize, stop.

One generator, ``token_loop``, serves every caller (``Model.generate``, ``Chat.send``, the
server): it yields a :class:`GenerationChunk` per sampled token and a last chunk carrying the
finish reason. Non-streaming calls drain it into a :class:`GenerationResult`.

The engine call for each step releases the GIL; between steps the loop is plain Python, so
Ctrl-C raises KeyboardInterrupt within one decode step (or one prefill chunk) and breaking
out of a stream stops generation at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lily import _core
from lily._core import RequestError
from lily.stopping import StopStringMatcher

#: Tokens of recent context the repetition penalties look at (prompt tail + completion), as in
#: llama.cpp's default ``repeat_last_n``.
PENALTY_WINDOW = 64


@dataclass
class GenerationChunk:
    """One streamed step: the text it adds (possibly ``""`` while a character or a possible
    stop string is held back), the sampled token, and on the last chunk the finish reason."""

    text: str
    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    """A finished generation."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    cached_tokens: int = 0  # prompt tokens reused from a conversation's state, not prefilled
    logprobs: list[dict[str, Any]] | None = None
    # Chat: the text split into reasoning, answer and tool calls.
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that went through the model in this call."""
        return self.prompt_tokens - self.cached_tokens

    def __str__(self) -> str:
        return self.text


@dataclass
class GenerationStats:
    """Filled in by token_loop as it runs."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None


class GenerationLock:
    """One generation at a time per model. Other threads wait their turn; the thread that
    already holds it (say, an unfinished stream it forgot to close) gets a clear error instead
    of a deadlock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            raise RequestError(
                "[generate] this thread already has a generation running on this model (an unfinished "
                "stream?): exhaust or close() it first"
            )
        self._lock.acquire()
        self._owner = me

    def release(self) -> None:
        self._owner = None
        self._lock.release()


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any], logprobs: int | bool | None):
    """Builds native SamplingParams: explicit arguments over the checkpoint's defaults."""
    kw = dict(defaults)
    for k, v in overrides.items():
        if v is not None:
            kw[k] = v
    seed = kw.pop("seed", None)
    kw["seed"] = int(np.random.SeedSequence().entropy % (1 << 63)) if seed is None else int(seed)
    kw["top_logprobs"] = int(logprobs) if logprobs and logprobs is not True else 0
    try:
        params = _core.SamplingParams(**kw)
    except TypeError as e:
        raise RequestError(f"[generate] bad sampling parameter: {e}") from None
    params.validate()
    return params


def token_loop(
    prefill: Callable[[np.ndarray], np.ndarray],
    decode: Callable[[int], np.ndarray],
    prompt_ids: np.ndarray,
    *,
    chunk: int,
    params,
    max_tokens: int,
    eos_ids: Sequence[int],
    detokenizer,
    stop: str | Sequence[str] | None,
    want_logprobs: bool,
    history: Sequence[int],
    stats: GenerationStats,
    on_prefilled: Callable[[], None] | None = None,
    on_prefill_progress: Callable[[int, int], None] | None = None,
    device_loop: Callable[[int, int, Any], DeviceLoop | None] | None = None,
) -> Iterator[GenerationChunk]:
    """Prefills ``prompt_ids`` (in chunks, so Ctrl-C is honoured) and generates.

    ``prefill(ids)`` / ``decode(tok)`` append to the caller's state and return the last
    logits. ``history`` is the context before ``prompt_ids`` (for the penalty window). The
    last sampled token is not fed to the model (nothing would read its logits).

    ``device_loop(token, max_steps, sampler)``, when given, may return a :class:`DeviceLoop`:
    after the first token (sampled here from the prefill's logits) each token is then chosen on
    the device, by the same algorithm from the same random stream, and fed to the next step
    there. The loop is closed when generation stops, undoing the step made past the end.
    """
    if max_tokens < 0:
        raise RequestError("[generate] max_tokens must be non-negative")
    # Only ids the detokenizer can turn into text: an embedding may have rows past the tokenizer's
    # entries (Qwen3.5/3.6: 248,320 rows, 248,077 tokens), which no sampler may choose.
    sampler = _core.Sampler(params, token_limit=detokenizer.vocab_size if detokenizer is not None else 0)
    matcher = StopStringMatcher(stop)
    eos = set(int(e) for e in eos_ids)
    window: deque[int] = deque(list(history)[-PENALTY_WINDOW:], maxlen=PENALTY_WINDOW)
    window.extend(int(t) for t in prompt_ids[-PENALTY_WINDOW:])

    t0 = time.perf_counter()
    logits = None
    for i in range(0, len(prompt_ids), chunk):
        logits = prefill(prompt_ids[i : i + chunk])
        if on_prefill_progress is not None:  # (tokens done, total): progress bars
            on_prefill_progress(min(i + chunk, len(prompt_ids)), len(prompt_ids))
    stats.prefill_s = time.perf_counter() - t0
    if on_prefilled is not None:
        on_prefilled()
    if max_tokens == 0:
        stats.finish_reason = "length"
        yield GenerationChunk("", None, finish_reason="length")
        return

    t_decode = time.perf_counter()
    dev: DeviceLoop | None = None
    try:
        while True:
            if dev is None:
                tok, lp, top = sampler.sample(logits, np.fromiter(window, dtype=np.int32, count=len(window)))
            else:
                tok, lp, top = dev.next(), None, None
            if stats.completion_tokens == 0:
                stats.ttft_s = time.perf_counter() - t0
            if tok in eos:
                finish = "stop"
                text = ""
            else:
                stats.completion_tokens += 1
                window.append(tok)
                text = matcher.feed(detokenizer.feed(tok)) if detokenizer is not None else ""
                finish = "stop" if matcher.stopped else ("length" if stats.completion_tokens >= max_tokens else None)
            if finish is not None:
                if not matcher.stopped and detokenizer is not None:
                    text += matcher.feed(detokenizer.flush())
                    text += matcher.flush() if not matcher.stopped else ""
                stats.decode_s = time.perf_counter() - t_decode
                stats.finish_reason = finish
                is_eos = tok in eos
                yield GenerationChunk(
                    text,
                    None if is_eos else tok,
                    None if is_eos or not want_logprobs else lp,
                    None if is_eos or not want_logprobs else top,
                    finish,
                )
                return
            yield GenerationChunk(text, tok, lp if want_logprobs else None, top if want_logprobs else None)
            if device_loop is not None:  # tried once: None where the backend has no device loop
                # At most max_tokens - completion_tokens more tokens, one step each.
                dev = device_loop(tok, max_tokens - stats.completion_tokens, sampler)
                device_loop = None
            if dev is None:
                logits = decode(tok)
    finally:
        if dev is not None:
            dev.close()


class DeviceLoop:
    """A decode loop whose tokens stay on the device (GPU backends; ``Engine.begin_device_decode``).

    ``next()`` commits the following step before it waits for the oldest one's token, so the
    device never waits for Python; ``close()`` undoes the step still in flight, leaving the state
    as host decoding of every returned token but the last would.
    """

    def __init__(self, engine, state, lock: threading.Lock):
        self._engine, self._state, self._lock = engine, state, lock
        self._open = True

    @classmethod
    def start(cls, engine, state, lock, token: int, max_steps: int, sampler) -> DeviceLoop | None:
        with lock:
            if not engine.begin_device_decode(state, int(token), int(max_steps), sampler):
                return None
        return cls(engine, state, lock)

    def next(self) -> int:
        with self._lock:
            return self._engine.next_device_token(self._state)

    def close(self) -> None:
        if self._open:
            self._open = False
            with self._lock:
                self._engine.end_device_decode(self._state)


def device_loop_allowed(params, want_logprobs: bool) -> bool:
    """Whether a request can choose its tokens on the device: penalties and logprobs need the
    logits on the host."""
    return (not want_logprobs and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0)


def collect(chunks: Iterator[GenerationChunk], stats: GenerationStats, want_logprobs: bool) -> GenerationResult:
    """Drains a token loop into a GenerationResult."""
    texts, tokens, lps = [], [], []
    for c in chunks:
        texts.append(c.text)
        if c.token is not None:
            tokens.append(c.token)
            if want_logprobs:
                lps.append({"token": c.token, "logprob": c.logprob, "top_logprobs": c.top_logprobs})
    return result_from(stats, "".join(texts), tokens, lps if want_logprobs else None)


def result_from(stats: GenerationStats, text: str, tokens: list[int], logprobs) -> GenerationResult:
    prefilled = stats.prompt_tokens - stats.cached_tokens
    decoded = max(stats.completion_tokens - 1, 0)  # the first token comes from the prefill
    return GenerationResult(
        text=text,
        tokens=tokens,
        finish_reason=stats.finish_reason or "stop",
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        ttft_s=stats.ttft_s,
        prefill_tokens_per_s=prefilled / stats.prefill_s if stats.prefill_s > 0 else 0.0,
        decode_tokens_per_s=decoded / stats.decode_s if stats.decode_s > 0 and decoded else 0.0,
        cached_tokens=stats.cached_tokens,
        logprobs=logprobs,
    )


class GenerationStream:
    """The iterator ``generate(..., stream=True)`` returns.

    Iterate it (``for chunk in stream``); breaking out, ``close()``, or leaving a ``with``
    block stops generation and frees the model. ``result`` holds the GenerationResult once
    the stream is exhausted.
    """

    def __init__(self, chunks: Iterator[GenerationChunk], stats: GenerationStats, want_logprobs: bool,
                 on_finish: Callable[[GenerationResult | None], None]):
        self._chunks = chunks
        self._stats = stats
        self._want_logprobs = want_logprobs
        self._on_finish = on_finish
        self._texts: list[str] = []
        self._tokens: list[int] = []
        self._lps: list[dict] = []
        self._done = False
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> GenerationChunk:
        if self._done:
            raise StopIteration
        try:
            c = next(self._chunks)
        except StopIteration:
            self._finish(complete=True)
            raise
        except BaseException:
            self._finish(complete=False)
            raise
        self._texts.append(c.text)
        if c.token is not None:
            self._tokens.append(c.token)
            if self._want_logprobs:
                self._lps.append({"token": c.token, "logprob": c.logprob, "top_logprobs": c.top_logprobs})
        if c.finish_reason is not None:
            self._finish(complete=True)
        return c

    def _finish(self, complete: bool) -> None:
        if self._done:
            return
        self._done = True
        self._chunks.close()
        if complete:
            self.result = result_from(self._stats, "".join(self._texts), self._tokens,
                                      self._lps if self._want_logprobs else None)
        self._on_finish(self.result)

    def close(self) -> None:
        """Stops generation (if still running) and frees the model."""
        self._finish(complete=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
