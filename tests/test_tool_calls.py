"""Reasoning / content / tool-call parsing. The assistant text parsed here is produced by
transformers' apply_chat_template from structured calls, so a round trip must give back the
calls it was rendered from."""

import itertools
import json

import pytest
from transformers import PreTrainedTokenizerFast

from lily.tool_calls import parse_output, parse_tool_call
from qwen_fixture import TEMPLATE_PATH, qwen_dir  # noqa: F401

TEMPLATE = TEMPLATE_PATH.read_text()

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
        "opts": {"type": "object"}, "tags": {"type": "array"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


@pytest.fixture(scope="module")
def hf(qwen_dir):  # noqa: F811
    return PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"), eos_token="<|im_end|>")


def assistant_text(hf, message):
    """The text transformers renders for one assistant turn (between its header and <|im_end|>)."""
    msgs = [{"role": "user", "content": "q"}, message]
    full = hf.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False)
    head = "<|im_start|>assistant\n"
    return full[full.rindex(head) + len(head): full.rindex("<|im_end|>")]


@pytest.mark.parametrize("content", ["", "Let me look that up."])
def test_round_trip_through_transformers_rendering(hf, content):
    calls = [
        {"name": "get_weather", "arguments": {"city": "São Paulo", "zip": "01310", "days": 3,
                                               "opts": {"unit": "C", "deep": [1, {"x": None}]},
                                               "tags": ["a", "b"], "note": "two\nlines </parameter> inside"}},
        {"name": "now", "arguments": {}},
    ]
    message = {"role": "assistant", "content": content, "reasoning_content": "I should call tools.",
               "tool_calls": [{"type": "function", "function": c} for c in calls]}
    text = assistant_text(hf, message)
    assert text.startswith("<think>\nI should call tools.\n</think>\n\n")
    out = parse_output(text, tools=TOOLS, make_id=ids())
    assert out.reasoning == "I should call tools."
    assert out.content == content
    assert out.errors == []
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "now"]
    for got, want in zip(out.tool_calls, calls, strict=True):
        assert got["type"] == "function" and got["id"].startswith("call_")
        assert json.loads(got["function"]["arguments"]) == want["arguments"]
    msg = out.to_message()
    assert msg["role"] == "assistant" and msg["tool_calls"] == out.tool_calls
    assert msg["content"] == (content or None)


def test_schema_keeps_number_like_strings_as_text():
    text = "<tool_call>\n<function=get_weather>\n<parameter=zip>\n01310\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    with_schema = json.loads(parse_output(text, tools=TOOLS).tool_calls[0]["function"]["arguments"])
    without = json.loads(parse_output(text).tool_calls[0]["function"]["arguments"])
    assert with_schema == {"zip": "01310", "days": 3}
    assert without == {"zip": "01310", "days": 3}  # "01310" is not valid JSON: stays text
    text2 = text.replace("01310", "12345")
    assert json.loads(parse_output(text2, tools=TOOLS).tool_calls[0]["function"]["arguments"])["zip"] == "12345"
    assert json.loads(parse_output(text2).tool_calls[0]["function"]["arguments"])["zip"] == 12345


def test_qwen3_json_form():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>'
    out = parse_output(text, make_id=ids())
    assert out.content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("now", {})]
    assert parse_tool_call('{"name": "f", "arguments": {"a": 1}}') == ("f", {"a": 1})


def test_reasoning_forms():
    # Prompt opened <think>: output starts inside it.
    out = parse_output("step 1\nstep 2\n</think>\n\nThe answer.")
    assert (out.reasoning, out.content) == ("step 1\nstep 2", "The answer.")
    # Explicit block, thinking-off prompt (empty block already in the prompt): no reasoning.
    assert parse_output("<think>\nhm\n</think>\n\nok").reasoning == "hm"
    assert parse_output("just text").reasoning is None
    # Cut off while thinking.
    out = parse_output("still thinking about", reasoning_started=True)
    assert (out.reasoning, out.content) == ("still thinking about", "")
    out = parse_output("<think>\nhalf", reasoning_started=False)
    assert (out.reasoning, out.content) == ("half", "")


def test_unclosed_last_block_is_parsed():
    text = "<tool_call>\n<function=now>\n</function>\n"
    out = parse_output(text)
    assert [c["function"]["name"] for c in out.tool_calls] == ["now"] and out.content == ""


def test_malformed_block_stays_in_content():
    text = "Hmm <tool_call>\nnot a call\n</tool_call> done <tool_call>{bad json}</tool_call>"
    out = parse_output(text)
    assert out.tool_calls == []
    assert out.content == text
    assert len(out.errors) == 2 and "function" in out.errors[0] and "JSON" in out.errors[1]


# -- issue 22, item 7: schemas from a request are untrusted --------------------------------------

CALL_TEXT = ("<tool_call>\n<function=f>\n<parameter=x>\n{value}\n</parameter>\n<parameter=y>\n7\n</parameter>\n"
             "</function>\n</tool_call>")


@pytest.mark.parametrize("type_", [5, True, 1.5, None, [7, "string"], {"a": 1}, ["string", None]])
def test_parameter_type_of_any_json_value_parses(type_):
    """A parameter whose `type` was a number, true or 1.5 made the parser raise TypeError."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": type_}, "y": {"type": "integer"}}}}}]
    parsed = parse_output(CALL_TEXT.format(value="12"), tools=tools)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f"]
    args = json.loads(parsed.tool_calls[0]["function"]["arguments"])
    assert args["y"] == 7 and args["x"] in (12, "12")


def _json():
    from hypothesis import strategies as st

    return st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                        max_leaves=8)


def test_any_tools_value_and_output_parse_without_raising():
    """Property: whatever the tools value (any JSON) and whatever the model wrote, parse_output
    returns a ParsedOutput (a block it cannot read stays in the content)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    schema = st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        st.sampled_from(["x", "y", "z"]), st.fixed_dictionaries({}, optional={"type": st.integers() | st.floats() | st.booleans() | st.sampled_from(
            ["string", "integer", "object"]) | _json()}) | _json(), max_size=3)})

    @settings(max_examples=400, deadline=None)
    @given(tools=st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
               {"name": st.sampled_from(["f", "g"])}, optional={"parameters": schema | _json()})}), max_size=2)
           | _json(),
           value=st.text(max_size=20), body=st.text(max_size=60))
    def check(tools, value, body):
        tools = tools if isinstance(tools, list) and all(isinstance(t, dict) for t in tools) else None
        for text in (CALL_TEXT.format(value=value), f"<tool_call>{body}</tool_call>", body):
            parsed = parse_output(text, tools=tools)
            for c in parsed.tool_calls:
                assert isinstance(json.loads(c["function"]["arguments"]), dict)

    check()
