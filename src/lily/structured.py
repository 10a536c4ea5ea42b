"""Structured output: a per-step token mask from a JSON Schema, a regex or a grammar.

The mask comes from llguidance (the ``structured`` extra; chosen over xgrammar by
benchmarks/structured_output.py: both compute a step's mask in microseconds, far below a decode
step, and llguidance has no dependencies where xgrammar needs torch, triton and transformers).
At each step the token loop asks the :class:`TokenConstraint` for the mask, hands it to the
sampler (``Sampler.set_allowed_tokens``: disallowed tokens are never drawn, never the argmax,
and logprobs are those of the masked distribution), and feeds the sampled token back. Once the
document is complete the mask allows only the end-of-sequence tokens, so generation stops there.

A thinking prompt (one that opens ``<think>``) is left free until the model closes the block:
the constraint applies to the answer, not to the reasoning.

The library's tokenizer index is built once per tokenizer (about a second and a half for a 248K
vocabulary, lazily, on the first constrained request) and kept on the
:class:`lily.tokenizer.Tokenizer`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from lily._core import RequestError

_INDEX_LOCK = threading.Lock()

# JSON is written in one layout, json.dumps' default (`{"a": 1, "b": [2, 3]}`): with free
# whitespace (llguidance's default) a small or unsure model can pad with spaces and newlines
# until max_tokens, and a fixed layout also makes outputs reproducible.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise RequestError('[generate] structured output needs llguidance: pip install ".[structured]" in a lily '
                           "checkout (or pip install llguidance)") from None
    return llguidance


class _Tokens:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the special ids, and an
    encoder (lily's tokenizer, str in, ids out)."""

    bos_token_id = None

    def __init__(self, tokenizer, tokens: list[bytes], eos: int):
        self.tokens = tokens
        self.eos_token_id = eos
        # Every added token, special or not (<tool_call>, <think>), is a token of its own that no
        # text matches, as in llguidance's import of tokenizer.json: grammars name them <[id]>.
        self.special_token_ids = list(tokenizer.added_tokens.values())
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def _index(tokenizer, eos_ids: Sequence[int]):
    """llguidance's tokenizer index for ``tokenizer`` (cached on it, per set of EOS ids: callers
    pass the model's, so there is one per model). A byte-level BPE tokenizer's is built from
    its token bytes (Tokenizer.token_bytes): 1.3-1.7 s for Qwen's 248K tokens where indexing
    tokenizer.json takes 2.5-3.3 s (llguidance parses and builds the whole tokenizer a second
    time), with the same masks (tests/test_tokenizer.py; benchmarks/structured_output.py);
    other tokenizers index tokenizer.json."""
    llg = _llguidance()
    key = tuple(sorted(eos_ids))
    with _INDEX_LOCK:
        cache = tokenizer.__dict__.setdefault("_llguidance_index", {})
        if key not in cache:
            tokens = tokenizer.token_bytes()
            if tokens is not None and key:
                source = llg.TokenizerWrapper(_Tokens(tokenizer, tokens, key[0]))
            else:
                source = tokenizer.to_json()
            cache[key] = llg.LLTokenizer(source, n_vocab=tokenizer.vocab_size, eos_token=list(key))
        return cache[key]


class Grammar(NamedTuple):
    """An llguidance grammar and the argument it came from (for error messages)."""

    source: str  # "json_schema", "regex" or "grammar"
    text: str


def grammar_for(*, json_schema: Any = None, regex: str | None = None, grammar: str | None = None,
                where: str = "generate") -> Grammar | None:
    """The llguidance grammar for at most one of ``json_schema`` (a dict, or True for any JSON
    object), ``regex`` or ``grammar`` (Lark or GBNF text); None when none is given."""
    given = [n for n, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise RequestError(f"[{where}] give at most one of json_schema, regex and grammar, got {', '.join(given)}")
    if not given:
        return None
    llg = _llguidance()
    if json_schema is not None:
        if json_schema is True:
            json_schema = {"type": "object"}
        if not isinstance(json_schema, dict):
            raise RequestError(f"[{where}] json_schema must be a dict (a JSON Schema), got {type(json_schema).__name__}")
        try:
            text = json.dumps(json_schema)
        except (TypeError, ValueError) as e:
            raise RequestError(f"[{where}] json_schema is not JSON: {e}") from None
        return Grammar("json_schema", llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_LAYOUT))
    if regex is not None:
        if not isinstance(regex, str):
            raise RequestError(f"[{where}] regex must be a string, got {type(regex).__name__}")
        return Grammar("regex", llg.LLMatcher.grammar_from_regex(regex))
    if not isinstance(grammar, str):
        raise RequestError(f"[{where}] grammar must be a string (Lark or GBNF), got {type(grammar).__name__}")
    try:
        return Grammar("grammar", llg.grammar_from("grammar", grammar))
    except ValueError as e:
        raise RequestError(f"[{where}] grammar: {e}") from None


# What a turn may hold besides tool calls, by OpenAI's tool_choice: a named function, one call;
# "required", one call or more; "auto", free text (which never holds a call's opening, so that a
# call is always the constrained one) and optionally calls after it.
_TURNS = {
    "function": "start: call",
    "required": 'start: call ("\\n" call)*',
    "auto": 'start: TEXT? (call ("\\n" call)*)?\nTEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/',
}


def tool_call_grammar(tokenizer, tools: Sequence[dict], *, strict: Sequence[bool], tool_choice: str) -> Grammar:
    """The assistant turn ``tool_choice`` allows ("function": one call; "required": one call or
    more; "auto": text, then optionally calls), each call in the Qwen3.5 / Qwen3.6 format
    (lily.tool_calls) to one of ``tools`` (OpenAI tool dicts, already checked), its arguments
    following its tool's ``parameters`` schema where ``strict`` says so (free parameters otherwise)::

        <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>

    Parameters come in the schema's order, required ones always, optional ones maybe. A value is
    written as the template writes it: a string raw (no ``<`` in it, so that it cannot close the
    block early; an ``enum`` as one of its values, ``minLength`` / ``maxLength`` kept), anything
    else as JSON following the parameter's schema (llguidance's ``%json``)."""
    rules: list[str] = []

    def literal(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    def token(text: str) -> str:  # an added token (<tool_call>) is matched as that token
        tid = tokenizer.token_to_id(text)
        return f"<[{tid}]>" if tid is not None else literal(text)

    close = literal("\n</parameter>\n")
    for i, (tool, is_strict) in enumerate(zip(tools, strict, strict=True)):
        fn = tool["function"]
        name = fn["name"]
        if any(c in name for c in "<>\n"):
            raise RequestError(f"[tools] function name {name!r} cannot be written in a tool call (it has <, > or a "
                               "newline)")
        schema = fn.get("parameters") or {}
        if not is_strict:
            free = '("<parameter=" /[^<>\\n]+/ ">\\n" /[^<]*\\n<\\/parameter>\\n/)*'
            rules.append(f"fn{i}: {literal(f'<function={name}>' + chr(10))} {free}")
            continue
        params = []
        required = set(schema.get("required") or ())
        for j, (arg, sub) in enumerate((schema.get("properties") or {}).items()):
            if any(c in arg for c in "<>\n"):
                raise RequestError(f"[tools] parameter name {arg!r} of {name} cannot be written in a tool call")
            rule = f"fn{i}_p{j}"
            head = literal(f"<parameter={arg}>\n")
            if isinstance(sub, dict) and sub.get("type") == "string" and isinstance(sub.get("enum"), list):
                body = " | ".join(literal(v) for v in sub["enum"] if isinstance(v, str))
                rules.append(f"{rule}: {head} ({body}) {close}")
            elif isinstance(sub, dict) and sub.get("type") == "string":
                lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
                count = f"{{{lo},{int(hi)}}}" if hi is not None else f"{{{lo},}}"
                rules.append(f"{rule}: {head} /[^<]{count}\\n<\\/parameter>\\n/")
            else:
                layout = dict(sub) if isinstance(sub, dict) else {}
                layout["x-guidance"] = _JSON_LAYOUT  # the same JSON layout as json_schema
                rules.append(f"{rule}: {head} %json {json.dumps(layout)} {close}")
            params.append(rule if arg in required else f"{rule}?")
        rules.append(f"fn{i}: {literal(f'<function={name}>' + chr(10))} {' '.join(params)}")
    alternatives = " | ".join(f"fn{i}" for i in range(len(tools)))
    call = f'call: {token("<tool_call>")} "\\n" ({alternatives}) "</function>\\n" {token("</tool_call>")}'
    lark = "\n".join([_TURNS[tool_choice], call, *rules])
    return Grammar("tool schema", _llguidance().LLMatcher.grammar_from_lark(lark))


class TokenConstraint:
    """One request's grammar state: the mask for the next token, advanced token by token.

    Built by :func:`compile_constraint` (which checks the grammar first). ``wait_for`` is a
    token id (``</think>``) before which tokens are unconstrained, or None."""

    def __init__(self, matcher, vocab_size: int, wait_for: int | None):
        self._matcher = matcher
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)  # [ceil(V / 32)] mask words
        self._waiting = wait_for is not None
        self._wait_for = wait_for

    def mask(self) -> np.ndarray | None:
        """uint32 words, bit i of word i // 32 set where token i keeps the output valid; None
        while unconstrained (before ``wait_for``)."""
        if self._waiting:
            return None
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise RequestError(f"[structured] {self._matcher.get_error()}")
        return self._bits

    def reset(self) -> None:
        """Back to the start of the grammar (the next of n choices)."""
        self._matcher.reset()
        self._waiting = self._wait_for is not None

    def consume(self, token: int) -> None:
        if self._waiting:
            self._waiting = token != self._wait_for
            return
        if not self._matcher.consume_token(token):
            raise RequestError(f"[structured] token {token} does not fit the grammar: {self._matcher.get_error()}")


def compile_constraint(tokenizer, grammar: Grammar, eos_ids: Sequence[int], *, thinking: bool,
                       where: str = "generate") -> TokenConstraint:
    """A TokenConstraint for ``grammar`` (from :func:`grammar_for`); a grammar the library
    rejects (an unsupported schema keyword, a bad regex) is a RequestError naming the problem."""
    if tokenizer is None:
        raise RequestError(f"[{where}] structured output needs a tokenizer")
    llg = _llguidance()
    index = _index(tokenizer, eos_ids)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar.text, index)
    if is_error:
        raise RequestError(f"[{where}] llguidance rejects this {grammar.source}: {messages[0]}")
    matcher = llg.LLMatcher(index, grammar.text, log_level=0)
    if matcher.is_error():
        raise RequestError(f"[{where}] llguidance rejects this {grammar.source}: {matcher.get_error()}")
    wait_for = tokenizer.token_to_id("</think>") if thinking else None
    return TokenConstraint(matcher, tokenizer.vocab_size, wait_for)
