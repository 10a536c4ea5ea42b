"""Split a model's output into reasoning, content and tool calls (OpenAI-shaped).

Qwen3.5 / Qwen3.6 output, with thinking on, looks like

    (the prompt ended with "<think>\\n")  reasoning...\\n</think>\\n\\nanswer text
    <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

Qwen3 wrote the call as JSON instead: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
Both forms are accepted, block by block.

Reasoning: the text before the first `</think>` (a leading `<think>` dropped). With no
`</think>`, the output is all reasoning if it opens with `<think>` or if the prompt itself opened
the block (`reasoning_started=True`, i.e. the generation prompt ended in `<think>\\n`): a
generation cut off while thinking. Otherwise there is no reasoning.

Parameter values: the template writes strings raw and every other value as JSON, so a value is
read back with the tool's JSON schema when given (a `string` parameter stays text; others are
parsed as JSON, falling back to text); without a schema a value that parses as JSON is taken as
JSON, else as text. Arguments come out as a JSON string, as OpenAI's API returns them.

A block that cannot be parsed is left in the content (the user sees what the model wrote)
and reported in `ParsedOutput.errors`. An unclosed last block (generation stopped at
`</tool_call>` or ran out of tokens) is parsed as if closed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedOutput", "opens_reasoning", "parse_output", "parse_tool_call"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>")


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_message(self) -> dict:
        """An OpenAI chat-completion assistant message (content is None when only calls)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _schemas(tools: Sequence[Mapping] | None) -> dict[str, dict]:
    """function name -> its parameters' `properties` schema."""
    out: dict[str, dict] = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _convert(value: str, schema: Any) -> Any:
    # The schema comes from whoever sent the request: anything may be here (the server checks
    # schemas, but the Python API does not), so a type that is not a string or a list of
    # strings counts as no type at all.
    types = schema.get("type") if isinstance(schema, Mapping) else None
    types = [types] if isinstance(types, str) else list(types) if isinstance(types, (list, tuple)) else []
    if types and all(t == "string" for t in types):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, ValueError):
        return value


def _parse_xml(body: str, schemas: Mapping[str, dict]) -> tuple[str, dict]:
    m = _FUNCTION.search(body)
    if not m:
        raise ValueError("no <function=NAME> in the block")
    name = m.group(1).strip()
    rest = body[m.end():]
    end = rest.rfind("</function>")
    if end >= 0:
        rest = rest[:end]
    props = schemas.get(name, {})
    args: dict[str, Any] = {}
    opens = list(_PARAM.finditer(rest))
    for i, p in enumerate(opens):
        stop = opens[i + 1].start() if i + 1 < len(opens) else len(rest)
        chunk = rest[p.end():stop]
        close = chunk.rfind("</parameter>")
        value = chunk[:close] if close >= 0 else chunk
        # The template writes "\n" after the opening tag and before the closing one.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        pname = p.group(1).strip()
        args[pname] = _convert(value, props.get(pname))
    return name, args


def _parse_json(body: str) -> tuple[str, dict]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('JSON call needs a "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError("arguments string is not valid JSON") from None
    if not isinstance(args, dict):
        raise ValueError("arguments must be a JSON object")
    return obj["name"], args


def parse_tool_call(body: str, tools: Sequence[Mapping] | None = None) -> tuple[str, dict]:
    """(name, arguments) from the text inside one <tool_call> block, XML or JSON form."""
    stripped = body.strip()
    if stripped.startswith("{"):
        return _parse_json(stripped)
    return _parse_xml(stripped, _schemas(tools))


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside an open ``<think>`` block (thinking on): the
    generated text then starts as reasoning (``parse_output``'s ``reasoning_started``)."""
    return prompt.rstrip().endswith(THINK_OPEN)


def _split_reasoning(text: str, reasoning_started: bool) -> tuple[str | None, str]:
    head = text.lstrip()
    close = text.find(THINK_CLOSE)
    if close >= 0:
        reasoning = text[:close]
        open_at = reasoning.find(THINK_OPEN)
        if open_at >= 0:
            reasoning = reasoning[open_at + len(THINK_OPEN):]
        return reasoning.strip(), text[close + len(THINK_CLOSE):]
    if head.startswith(THINK_OPEN):
        return head[len(THINK_OPEN):].strip(), ""
    if reasoning_started:
        return text.strip(), ""
    return None, text


def parse_output(
    text: str,
    *,
    tools: Sequence[Mapping] | None = None,
    reasoning_started: bool = False,
    make_id: Callable[[], str] = _new_id,
) -> ParsedOutput:
    """Split generated text into reasoning, content and OpenAI-shaped tool calls."""
    reasoning, rest = _split_reasoning(text, reasoning_started)
    schemas = _schemas(tools)
    calls: list[dict] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = 0
    while True:
        start = rest.find(CALL_OPEN, pos)
        if start < 0:
            kept.append(rest[pos:])
            break
        end = rest.find(CALL_CLOSE, start)
        body_end = end if end >= 0 else len(rest)
        block_end = end + len(CALL_CLOSE) if end >= 0 else len(rest)
        body = rest[start + len(CALL_OPEN):body_end]
        kept.append(rest[pos:start])
        try:
            stripped = body.strip()
            name, args = _parse_json(stripped) if stripped.startswith("{") else _parse_xml(stripped, schemas)
            calls.append(
                {
                    "id": make_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        except ValueError as e:
            errors.append(f"tool call {len(calls) + len(errors)}: {e}")
            kept.append(rest[start:block_end])
        pos = block_end
    content = "".join(kept).strip()
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls, errors=errors)
