"""Conversations that keep their state between turns.

Each turn renders the whole conversation with the checkpoint's chat template, tokenizes it,
and feeds the model only what its state has not seen: the longest common prefix of the new
token sequence and the tokens already processed is reused. Attention KV can be cut back to
any position, but Gated DeltaNet and conv state cannot be rewound, so the conversation keeps
snapshots of the recurrent state at turn boundaries (after each prompt's prefill). When the
template re-renders history differently from what was generated (Qwen3.5 drops earlier
turns' reasoning, for example), the state is restored from the latest snapshot before the
first differing token and only the rest is prefilled.

The prefix matching and snapshots live in :class:`lily.Session` (``rewind``, ``take_snapshot``),
shared with the server's cross-request prompt cache.

Memory: a snapshot holds every DeltaNet layer's state and conv window — for Qwen3.6-35B-A3B
30 x 32 x 128 x 128 x 4 B + conv = about 64 MiB — and no KV (cut back in place). At most
``max_snapshots`` are kept (oldest dropped first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from lily._core import RequestError
from lily.generation import GenerationResult, GenerationStream
from lily.model import Session
from lily.request import Generation, GenerationRequest
from lily.tool_calls import ParsedOutput, opens_reasoning

if TYPE_CHECKING:
    from lily.model import Model

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")
# Per-request token rules, as Model.generate takes them (Model._token_rules checks them).
_RULE_KEYS = ("logit_bias", "stop_token_ids", "json_schema", "regex", "grammar")


def _check_options(options: Mapping[str, Any]) -> None:
    """Refuses, by name, chat options that are not sampling, token-rule or length options."""
    unknown = set(options) - set(_SAMPLING_KEYS) - set(_RULE_KEYS) - {"max_tokens", "stop", "logprobs"}
    if unknown:
        raise RequestError(f"[chat] unknown sampling argument(s): {', '.join(sorted(unknown))}")


class Chat:
    """A multi-turn conversation on one model.

    >>> chat = model.chat(system="You are terse.")
    >>> chat.send("Hi!").text
    >>> for chunk in chat.send("And then?", stream=True): print(chunk.text, end="")
    >>> chat.undo()            # forget the last exchange (no re-prefill)
    """

    def __init__(self, model: Model, system: str | None = None, *, tools: Sequence[dict] | None = None,
                 enable_thinking: bool | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                 max_snapshots: int = 16, prompt_cache: Session | None = None, **sampling: Any):
        """``prompt_cache``: a session holding the start of the conversation as the template
        renders it (``lily cache --chat``: the system prompt); each conversation, after
        :meth:`reset` too, starts from a copy of it, and a turn whose rendered tokens do not
        start with its tokens prefills from scratch (the prefix matching below)."""
        _check_options(sampling)
        if max_snapshots < 1:
            raise RequestError("[chat] max_snapshots must be at least 1")
        if prompt_cache is not None and getattr(prompt_cache, "_model", None) is not model:
            raise RequestError("[chat] prompt_cache must be a lily.Session of this model")
        self.model = model
        self.tools = list(tools) if tools else None
        self.enable_thinking = enable_thinking
        # every key reaches the template on each turn (e.g. Qwen3.6's preserve_thinking)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_snapshots = max_snapshots
        self.sampling = dict(sampling)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self._prompt_cache = prompt_cache
        self._seq = self._new_sequence()

    def _new_sequence(self) -> Session:
        if self._prompt_cache is None:
            return self.model.session(max_snapshots=self.max_snapshots)
        # A copy of the cached start, with a snapshot at its end: a first turn that diverges
        # after it still reuses it.
        seq = self._prompt_cache.fork()
        seq.max_snapshots = self.max_snapshots
        if seq.position:
            seq.take_snapshot()
        return seq

    # -- conversation editing --------------------------------------------------------------

    def add_message(self, role: str, content: str | None, **extra: Any) -> None:
        """Appends a message (e.g. a ``tool`` result with ``tool_call_id``) without generating."""
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"[chat] unknown role {role!r}")
        self.messages.append({"role": role, "content": content, **extra})

    def undo(self) -> None:
        """Forgets the last user turn and everything after it. The state is rolled back
        lazily: the next turn restores the snapshot before the forgotten tokens."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i]["role"] == "user":
                del self.messages[i:]
                return
        raise RequestError("[chat] nothing to undo")

    def reset(self, system: str | None = None) -> None:
        """Starts over (keeping the model and sampling settings)."""
        self.messages = [{"role": "system", "content": system}] if system else []
        self._seq = self._new_sequence()

    @property
    def position(self) -> int:
        """Tokens held in the conversation's state."""
        return self._seq.position

    @property
    def snapshot_bytes(self) -> int:
        return self._seq.snapshot_bytes

    # -- turns -----------------------------------------------------------------------------

    @overload
    def send(self, content: str, *, stream: Literal[False] = ..., **sampling: Any) -> GenerationResult: ...

    @overload
    def send(self, content: str, *, stream: Literal[True], **sampling: Any) -> GenerationStream: ...

    @overload
    def send(self, content: str, *, stream: bool, **sampling: Any) -> GenerationResult | GenerationStream: ...

    def send(self, content: str, *, stream: bool = False, **sampling: Any) -> GenerationResult | GenerationStream:
        """Adds a user message and generates the assistant's answer.

        ``sampling``: this turn's overrides of the chat's settings, the keyword arguments of
        :meth:`Model.generate` (``max_tokens``, ``temperature``, ..., ``stop``, ``logprobs``,
        ``logit_bias``, ``stop_token_ids``, and one of ``json_schema`` / ``regex`` /
        ``grammar`` for a structured answer). A turn that does not finish (a stream closed, garbage-collected or ended by the next
        generation before its end, Ctrl-C, an error) is rolled back: the conversation is left as
        it was before ``send``, and the partial answer is only in the stream's ``result``
        (finish_reason "cancelled")."""
        if not isinstance(content, str):
            raise RequestError(f"[chat] the message must be a string, got {type(content).__name__}")
        turn_start = len(self.messages)
        self.add_message("user", content)
        try:
            return self._turn(turn_start, stream=stream, **sampling)
        except BaseException:
            del self.messages[turn_start:]
            raise

    @overload
    def respond(self, *, stream: Literal[False] = ..., **sampling: Any) -> GenerationResult: ...

    @overload
    def respond(self, *, stream: Literal[True], **sampling: Any) -> GenerationStream: ...

    @overload
    def respond(self, *, stream: bool, **sampling: Any) -> GenerationResult | GenerationStream: ...

    def respond(self, *, stream: bool = False, **sampling: Any) -> GenerationResult | GenerationStream:
        """Generates the assistant's next message for the conversation as it stands (after a
        tool result, say). An unfinished turn adds nothing, as with :meth:`send`."""
        return self._turn(len(self.messages), stream=stream, **sampling)

    def _turn(self, turn_start: int, *, stream: bool, **sampling: Any) -> GenerationResult | GenerationStream:
        """One assistant turn; ``messages[turn_start:]`` are dropped if it does not finish."""
        model = self.model
        opts = {**self.sampling, **sampling}
        _check_options(opts)
        text = model.render_chat(self.messages, tools=self.tools, enable_thinking=self.enable_thinking,
                                 chat_template_kwargs=self.chat_template_kwargs)
        ids = np.asarray(model._need_tokenizer("chat").encode(text), dtype=np.int32)
        seq = self._seq
        request = GenerationRequest.build(
            model, ids, max_tokens=opts.get("max_tokens"), stop=opts.get("stop"), logprobs=opts.get("logprobs"),
            sampling={k: opts[k] for k in _SAMPLING_KEYS if k in opts}, rules={k: opts[k] for k in _RULE_KEYS if k in opts},
            context=seq.max_context, thinking=opens_reasoning(text), chat=True, tools=self.tools, where="chat",
            what="the conversation")

        def finish(result: GenerationResult) -> None:
            if result.finish_reason == "cancelled":
                del self.messages[turn_start:]  # the state is rewound lazily by the next turn
            else:
                self.messages.append(ParsedOutput(result.content or "", result.reasoning,
                                                  result.tool_calls).to_message())

        # One choice on the conversation's session, rewound to what it can keep of this prompt
        # (after the slot is taken), with a snapshot after the prompt: the next turn starts there.
        run = Generation(model, request, lambda: (seq, seq.rewind(ids)), on_prefilled=Session.take_snapshot)
        stream_obj = run.stream(own_slot=True, on_finish=finish)
        return stream_obj if stream else stream_obj.drain()

    def __repr__(self) -> str:
        roles = [m["role"] for m in self.messages]
        turns = sum(r == "user" for r in roles)
        return (f"<lily.Chat {len(self.messages)} messages ({turns} user turns), {self.position} tokens in "
                f"state, {len(self._seq.snapshots)} snapshots ({self.snapshot_bytes / 2**20:.1f} MiB), "
                f"thinking={self.enable_thinking}>")
