"""The token loop: prefill, sample, decode, detokenize, stop.

One generator, ``token_loop``, serves every caller (``Model.generate``, ``Chat.send``, the
server), each through ``choice_loops`` (one prompt prefilled once, n choices from it): it yields
a :class:`GenerationChunk` per sampled token and a last chunk carrying the finish reason.
Non-streaming calls drain it into a :class:`GenerationResult`.

The engine call for each step releases the GIL; between steps the loop is plain Python, so
Ctrl-C raises KeyboardInterrupt within one decode step (or one prefill chunk) and breaking
out of a stream stops generation at once.

Lifetimes: a model runs up to ``max_batch`` generations at once (:class:`GenerationSlots`;
they share engine passes, lily.batching). A :class:`GenerationStream` holds a slot from its
creation until it ends, however it ends (exhausted, closed, garbage-collected, interrupted,
ended by the same thread's next ``generate`` when no slot is free, or idle while another
generation waits), and always leaves a ``result``; ``Model.generate``, ``Chat`` and the
server's jobs go through it, streamed or not.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lily import _core
from lily._core import RequestError
from lily.stopping import StopStringMatcher
from lily.structured import TokenConstraint
from lily.tool_calls import parse_output

if TYPE_CHECKING:
    from lily.batching import DeviceRow
    from lily.model import Session

#: Tokens of recent context the repetition penalties look at (prompt tail + completion), as in
#: llama.cpp's default ``repeat_last_n``.
PENALTY_WINDOW = 64


@dataclass
class GenerationChunk:
    """One streamed step: the text it adds (possibly ``""`` while a character or a possible
    stop string is held back), the sampled token, its logprob and top ``(id, logprob)`` pairs
    when asked for, and on the last chunk the finish reason."""

    text: str
    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    index: int = 0  # the prompt's position in generate([...], stream=True)'s list
    # With logprobs: this token's entry as GenerationResult.logprobs holds it (texts decoded once).
    logprob_entry: dict[str, Any] | None = None


@dataclass(repr=False)
class GenerationResult:
    """A finished generation.

    ``finish_reason``: "stop" (EOS or a stop string), "length" (``max_tokens`` or the context)
    or "cancelled" (the stream was closed, garbage-collected, interrupted by Ctrl-C or ended by
    the next ``generate``; ``text`` and ``tokens`` then hold what was generated until then).
    ``logprobs``, when asked for: one dict per token, ``{"token": id, "text": str, "logprob":
    float, "top_logprobs": [{"token", "text", "logprob"}, ...]}``. ``content``, ``reasoning``
    and ``tool_calls`` split ``text`` into the answer, the ``<think>`` block and parsed tool
    calls (see :func:`lily.tool_calls.parse_output`).
    """

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    cached_tokens: int = 0  # prompt tokens reused from a conversation's state, not prefilled
    logprobs: list[dict[str, Any]] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that went through the model in this call."""
        return self.prompt_tokens - self.cached_tokens

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        # A notebook shows this: the text (shortened), how it ended and how fast, not the token ids.
        text = self.text if len(self.text) <= 200 else self.text[:200] + "..."
        extra = f", reasoning={_short(self.reasoning)}" if self.reasoning else ""
        extra += f", tool_calls={len(self.tool_calls)}" if self.tool_calls else ""
        return (f"GenerationResult(text={text!r}{extra}, finish_reason={self.finish_reason!r}, "
                f"prompt_tokens={self.prompt_tokens}, completion_tokens={self.completion_tokens}, "
                f"cached_tokens={self.cached_tokens}, ttft={self.ttft_s * 1e3:.0f} ms, "
                f"prefill={self.prefill_tokens_per_s:.1f} tok/s, decode={self.decode_tokens_per_s:.1f} tok/s)")


def _short(text: str | None, limit: int = 60) -> str:
    text = text or ""
    return repr(text if len(text) <= limit else text[:limit] + "...")


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


class GenerationSlots:
    """At most ``capacity`` generations at once per model; more wait for a slot.

    On a backend that batches (the CPU) the capacity is the model's ``max_batch``: the running
    generations share every engine pass (lily.batching). Elsewhere it is 1, and generations take
    turns. Streams are lazy (a step runs when the consumer asks for the next chunk), so a
    stream holds its slot until it ends; two rules keep that from blocking others forever:
    - A thread's own earlier stream that is still open cannot make progress while that thread
      waits, so when no slot is free, starting a generation ends the thread's oldest open stream
      first (its result is kept, finish_reason "cancelled"). Waiting on a stream of its own that
      is in the middle of a step (from a progress callback) is an error.
    - A stream nobody has stepped for ``idle_timeout_s`` (abandoned without ``close()`` but still
      referenced) is ended when another generation needs its slot.
    """

    def __init__(self, capacity: int = 1, idle_timeout_s: float = 60.0) -> None:
        self.capacity = max(1, int(capacity))
        self.idle_timeout_s = idle_timeout_s
        self._cv = threading.Condition()
        self.held = 0
        # Open streams holding a slot, by the thread that started them: weak references, so
        # dropping a stream still garbage-collects it (which closes it and frees its slot).
        self._streams: dict[int, list[weakref.ref[GenerationStream]]] = {}

    def _open(self, thread: int | None = None) -> list[GenerationStream]:
        """Open streams holding slots, oldest first (of one thread, if given)."""
        refs = self._streams.get(thread, []) if thread is not None else [r for v in self._streams.values() for r in v]
        return [s for s in (r() for r in refs) if s is not None and not s._done]

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cv:
            while self.held >= self.capacity:
                mine = self._open(me)
                if mine and mine[0]._stepping:
                    raise RequestError("[generate] a generation cannot start inside another one on the same model "
                                       "and thread (from a callback?) while every generation slot is taken")
                now = time.monotonic()
                idle = [s for s in self._open() if now - s._last_step > self.idle_timeout_s]
                victim = mine[0] if mine else (idle[0] if idle else None)
                if victim is None:
                    self._cv.wait(min(1.0, self.idle_timeout_s))
                    continue
                self._cv.release()
                try:
                    victim._end_if_idle(force=bool(mine))  # frees its slot (unless it started a step)
                finally:
                    self._cv.acquire()
            self.held += 1

    def attach(self, stream: GenerationStream) -> None:
        """Records the open stream holding a slot (``acquire`` may end it)."""
        with self._cv:
            self._streams.setdefault(threading.get_ident(), []).append(weakref.ref(stream))

    def release(self) -> None:
        with self._cv:
            self.held -= 1
            for thread, refs in list(self._streams.items()):
                refs[:] = [r for r in refs if (s := r()) is not None and not s._done]
                if not refs:
                    del self._streams[thread]
            self._cv.notify()


# Sampling arguments and the Python types they take (checked here so a wrong type is one line
# naming the argument, not the native binding's signature listing).
_REAL = (int, float, np.integer, np.floating)
_INTEGER = (int, np.integer)
SAMPLING_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "temperature": (_REAL, "a number"),
    "top_p": (_REAL, "a number"),
    "top_k": (_INTEGER, "an integer"),
    "min_p": (_REAL, "a number"),
    "repetition_penalty": (_REAL, "a number"),
    "presence_penalty": (_REAL, "a number"),
    "frequency_penalty": (_REAL, "a number"),
    "seed": (_INTEGER, "an integer"),
}


def check_type(where: str, name: str, value: Any, types: tuple[type, ...], what: str) -> None:
    """Raises RequestError naming ``name`` when ``value`` is not one of ``types`` (bools are
    not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, types):
        raise RequestError(f"[{where}] {name} must be {what}, got {type(value).__name__} {value!r}")


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any], logprobs: int | bool | None):
    """Builds native SamplingParams: explicit arguments over the checkpoint's defaults."""
    kw = dict(defaults)
    for k, v in overrides.items():
        if v is not None:
            types, what = SAMPLING_TYPES[k]
            check_type("generate", k, v, types, what)
            kw[k] = v
    if logprobs is not None and not isinstance(logprobs, bool):
        check_type("generate", "logprobs", logprobs, _INTEGER, "True, False or an integer")
    seed = kw.pop("seed", None)
    if seed is not None and not 0 <= int(seed) < (1 << 64):
        raise RequestError(f"[generate] seed must be in [0, 2**64), got {seed}")
    kw["seed"] = int(np.random.SeedSequence().entropy % (1 << 63)) if seed is None else int(seed)
    kw["top_logprobs"] = int(logprobs) if logprobs and logprobs is not True else 0
    kw = {k: int(v) if k in ("seed", "top_k", "top_logprobs") else float(v) for k, v in kw.items()}
    try:
        params = _core.SamplingParams(**kw)
    except TypeError:  # an integer too large for the native field
        raise RequestError("[generate] top_k or logprobs is out of range") from None
    params.validate()
    return params


def reseeded(params, offset: int):
    """``params`` with the seed moved by ``offset`` (the i-th of n choices; 0: ``params`` itself)."""
    if offset == 0:
        return params
    # Every field of the native params (its read-write properties), so a new one is carried too.
    fields = {name: getattr(params, name) for name, attr in vars(_core.SamplingParams).items()
              if isinstance(attr, property)}
    return _core.SamplingParams(**fields | {"seed": (params.seed + offset) % (1 << 64)})


def logit_bias_pairs(bias: Any, vocab_size: int, where: str = "generate") -> list[tuple[int, float]]:
    """``logit_bias`` ({token id: bias}, as OpenAI's) checked and listed as (id, bias) pairs:
    ids in [0, vocab_size), biases finite numbers (OpenAI takes -100 to 100; the Python API
    takes any finite value)."""
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise RequestError(f"[{where}] logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
    pairs = []
    for token, value in bias.items():
        check_type(where, "logit_bias key", token, _INTEGER, "a token id (an integer)")
        check_type(where, f"logit_bias[{token}]", value, _REAL, "a number")
        if not 0 <= int(token) < vocab_size:
            raise RequestError(f"[{where}] logit_bias token {token} is outside the vocabulary [0, {vocab_size})")
        if not np.isfinite(value):
            raise RequestError(f"[{where}] logit_bias[{token}] must be finite, got {value}")
        pairs.append((int(token), float(value)))
    return pairs


def stop_token_list(ids: Any, vocab_size: int, where: str = "generate") -> list[int]:
    """``stop_token_ids`` checked: token ids in [0, vocab_size) that end generation like EOS."""
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, np.ndarray)):
        raise RequestError(f"[{where}] stop_token_ids must be a list of token ids, got {type(ids).__name__}")
    for t in ids:
        check_type(where, "stop_token_ids entry", t, _INTEGER, "a token id (an integer)")
        if not 0 <= int(t) < vocab_size:
            raise RequestError(f"[{where}] stop token id {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def check_stop(stop: Any) -> None:
    """``stop``: None, a string or a sequence of strings."""
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"[generate] stop must be a string or a list of strings, got {stop!r}")


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
    device_loop: Callable[[int, int, Any], DeviceRow | None] | None = None,
    logit_bias: Sequence[tuple[int, float]] = (),
    constraint: TokenConstraint | None = None,
) -> Iterator[GenerationChunk]:
    """Prefills ``prompt_ids`` (in chunks, so Ctrl-C is honoured) and generates.

    ``prefill(ids)`` / ``decode(tok)`` append to the caller's state and return the last
    logits. ``history`` is the context before ``prompt_ids`` (for the penalty window). The
    last sampled token is not fed to the model (nothing would read its logits).

    ``device_loop(token, max_steps, sampler)``, when given, may return a
    :class:`lily.batching.DeviceRow`: after the first token (sampled here from the prefill's
    logits) each token is then chosen by the same algorithm from the same random stream, on the
    device where the pass allows it, and fed to the next step there. The row is closed when
    generation stops, undoing the step made past the end.

    ``logit_bias`` ((id, bias) pairs) and ``constraint`` (structured output: a token mask per
    step, see lily.structured) are applied by the host sampler, so such requests never take the
    device loop.
    """
    if max_tokens < 0:
        raise RequestError("[generate] max_tokens must be non-negative")
    # Only ids the detokenizer can turn into text: an embedding may have rows past the tokenizer's
    # entries (Qwen3.5/3.6: 248,320 rows, 248,077 tokens), which no sampler may choose.
    sampler = _core.Sampler(params, token_limit=detokenizer.vocab_size if detokenizer is not None else 0)
    if logit_bias:
        sampler.set_logit_bias(list(logit_bias))
    if logit_bias or constraint is not None:
        device_loop = None  # the GPU sampler has neither a bias nor a per-step mask
    matcher = StopStringMatcher(stop)
    eos = set(int(e) for e in eos_ids)
    window: deque[int] = deque(list(history)[-PENALTY_WINDOW:], maxlen=PENALTY_WINDOW)
    window.extend(int(t) for t in prompt_ids[-PENALTY_WINDOW:])

    t0 = time.perf_counter()
    t_decode: float | None = None
    dev: DeviceRow | None = None
    try:
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
        while True:
            if dev is None:
                if constraint is not None:
                    sampler.set_allowed_tokens(constraint.mask())
                tok, lp, top = sampler.sample(logits, np.fromiter(window, dtype=np.int32, count=len(window)))
                if constraint is not None and tok not in eos:
                    constraint.consume(tok)
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
        if stats.finish_reason is None:  # closed, interrupted or failed before the end
            stats.finish_reason = "cancelled"
            if t_decode is not None:
                stats.decode_s = time.perf_counter() - t_decode


def choice_loops(
    seq: Session,
    prompt_ids: np.ndarray,
    reused: int,
    n: int,
    *,
    prefill: Callable[[np.ndarray], np.ndarray],
    params,
    detokenizer: Callable[[], Any],
    constraint: TokenConstraint | None = None,
    snapshot_prompt: bool = False,
    on_prefill_progress: Callable[[int, int], None] | None = None,
    **loop: Any,
) -> Iterator[tuple[GenerationStats, Iterator[GenerationChunk]]]:
    """The token loops of ``n`` choices for one prompt, one after another: each choice's stats
    and chunks (``token_loop``). The server's jobs and ``Model.generate(n=...)`` both run this.

    ``seq`` holds ``prompt_ids[:reused]``; ``prefill`` appends a chunk to it (``seq.prefill``,
    or the server's wrapper of it that checks for a cancelled job). The prompt is prefilled once:
    its last token on its own, after a snapshot of the state there (with ``snapshot_prompt``,
    the server's prefix cache wants that snapshot for every prompt; otherwise only n > 1 takes
    it). Each later choice rewinds ``seq`` to that snapshot (recurrent state restored, KV cut
    back) and prefills the last token again for its logits; chunking never changes the logits,
    so choice i is the generation a fresh state gives with seed ``seed + i``
    (:func:`reseeded`). ``constraint`` starts over for each choice. ``detokenizer()`` makes a
    fresh one per choice. ``on_prefill_progress`` reports the first choice's prefill only.
    ``loop``: ``token_loop``'s other keyword arguments (``decode``, ``chunk``, ``max_tokens``, ...).
    """
    prompt_end = int(prompt_ids.size)
    split = snapshot_prompt or n > 1

    def prefill_prompt(chunk: np.ndarray) -> np.ndarray:
        if split and seq.position + len(chunk) == prompt_end:
            if len(chunk) > 1:
                prefill(chunk[:-1])
            seq.take_snapshot()  # a no-op where one is there already
            chunk = chunk[-1:]
        return prefill(chunk)

    for choice in range(n):
        if choice:
            reused = seq.rewind(prompt_ids)
            if constraint is not None:
                constraint.reset()
        stats = GenerationStats(prompt_tokens=prompt_end, cached_tokens=reused)
        yield stats, token_loop(prefill_prompt, prompt_ids=prompt_ids[reused:], history=prompt_ids[:reused],
                                params=reseeded(params, choice), detokenizer=detokenizer(), stats=stats,
                                constraint=constraint,
                                on_prefill_progress=on_prefill_progress if choice == 0 else None, **loop)


def device_loop_allowed(params, want_logprobs: bool) -> bool:
    """Whether a request can choose its tokens on the device: penalties and logprobs need the
    logits on the host."""
    return (not want_logprobs and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0)


def result_from(stats: GenerationStats, text: str, tokens: list[int], logprobs) -> GenerationResult:
    prefilled = stats.prompt_tokens - stats.cached_tokens
    decoded = max(stats.completion_tokens - 1, 0)  # the first token comes from the prefill
    return GenerationResult(
        text=text,
        tokens=tokens,
        finish_reason=stats.finish_reason or "cancelled",
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

    Iterate it (``for chunk in stream``). ``result`` holds the GenerationResult once the stream
    has ended: exhausted (finish_reason "stop" or "length"), or ended early (finish_reason
    "cancelled", with the text and tokens generated until then) by ``close()``, by leaving a
    ``with`` block, by garbage collection once no reference is left, by Ctrl-C inside the
    stream, or by the next ``generate`` on the same model from the same thread. Each of these
    stops generation at once and frees the model.
    """

    def __init__(self, chunks: Iterator[GenerationChunk], stats: GenerationStats, lock: GenerationSlots | None, *,
                 want_logprobs: bool, token_text: Callable[[int], str] | None = None, chat: bool = False,
                 tools: Sequence[dict] | None = None, reasoning_started: bool = False,
                 on_finish: Callable[[GenerationResult], None] | None = None):
        """Takes over ``lock`` (already acquired) until the stream ends (None: the caller
        holds the lock, as ``generate(n=...)`` does across its choices). ``token_text(id)``
        gives logprob entries their text. ``chat``: the prompt was a chat turn, so the text is
        split into content, reasoning and calls to ``tools``; ``reasoning_started``: the prompt
        opened a ``<think>`` block, so the text starts as reasoning. ``on_finish(result)`` runs
        once, before the lock is released."""
        self._chunks = chunks
        self._stats = stats
        self._lock = lock
        self._want_logprobs = want_logprobs
        self._token_text = token_text or (lambda _tok: "")
        self._chat = chat
        self._tools = tools
        self.reasoning_started = reasoning_started
        self._on_finish = on_finish
        self._texts: list[str] = []
        self._tokens: list[int] = []
        self._lps: list[dict[str, Any]] = []
        self._stepping = False  # inside __next__ (a callback there must not end this stream)
        self._step_lock = threading.Lock()  # held by __next__; another thread ends an idle stream only between steps
        self._last_step = time.monotonic()  # when the consumer last asked for a chunk (idle streams lose their slot)
        self._done = False
        self.result: GenerationResult | None = None
        if lock is not None:
            lock.attach(self)

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationChunk:
        with self._step_lock:
            return self._step()

    def _step(self) -> GenerationChunk:
        if self._done:
            raise StopIteration
        self._stepping = True
        self._last_step = time.monotonic()
        try:
            c = next(self._chunks)
        except StopIteration:
            self._finish()
            raise
        except BaseException:  # Ctrl-C or an error: the generation ends here, the model is freed
            self._finish()
            raise
        finally:
            self._stepping = False
            self._last_step = time.monotonic()
        self._texts.append(c.text)
        if c.token is not None:
            self._tokens.append(c.token)
            if self._want_logprobs:
                c.logprob_entry = self._logprob_entry(c.token, c.logprob) | {
                    "top_logprobs": [self._logprob_entry(t, p) for t, p in c.top_logprobs or ()]}
                self._lps.append(c.logprob_entry)
        if c.finish_reason is not None:
            self._finish()
        return c

    def _logprob_entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "text": self._token_text(token), "logprob": logprob}

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._chunks.close()  # a generator ended early runs its cleanup (device loop, stats)
            if self._stats.finish_reason is None:  # closed before its first step
                self._stats.finish_reason = "cancelled"
            text = "".join(self._texts)
            result = result_from(self._stats, text, self._tokens, self._lps if self._want_logprobs else None)
            if self._chat:
                parsed = parse_output(text, tools=self._tools, reasoning_started=self.reasoning_started)
                result.content, result.reasoning, result.tool_calls = (
                    parsed.content, parsed.reasoning, parsed.tool_calls)
            else:
                result.content = text
            self.result = result
            if self._on_finish is not None:
                self._on_finish(result)
        finally:
            if self._lock is not None:
                self._lock.release()

    def _end_if_idle(self, force: bool) -> None:
        """Ends the stream for a generation waiting for its slot (GenerationSlots.acquire):
        ``force``, the waiting thread's own stream; else only if nobody stepped it meanwhile."""
        if force:
            self._finish()
            return
        if self._step_lock.acquire(blocking=False):
            try:
                self._finish()
            finally:
                self._step_lock.release()

    def drain(self) -> GenerationResult:
        """Runs the stream to its end and returns the result (``generate(stream=False)``)."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        """Stops generation (if still running) and frees the model; ``result`` keeps what was
        generated, with finish_reason "cancelled"."""
        self._finish()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self.result is not None:
            r = self.result
            return (f"<lily.GenerationStream finished: {r.finish_reason}, {r.completion_tokens} tokens, "
                    f"text={_short(r.text)}>")
        return (f"<lily.GenerationStream running: {len(self._tokens)} tokens so far, "
                f"text={_short(''.join(self._texts))}>")
