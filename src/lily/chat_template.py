"""Render a checkpoint's chat template (Jinja2), safely.

Chat templates come from model repositories: untrusted code. `render()` runs them in Jinja2's
`ImmutableSandboxedEnvironment` with what Hugging Face templates expect (the same environment
transformers' `apply_chat_template` builds, so output is byte-identical):

- `trim_blocks` / `lstrip_blocks`, the `loopcontrols` extension (`{% break %}`, `{% continue %}`),
  and `{% generation %}...{% endgeneration %}` (rendered as its body);
- `raise_exception(msg)`, `strftime_now(fmt)`, `dict(...)`, a `namespace` that refuses
  `_`-prefixed names;
- `tojson` with transformers' semantics: `json.dumps(x, ensure_ascii=False, indent=None,
  separators=None, sort_keys=False)` (no HTML escaping, unlike Jinja's own filter);
- variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's special
  tokens (`eos_token`, ...) and any extra keyword (`enable_thinking`, ...).

The sandbox refuses attribute walks (`''.__class__.__mro__`, `obj._private`) and mutation of
lists/dicts. On top of it, a per-render budget bounds what a hostile template can cost: loop
iterations plus calls and lookups (`max_steps`), macro/call nesting (`max_depth`), wall time
(`timeout_s`, checked at every step), output size (`max_output_chars`), and the size of every
value the template builds (`max_value_len`: characters of a string, items of a list or dict,
digits of a number). Both sizes grow by four times the characters of the inputs (messages,
tools, documents), so a template can always copy what it was given.

How "every value" is covered (memory, not just time: a value can double per step):
- operators: `+`, `*`, `%`, `**` (intercepted binops) and `~` (rewritten at parse time into a
  checked join);
- calls, filters and methods: the result of each is checked, and those that can multiply sizes
  in one step (`replace`, `join`, `format`, `indent`, `wordwrap`, `sum`, `expandtabs`,
  `translate`, width arguments such as `center(n)`, `lipsum(n)`, and turning a structure into
  text: `string`, `tojson`, `pprint`, printing it) are checked before they run, from an estimate
  of the text they would make;
- blocks that collect output (`{% set x %}...{% endset %}`, macros, `caller()`, filter blocks)
  through the environment's `concat`, which adds up the pieces' lengths before joining them.

Every failure is a `ChatTemplateError` (a ValueError) that says what went wrong.

Inputs are normalized as transformers does: message keys whose value is None are dropped, and a
message's `reasoning` / `thinking` is also offered as `reasoning_content`. One addition for
OpenAI-format clients: a tool call whose `function.arguments` is a JSON string is parsed into a
mapping, since templates iterate the arguments.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils
import jinja2.visitor

__all__ = ["ChatTemplateError", "render", "DEFAULT_LIMITS"]


class ChatTemplateError(ValueError):
    """A chat template failed: it raised, broke a sandbox rule, ran over budget, or is invalid."""


DEFAULT_LIMITS = {
    "max_steps": 2_000_000,  # loop iterations + calls + attribute/item lookups
    "max_depth": 64,  # nested calls (macros calling macros)
    "max_output_chars": 4_000_000,  # (+ 4x the input characters)
    "max_value_len": 1_000_000,  # any str/list/dict the template builds (+ 4x the input characters)
    "timeout_s": 10.0,
}


class _Budget:
    def __init__(self, limits: dict, input_chars: int = 0):
        self.limits = limits
        self.steps = 0
        self.depth = 0
        self.deadline = time.monotonic() + limits["timeout_s"]
        self.value_limit = int(limits["max_value_len"]) + 4 * input_chars
        self.output_limit = int(limits["max_output_chars"]) + 4 * input_chars

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits["max_steps"]:
            raise ChatTemplateError(
                f"chat template exceeded its step budget ({self.limits['max_steps']} loop iterations/calls)"
            )
        # Every step: one monotonic clock read (~50 ns) against steps of microseconds, so a
        # template whose steps are slow (a replace over a long string) cannot run far past it.
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template ran longer than {self.limits['timeout_s']} s")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("lily_template_budget", default=None)


def _step(n: int = 1) -> None:
    b = _budget.get()
    if b is not None:
        b.step(n)


def _counted_range(*args):
    r = jinja2.sandbox.safe_range(*args)  # itself capped at 100,000 items
    for i in r:
        _step()
        yield i


def _value_limit() -> int:
    b = _budget.get()
    return b.value_limit if b else DEFAULT_LIMITS["max_value_len"]


def _too_big(what: str, size: int, limit: int):
    raise ChatTemplateError(f"chat template built a value of {size}+ characters/items ({what}), more than "
                            f"its limit of {limit}")


def _text_len(value: Any, limit: int) -> int:
    """About how many characters str(value) has (containers: their items' text plus
    punctuation), counting only until it passes ``limit``, so a list of a million references to
    one long string is known to be too big without building its text."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (bytes, bytearray)):
            total += 4 * len(v) + 3
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() * 30103 // 100000 + 2
        elif isinstance(v, float):
            total += 24
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, jinja2.utils.Namespace):
            total += 12
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        elif isinstance(v, jinja2.runtime.Undefined):
            pass
        else:
            total += 64
    return total


def _check_text(value: Any, what: str) -> None:
    """Before str(value) (printing, ~, string, tojson, %): refuse text past the value limit."""
    limit = _value_limit()
    if isinstance(value, str):
        n = len(value)
    else:
        n = _text_len(value, limit)
    if n > limit:
        _too_big(what, n, limit)


def _check_built(value: Any, what: str) -> Any:
    """After a call, filter or method: its result must be within the value limit."""
    if isinstance(value, (str, bytes, bytearray, list, tuple, dict, set, frozenset)):
        limit = _value_limit()
        if len(value) > limit:
            _too_big(what, len(value), limit)
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * _value_limit():
        _too_big(what, value.bit_length(), _value_limit())
    return value


# Filters whose result is the text of their subject (str() or markupsafe's soft_str), or as long:
# a list of 100,000 references to one 100,000-character string is 10 GB of text, however small
# the list (the fuzz target found `| e` over one).
_TEXT_FILTERS = frozenset({
    "string", "tojson", "pprint", "list", "format", "e", "escape", "forceescape", "safe", "capitalize",
    "lower", "upper", "title", "trim", "striptags", "urlize", "urlencode", "wordcount", "truncate",
    "center", "replace", "indent", "wordwrap",
})


def _check_growth(what: str, fn, args: tuple, kwargs: dict) -> None:
    """Pre-checks for the calls that can multiply a size in one step (see the module docstring):
    ``fn`` is the str method or the filter's name, ``args`` its arguments after the subject."""
    limit = _value_limit()
    subject, rest = (args[0], args[1:]) if args else (None, ())

    def arg(i: int, name: str, default=None):
        return rest[i] if len(rest) > i else kwargs.get(name, default)

    size = 0
    if fn == "replace" and isinstance(subject, str):
        old, new, count = arg(0, "old"), arg(1, "new"), arg(2, "count", -1)
        if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
            n = len(subject) + 1 if not old else subject.count(old)
            if isinstance(count, int) and count >= 0:
                n = min(n, count)
            size = len(subject) + n * (len(new) - len(old))
    elif fn == "join":
        # str.join(iterable): subject is the separator; the join filter: subject is the iterable.
        sep, items = (subject, arg(0, "iterable")) if isinstance(subject, str) else (arg(0, "d", ""), subject)
        # The filter takes str() of a separator that is not text, before it joins anything: a
        # list of 100,000 references to a 100,000-character string is 10 GB (the fuzz target).
        sep_len = len(sep) if isinstance(sep, str) else _text_len(sep, limit)
        size = sep_len
        if isinstance(items, (list, tuple, dict, set, frozenset)):
            size += _text_len(list(items), limit) + len(items) * sep_len
    elif fn in ("format", "format_map") and isinstance(subject, str):
        fields = subject.count("{") + subject.count("%")
        size = len(subject) + fields * max([_text_len(a, limit) for a in (*rest, *kwargs.values())] or [0])
    elif fn == "indent" and isinstance(subject, str):
        width = arg(0, "width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        size = len(subject) + (subject.count("\n") + 1) * pad
    elif fn == "wordwrap" and isinstance(subject, str):
        width, wrap = arg(0, "width", 79), arg(2, "wrapstring", "\n")
        if isinstance(width, int) and isinstance(wrap, str):
            size = len(subject) + (len(subject) // max(width, 1) + 1) * len(wrap)
    elif fn == "expandtabs" and isinstance(subject, str):
        tab = arg(0, "tabsize", 8)
        size = len(subject) + subject.count("\t") * (tab if isinstance(tab, int) else 0)
    elif fn == "translate" and isinstance(subject, str):
        table = arg(0, "table")
        if isinstance(table, dict):
            longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
            size = len(subject) * longest
    elif fn == "sum":
        start = arg(1, "start", 0)
        if isinstance(start, (str, list, tuple)) and isinstance(subject, (list, tuple)):
            size = len(start) + sum(len(x) if isinstance(x, (str, list, tuple)) else 1 for x in subject)
    elif fn in _TEXT_FILTERS:
        size = _text_len(subject, limit)
    elif fn == "generate_lorem_ipsum":
        n, most = (args[0] if args else kwargs.get("n", 5)), kwargs.get("max", args[3] if len(args) > 3 else 100)
        if isinstance(n, int) and isinstance(most, int):
            size = max(n, 0) * max(most, 0) * 16
    if size > limit:
        _too_big(what, size, limit)


def _check_size_args(what: str, args, kwargs) -> None:
    """Integer arguments are widths and counts ('x'.ljust(n), center(n), tojson(indent=n),
    truncate(n)): one past the value-length budget would build a string that large."""
    limit = _value_limit()
    for a in (*args, *kwargs.values()):
        if type(a) is int and abs(a) > limit:
            raise ChatTemplateError(f"chat template passed {a} to {what}, more than the value limit {limit}")


# printf-style and str.format width / precision fields: '%0999999999d', '{:>999999999}'.
_FORMAT_WIDTHS = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d+))?|\{[^{}]*:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")


def _check_format_widths(fmt: str) -> None:
    limit = _value_limit()
    for m in _FORMAT_WIDTHS.finditer(fmt):
        for g in m.groups():
            if g and (len(g) > 9 or int(g) > limit):
                raise ChatTemplateError(f"chat template format width {g} is over the value limit {limit}")


@jinja2.pass_context  # also keeps Jinja's optimizer from folding the call away at compile time
def _loop_tick(_context, _value):
    """A filter applied at the top of every loop body (see _BoundedSandbox._parse): one step
    per iteration. A filter, not a global function: filters compile to a direct call, without
    the sandbox's per-call checks, so the tick stays cheap."""
    _step()


def _bounded_filter(name: str, fn):
    # jinja passes the context, eval context or environment first to filters marked so.
    skip = 1 if jinja2.utils._PassArg.from_obj(fn) is not None else 0

    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment markers
    def wrapper(*args, **kwargs):
        what = f"the {name!r} filter"
        _check_size_args(what, args[skip + 1:], kwargs)
        if name == "format":
            fmt = next((a for a in args if isinstance(a, str)), None)
            if fmt is not None:
                _check_format_widths(fmt)
        _check_growth(what, name, args[skip:], kwargs)
        return _check_built(fn(*args, **kwargs), what)

    return wrapper


@jinja2.pass_context
def _concat_filter(_context, parts):
    """`a ~ b ~ c`, rewritten at parse time into this filter over [a, b, c] (_BoundedSandbox._parse):
    the joined length is checked before the string is built."""
    limit, total = _value_limit(), 0
    texts = []
    for p in parts:
        if not isinstance(p, str):
            _check_text(p, "~")
            p = str(p)
        texts.append(p)
        total += len(p)
        if total > limit:
            _too_big("~", total, limit)
    return "".join(texts)


def _bounded_concat(pieces) -> str:
    """The environment's `concat`: joins the output of a block that collects it (set blocks,
    macros, caller(), filter blocks), after adding up the pieces' lengths."""
    pieces = list(pieces)
    limit, total = _value_limit(), 0
    for p in pieces:
        total += len(p)
        if total > limit:
            _too_big("a block's output", total, limit)
    return "".join(pieces)


def _finalize(value):
    """Every `{{ expression }}` passes here before it is turned into text."""
    _check_text(value, "printing a value")
    return value


class _ConcatToFilter(jinja2.visitor.NodeTransformer):
    """`a ~ b` -> `[a, b] | _lily_concat` (jinja compiles `~` to a plain join nothing intercepts)."""

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        out = jinja2.nodes.Filter(jinja2.nodes.List(node.nodes), "_lily_concat", [], [], None, None)
        return out.set_lineno(node.lineno)


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])
    concat = staticmethod(_bounded_concat)

    def _parse(self, source, name, filename):
        # Loops over strings, lists or dicts make no calls, so nothing else would count their
        # iterations (nested loops over two 100,000-char strings ran unbounded, past the time
        # budget, which is only checked when steps are taken). A call at the top of every loop
        # body costs one step per iteration and lets the time budget fire.
        tree = _ConcatToFilter().visit(super()._parse(source, name, filename))
        for loop in tree.find_all(jinja2.nodes.For):
            tick = jinja2.nodes.ExprStmt(
                jinja2.nodes.Filter(jinja2.nodes.Const(None), "_lily_loop_tick", [], [], None, None))
            tick.set_lineno(loop.lineno)
            loop.body.insert(0, tick)
        return tree

    def call_binop(self, context, operator, left, right):
        limit = _value_limit()
        if operator == "%":
            if isinstance(left, str):
                _check_format_widths(left)
                _check_growth("%", "format", (left, right), {})
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if right * max(abs(left).bit_length(), 1) > 4096:
                    raise ChatTemplateError("chat template built a number too large (** on big operands)")
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > limit:
                raise ChatTemplateError(f"chat template built a value longer than {limit} (*)")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
                raise ChatTemplateError("chat template built a number too large (* on big operands)")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > limit:
                    raise ChatTemplateError(f"chat template built a value longer than {limit} (+)")
        return _check_built(super().call_binop(context, operator, left, right), operator)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        b = _budget.get()
        if b is None:
            return super().call(__context, __obj, *args, **kwargs)
        b.step()
        what = getattr(__obj, "__name__", "a call")
        _check_size_args(what, args, kwargs)
        # str.format reaches here wrapped by the sandbox (jinja >= 3.1.5): look through it.
        method = getattr(__obj, "__wrapped__", __obj)
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                _check_format_widths(owner)
            _check_growth(f"str.{name}", name, (owner, *args), kwargs)
        elif name == "generate_lorem_ipsum":
            _check_growth("lipsum", name, args, kwargs)
        b.depth += 1
        try:
            if b.depth > b.limits["max_depth"]:
                raise ChatTemplateError(f"chat template nested calls deeper than {b.limits['max_depth']}")
            return _check_built(super().call(__context, __obj, *args, **kwargs), what)
        finally:
            b.depth -= 1

    def unsafe_undefined(self, obj, attribute):
        # Jinja would return a silent Undefined (rendering as ""); a template that reaches for
        # internals is hostile, so fail loudly instead.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def getattr(self, obj, attribute):
        _step()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _step()
        return super().getitem(obj, argument)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering it is just its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing `_`-prefixed names (no way to shadow internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _dict(*args, **kwargs):
    return dict(*args, **kwargs)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    for name, fn in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, fn)
    env.filters["_lily_loop_tick"] = _loop_tick
    env.filters["_lily_concat"] = _concat_filter
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=_Namespace,
        dict=_dict,
        range=_counted_range,
    )
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
    except RecursionError:
        # Jinja's parser and compiler recurse per nesting level: '((((...1...))))' 300 deep
        # overflowed the Python stack at compile time.
        raise ChatTemplateError("chat template is nested too deeply to compile") from None


def _plain(value: Any, path: str = "messages") -> Any:
    """A copy made of JSON types only, so the template sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k, path): _plain(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "model_dump"):  # pydantic objects, e.g. the OpenAI SDK's messages
        return _plain(value.model_dump(), path)
    raise TypeError(f"{path}: chat template inputs must be JSON-like, got {type(value).__name__}")


def _chars(value: Any) -> int:
    """Characters of the strings in a JSON-like input (what a template may copy)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def _normalize_messages(messages: Sequence[Any]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(_plain(list(messages))):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if "role" not in m:
            raise ValueError(f"messages[{i}] has no 'role'")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m["tool_calls"] = [_parse_call_arguments(c, i) for c in calls]
        out.append(m)
    return out


def _parse_call_arguments(call: Any, index: int) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"messages[{index}]: tool call arguments are not valid JSON ({e})") from None
        return {**call, "function": {**fn, "arguments": args}}
    return call


# Variables render() sets itself: a chat_template_kwargs key may not replace them.
_RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "limits", "template")


def template_kwargs(chat_template_kwargs: Mapping[str, Any] | None, enable_thinking: bool | None) -> dict[str, Any]:
    """The extra template variables of a request: every ``chat_template_kwargs`` key (Qwen3.6's
    ``preserve_thinking``, a custom flag, ...) plus ``enable_thinking``, which may come from
    either place (as transformers' apply_chat_template takes it: one more keyword); given in
    both with different values is an error. Raises ValueError naming the bad key."""
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(chat_template_kwargs).__name__}")
    out = dict(chat_template_kwargs)
    for key in out:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs key {key!r} is not a template variable name")
        if key in _RESERVED_VARIABLES:
            raise ValueError(f"chat_template_kwargs key {key!r} is set by the request itself, not by a template kwarg")
    thinking = out.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"chat_template_kwargs 'enable_thinking' must be a boolean, got {thinking!r}")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise ValueError(f"enable_thinking must be a boolean, got {enable_thinking!r}")
    if enable_thinking is not None:
        if thinking is not None and thinking != enable_thinking:
            raise ValueError(f"enable_thinking={enable_thinking} disagrees with "
                             f"chat_template_kwargs['enable_thinking']={thinking}")
        out["enable_thinking"] = bool(enable_thinking)
    elif "enable_thinking" in out and thinking is None:
        del out["enable_thinking"]  # None: the template's default, as for the argument
    return out


def render(
    template: str,
    messages: Sequence[Any],
    *,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = False,
    enable_thinking: bool | None = None,
    limits: Mapping[str, float] | None = None,
    **kwargs: Any,
) -> str:
    """Render `template` over `messages` (OpenAI-format dicts).

    enable_thinking=None leaves the variable undefined (the template's default); other keyword
    arguments (bos_token, eos_token, custom flags) are passed to the template as variables.
    """
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError("the chat template is empty")
    lim = {**DEFAULT_LIMITS, **(limits or {})}
    unknown = set(lim) - set(DEFAULT_LIMITS)
    if unknown:
        raise ValueError(f"unknown chat template limits: {sorted(unknown)}")
    compiled = _compile(template)
    if tools is not None:
        if isinstance(tools, Mapping) or not isinstance(tools, Sequence):
            raise TypeError("tools must be a list of JSON-schema dicts")
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping):
                raise TypeError(f"tools[{i}] must be a JSON-schema dict, got {type(t).__name__}")
    variables = {
        **_plain(kwargs, "kwargs"),
        "messages": _normalize_messages(messages),
        "tools": _plain(tools, "tools"),
        "documents": _plain(documents, "documents"),
        "add_generation_prompt": bool(add_generation_prompt),
    }
    if enable_thinking is not None:
        variables["enable_thinking"] = bool(enable_thinking)

    budget = _Budget(lim, input_chars=_chars(variables))
    token = _budget.set(budget)
    try:
        parts, size = [], 0
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > budget.output_limit:
                raise ChatTemplateError(f"chat template output exceeded {budget.output_limit} characters")
            parts.append(chunk)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        # raise_exception(...) from the template, or a runtime template error.
        raise ChatTemplateError(f"chat template error: {e.message or e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    # NameError: Jinja compiles a float literal past float's range (`8e94697`) into the name `inf`,
    # which fails when the template runs (found by tests/fuzz, the template target).
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
            NameError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    except MemoryError:
        raise ChatTemplateError("chat template ran out of memory") from None
    finally:
        _budget.reset(token)
