"""lily.chat_template.render against transformers' apply_chat_template (same template, same
messages), and hostile templates failing safely."""

import json
import time

import pytest
from transformers import PreTrainedTokenizerFast

from lily.chat_template import ChatTemplateError, render
from lily.tokenizer import Tokenizer
from qwen_fixture import TEMPLATE_PATH, qwen_dir  # noqa: F401

TEMPLATE = TEMPLATE_PATH.read_text()
# A second, independently written template from this repo (the demo model's), when present.
DEMO_TEMPLATE_PATH = TEMPLATE_PATH.parents[3] / "scripts" / "demo_model" / "assets" / "chat_template.jinja"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast for a city — in °C <metric> & 'quoted'",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {"type": "object", "properties": {}}}},
]

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3, "opts": {"unit": "C", "list": [1, 2]}}}}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there 👋"}],
    "system": [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "2+2?"}],
    "multi_turn_with_history_reasoning": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nFirst answer"},
        {"role": "user", "content": "Second question"},
        {"role": "assistant", "content": "Second answer", "reasoning_content": "recent thoughts"},
        {"role": "user", "content": [{"type": "text", "text": "Third, "}, {"type": "text", "text": "in parts"}]},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "Let me check.", "reasoning": "use the tool", "tool_calls": [CALL, {"function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "content": json.dumps({"temp": 21})},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "It is 21 °C.", "tool_calls": None},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_call_only_pending": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
    ],
}


@pytest.fixture(scope="module")
def hf(qwen_dir):  # noqa: F811
    return PreTrainedTokenizerFast(
        tokenizer_file=str(qwen_dir / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("thinking", [None, True, False], ids=["think_default", "think_on", "think_off"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_render_matches_transformers(hf, name, tools, thinking, gen):
    messages = CONVERSATIONS[name]
    extra = {} if thinking is None else {"enable_thinking": thinking}
    want = hf.apply_chat_template(
        messages, tools=tools, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=gen, **extra
    )
    got = render(TEMPLATE, messages, tools=tools, add_generation_prompt=gen, enable_thinking=thinking,
                 eos_token="<|im_end|>", pad_token="<|endoftext|>")
    assert got == want
    assert got.count("<|im_start|>") >= 1


@pytest.mark.skipif(not DEMO_TEMPLATE_PATH.is_file(), reason="demo model template not in this tree")
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False], ids=["think_default", "think_on", "think_off"])
def test_demo_template_matches_transformers(hf, name, thinking):
    template = DEMO_TEMPLATE_PATH.read_text()
    messages = CONVERSATIONS[name]
    extra = {} if thinking is None else {"enable_thinking": thinking}
    kw = dict(tools=TOOLS, add_generation_prompt=True)
    try:
        want = hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kw, **extra)
    except Exception as e:  # the template rejects this input in transformers too: so must lily
        with pytest.raises(ChatTemplateError, match=type(e).__name__):
            render(template, messages, enable_thinking=thinking, **kw)
        return
    got = render(template, messages, enable_thinking=thinking, eos_token="<|im_end|>",
                 pad_token="<|endoftext|>", **kw)
    assert got == want


def test_thinking_switch_changes_the_generation_prompt():
    msgs = CONVERSATIONS["single"]
    on = render(TEMPLATE, msgs, add_generation_prompt=True, enable_thinking=True)
    off = render(TEMPLATE, msgs, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_openai_string_arguments_are_parsed(hf):
    # OpenAI clients send arguments as a JSON string; lily parses it, so the template renders
    # the same as transformers does with the parsed mapping.
    as_string = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(CALL["function"]["arguments"])}}]},
    ]
    as_dict = [as_string[0], {"role": "assistant", "tool_calls": [CALL]}]
    want = hf.apply_chat_template(as_dict, chat_template=TEMPLATE, tokenize=False)
    assert render(TEMPLATE, as_string) == want
    assert "<parameter=city>\nZürich\n</parameter>" in want


def test_tokenizer_apply_chat_template_matches_transformers_ids(qwen_dir, hf):  # noqa: F811
    tok = Tokenizer.from_dir(qwen_dir)
    msgs = CONVERSATIONS["tool_round_trip"]
    want = hf.apply_chat_template(msgs, tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False)
    got = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True)
    assert got == list(want)
    assert got[-3:] == tok.encode("assistant\n<think>\n")[-3:]


def test_hf_helpers_match_transformers(hf):
    # tojson without HTML escaping and with its keyword options, strftime_now, loop controls,
    # namespace, raise_exception text.
    t = (
        "{{ messages[0].content | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=true) }}|"
        "{% for m in range(10) %}{% if m == 3 %}{% break %}{% endif %}{% if m == 1 %}{% continue %}{% endif %}{{ m }}{% endfor %}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
        "{{ strftime_now('%Y') }}|{% generation %}gen{% endgeneration %}|{{ dict(a=1) | tojson }}"
    )
    msgs = [{"role": "user", "content": "<b>&'é\"</b>"}]
    assert render(t, msgs) == hf.apply_chat_template(msgs, chat_template=t, tokenize=False)
    with pytest.raises(ChatTemplateError, match="No system allowed"):
        render("{{ raise_exception('No system allowed') }}", msgs)


# --------------------------------------------------------------------------------- hostile

MSGS = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ namespace.__init__.__globals__['os'] }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ (messages | first).__class__ }}",
    ],
)
def test_attribute_walking_is_refused(template):
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe|undefined|attribute"):
        render(template, MSGS)


@pytest.mark.parametrize(
    "template,match",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "step budget"),
        ("{{ 'a' * 100000000 }}", "longer than"),
        ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "longer than"),
        ("{{ 7 ** 99999999 }}", "too large"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "deeper than"),
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output exceeded"),
        ("{% for m in messages %}", "syntax error"),
        # Found by the hardening review (docs/reliability.md): loops that make no calls, widths
        # passed to methods / filters / format strings, and nesting that overflows the parser.
        ("{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}", "step budget|longer than"),
        ("{% for a in messages * 1000 %}{% for b in messages * 1000 %}{% for c in messages * 1000 %}"
         "{% endfor %}{% endfor %}{% endfor %}", "step budget|longer than"),
        ("{{ 'a'.ljust(2000000000) }}", "value limit"),
        ("{{ 'x' | center(2000000000) }}", "value limit"),
        ("{{ messages | tojson(indent=100000000) }}", "value limit"),
        ("{{ '%0999999999d' % 1 }}", "format width"),
        ("{{ '{:>999999999}'.format(1) }}", "format width"),
        ("{{ '%s' | format('x') }}{{ '%0999999999d' | format(1) }}", "format width"),
        ("{{ " + "(" * 400 + "1" + ")" * 400 + " }}", "nested too deeply"),
    ],
)
def test_resource_bombs_are_bounded(template, match):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=match):
        render(template, MSGS)
    assert time.monotonic() - t0 < 10


def test_ordinary_widths_and_loops_still_render():
    t = ("{% for m in messages %}{{ loop.index }}:{{ m.role.ljust(6) }}|{% endfor %}"
         "{{ '%05d' % 42 }} {{ '{:>4}'.format('ab') }} {{ 'x' | center(5) }} {{ '%s!' | format('hi') }}")
    assert render(t, MSGS) == "1:user  |00042   ab   x   hi!"


def test_limits_are_adjustable_and_validated():
    t = "{% for i in range(1000) %}{% endfor %}ok"
    assert render(t, MSGS) == "ok"
    with pytest.raises(ChatTemplateError, match="step budget"):
        render(t, MSGS, limits={"max_steps": 100})
    with pytest.raises(ValueError, match="unknown"):
        render(t, MSGS, limits={"max_stepz": 1})


def test_bad_messages():
    with pytest.raises(TypeError):
        render(TEMPLATE, "hello")
    with pytest.raises(ValueError, match="role"):
        render(TEMPLATE, [{"content": "x"}])
    with pytest.raises(ValueError, match="not valid JSON"):
        render(TEMPLATE, [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}])
    with pytest.raises(ChatTemplateError, match="no user message"):
        render(TEMPLATE, [{"role": "system", "content": "x"}])
    with pytest.raises(TypeError, match="JSON-like"):
        render(TEMPLATE, [{"role": "user", "content": object()}])
