"""One generation flow: a validated request, run on a sequence.

Every entry point goes through here: ``Model.generate``, ``Chat.send`` / ``respond`` and the
server's scheduler (lily.scheduler). Each builds a :class:`GenerationRequest` from its own
options once (the Python API with :meth:`GenerationRequest.build`; the server from its JSON
body, whose checks answer HTTP 400s, then as a ``Job``, a request with the server's fields),
and runs it with :class:`Generation`:

- the model's generation slot is taken (``Model._generation``; generations beyond
  ``max_batch`` wait) before the sequence is obtained (``sequence()``: a fresh session, a copy
  of a prompt cache, the conversation's session rewound, the server's prefix-cache match);
- the request's choices run through ``lily.generation.choice_loops`` on that sequence, on the
  device decode loop where the backend has one and the request allows it
  (``device_loop_allowed``; the generations running at once share its steps), else the host
  loop;
- each choice is a :class:`lily.generation.GenerationStream`.

The server's own needs are hooks into this flow, not a copy of it: ``step`` wraps every engine
call (its cancel check), ``on_prefilled`` takes a snapshot for its prefix cache after each
prompt, ``snapshot_prompt`` keeps one before each prompt's last token and ``snapshot_decoded``
one after 16, 32, 64, ... generated tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lily._core import RequestError
from lily.generation import (
    GenerationStream,
    check_stop,
    check_type,
    choice_loops,
    device_loop_allowed,
    sampling_params,
)
from lily.structured import TokenConstraint

if TYPE_CHECKING:
    from lily.batching import DeviceRow
    from lily.generation import GenerationResult
    from lily.model import Model, Session


@dataclass(eq=False)
class GenerationRequest:
    """A generation request, checked: prompt token ids, native sampling parameters and the
    rules every entry point shares. ``max_tokens`` already fits the context; ``stop_token_ids``
    end generation as the model's EOS ids do; ``chat``: the prompt is a chat turn, so results
    split their text into content, reasoning and calls to ``tools`` (``reasoning_started``: the
    prompt opened a ``<think>`` block)."""

    ids: np.ndarray
    params: Any  # lily._core.SamplingParams
    max_tokens: int
    stop: str | Sequence[str] | None
    want_logprobs: bool
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, bias) pairs
    stop_token_ids: Sequence[int] = ()
    constraint: TokenConstraint | None = None  # structured output (lily.structured)
    n: int = 1  # choices, generated one after another from one prefill
    chat: bool = False
    tools: Sequence[dict] | None = None
    reasoning_started: bool = False

    @classmethod
    def build(cls, model: Model, ids: np.ndarray, *, max_tokens: int | None, stop: Any, logprobs: bool | int | None,
              sampling: Mapping[str, Any], rules: Mapping[str, Any], context: int, n: int | None = None,
              thinking: bool = False, chat: bool = False, tools: Sequence[dict] | None = None,
              where: str = "generate", what: str = "the prompt") -> GenerationRequest:
        """The request for prompt ``ids`` from the Python API's options (``Model.generate``'s
        keyword arguments; ``sampling``: temperature ... seed; ``rules``: logit_bias,
        stop_token_ids, json_schema, regex, grammar), checked, each error a RequestError naming
        the argument. ``context``: the positions the sequence holds; ``thinking``: the prompt
        opens a ``<think>`` block (free of the structured-output constraint)."""
        if n is not None:
            check_type(where, "n", n, (int, np.integer), "an integer")
            if n < 1:
                raise RequestError(f"[{where}] n must be at least 1, got {n}")
        max_tokens = model._max_tokens(max_tokens)
        check_stop(stop)
        if ids.size >= context:
            raise RequestError(f"[{where}] {what} has {ids.size} tokens; the context holds {context}")
        params = sampling_params(model.generation_defaults.sampling_kwargs(), dict(sampling), logprobs)
        bias, stop_ids, constraint = model._token_rules(dict(rules), thinking=thinking, where=where)
        return cls(ids=np.asarray(ids, dtype=np.int32), params=params, max_tokens=min(max_tokens, context - int(ids.size)),
                   stop=stop, want_logprobs=bool(logprobs), logit_bias=bias, stop_token_ids=stop_ids,
                   constraint=constraint, n=int(n or 1), chat=chat, tools=tools,
                   reasoning_started=chat and thinking)


class Generation:
    """A request running on one sequence: the generation flow of every entry point.

    Takes a generation slot, then the sequence (``sequence()`` returns it and how many prompt
    tokens it already holds), and prepares the request's choices; :meth:`stream` gives the next
    choice's :class:`GenerationStream`. The slot is held until :meth:`close`, or by the stream
    that takes it over (``own_slot``, a single choice: the stream frees it when it ends).

    Every entry point gets the device decode loop where the backend has one and the request
    allows it (``device_loop_allowed``; logit_bias and structured output need the host too);
    the generations running at once share its steps (lily.batching).

    Hooks (the server's): ``step(fn, arg)`` runs each engine call ``fn(arg)`` (prefill chunks,
    decode steps, the device loop's start and steps); ``on_prefilled(seq)`` after each choice's
    prefill; ``on_close(seq)`` when the flow ends, before the slot is freed (the prefix cache
    takes the sequence back before another generation can ask for it); ``snapshot_prompt``: a
    snapshot before every prompt's last token (``choice_loops``); ``snapshot_decoded``: a
    snapshot once 16, 32, 64, ... generated tokens are in the state (when the next turn's
    template re-renders an answer to slightly different tokens, a cut-off last word say, the
    follow-up still reuses most of it). The device loop pauses for those (its state moves on
    the device between steps): the same snapshots as host decoding, at the cost of one loop
    restart per doubling.
    """

    def __init__(self, model: Model, request: GenerationRequest, sequence: Callable[[], tuple[Session, int]], *,
                 step: Callable[[Callable[[Any], Any], Any], Any] | None = None,
                 on_prefilled: Callable[[Session], None] | None = None,
                 on_prefill_progress: Callable[[int, int], None] | None = None,
                 on_close: Callable[[Session], None] | None = None,
                 snapshot_prompt: bool = False, snapshot_decoded: bool = False):
        self.model = model
        self._on_close = on_close
        self.request = request
        self._slots = model._generation
        self._slots.acquire()
        self._held = True
        try:
            self.seq, self.reused = sequence()
            self._choices = self._loops(step, on_prefilled, on_prefill_progress, snapshot_prompt, snapshot_decoded)
        except BaseException:
            self.close()
            raise

    def _loops(self, step, on_prefilled, on_prefill_progress, snapshot_prompt, snapshot_decoded):
        model, req, seq = self.model, self.request, self.seq
        run = step or (lambda fn, arg: fn(arg))
        prompt_end = int(req.ids.size)

        def snapshot_after(decoded: int) -> bool:  # generated tokens in the state
            return snapshot_decoded and decoded >= 16 and decoded & (decoded - 1) == 0

        def decode(tok: int) -> np.ndarray:
            out = run(seq.decode, tok)
            if snapshot_after(seq.position - prompt_end):
                seq.take_snapshot()
            return out

        def device_loop(tok: int, max_steps: int, sampler) -> _SteppedLoop | None:
            # The session records the tokens the loop feeds it (Session.device_loop), so rewind,
            # the prefix cache and the next turn see them as after host decoding.
            loop = run(lambda _arg: seq.device_loop(tok, max_steps, sampler), None)
            if loop is None:
                return None
            return _SteppedLoop(loop, run, seq, seq.position - prompt_end, snapshot_after)

        # GPU backends choose each token on the device and feed it to the next step there, unless
        # the request needs the logits on the host (penalties, logprobs, logit_bias, structured
        # output): the generations running at once share the device loop's steps (lily.batching).
        on_device = device_loop_allowed(req.params, req.want_logprobs)
        tokenizer = model.tokenizer
        return choice_loops(
            seq, req.ids, self.reused, req.n, prefill=lambda chunk: run(seq.prefill, chunk), decode=decode,
            params=req.params, constraint=req.constraint, snapshot_prompt=snapshot_prompt,
            detokenizer=lambda: tokenizer.detokenizer(skip_special_tokens=True) if tokenizer else None,
            on_prefill_progress=on_prefill_progress, chunk=model._engine.prefill_chunk, max_tokens=req.max_tokens,
            eos_ids=model.eos_token_ids + tuple(req.stop_token_ids), stop=req.stop, want_logprobs=req.want_logprobs,
            on_prefilled=None if on_prefilled is None else lambda: on_prefilled(seq), logit_bias=req.logit_bias,
            device_loop=device_loop if on_device else None)

    def stream(self, *, own_slot: bool = False,
               on_finish: Callable[[GenerationResult], None] | None = None) -> GenerationStream:
        """The next choice's stream; ``own_slot``: it takes over the slot (the last choice)."""
        req = self.request
        slot = None
        try:
            stats, chunks = next(self._choices)
            if own_slot and self._held:
                slot, self._held = self._slots, False
            return GenerationStream(chunks, stats, slot, want_logprobs=req.want_logprobs,
                                    token_text=self.model._token_text, chat=req.chat, tools=req.tools,
                                    reasoning_started=req.reasoning_started, on_finish=on_finish)
        except BaseException:
            # Not started (Ctrl-C, a failing detokenizer): nothing else would free the slot of a
            # caller that hands it to the stream (Model.generate, Chat).
            if slot is not None:
                self._held = True  # handed over, but no stream took it
            self.close()
            raise

    def streams(self) -> Iterator[GenerationStream]:
        """Each choice's stream in turn (the slot stays with this Generation)."""
        for _ in range(self.request.n):
            yield self.stream()

    def close(self) -> None:
        """Ends the choices not run and frees the slot (unless a stream took it over)."""
        choices = getattr(self, "_choices", None)
        try:
            if choices is not None:
                choices.close()
            if self._on_close is not None and hasattr(self, "seq"):
                on_close, self._on_close = self._on_close, None
                on_close(self.seq)
        finally:
            if self._held:
                self._held = False
                self._slots.release()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SteppedLoop:
    """A :class:`lily.batching.DeviceRow` whose steps go through the flow's ``step`` hook, and
    which pauses for the flow's snapshots: ``snapshot_after(decoded)`` says whether the state
    is wanted once ``decoded`` generated tokens are in it (``decoded``: that count when the row
    starts; each step feeds one more)."""

    def __init__(self, loop: DeviceRow, run: Callable[[Callable[[Any], Any], Any], Any], seq: Session,
                 decoded: int, snapshot_after: Callable[[int], bool]):
        self._loop, self._run, self._seq = loop, run, seq
        self._decoded, self._snapshot_after = decoded, snapshot_after

    def next(self) -> int:
        tok = self._run(lambda _arg: self._loop.next(), None)
        self._decoded += 1  # the step fed the pending token
        # Paused, the state holds every token returned before ``tok``: ``decoded`` of them.
        if self._snapshot_after(self._decoded) and self._loop.pause():
            self._seq.take_snapshot()
        return tok

    def close(self) -> None:
        self._loop.close()
