"""lily.chat_template.render against transformers' apply_chat_template (same template, same
messages), and hostile templates failing safely."""

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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


# -- issue 22, item 10: memory, not only time -------------------------------------------------

# Templates that build a value of gigabytes in a few steps; before the value limit covered every
# string and list the sandbox builds, each reached GBs before MemoryError (or ran out the clock
# after taking them).
MEMORY_BOMBS = {
    "concat_doubling": "{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}"
                       "{% endfor %}{{ ns.x | length }}",
    "replace_growth": "{% set ns = namespace(x='a') %}{% for i in range(64) %}{% set ns.x = ns.x.replace('a', 'aa') %}"
                      "{% endfor %}{{ ns.x | length }}",
    "replace_filter": "{% set ns = namespace(x='a') %}{% for i in range(64) %}"
                      "{% set ns.x = ns.x | replace('a', 'aaaa') %}{% endfor %}",
    "join_filter": "{{ (['x' * 100000] * 100000) | join }}",
    "join_method": "{{ ''.join(['x' * 1000000] * 1000) }}",
    "set_block": "{% set s = 'x' * 1000000 %}{% set out %}{% for i in range(10000) %}{{ s }}{% endfor %}{% endset %}"
                 "{{ out | length }}",
    "macro_doubling": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% else %}{{ 'x' * 1000000 }}"
                      "{% endif %}{% endmacro %}{{ f(12) | length }}",
    "print_references": "{{ ['x' * 1000000] * 1000 }}",
    "tojson_references": "{{ (['x' * 1000000] * 1000) | tojson }}",
    # Found by the template fuzz target: filters that take the text of a list of references.
    "escape_references": "{{ (['x' * 100000] * 100000) | e }}",
    "upper_references": "{{ (['x' * 100000] * 100000) | upper | length }}",
    "wordcount_references": "{{ (['x' * 100000] * 100000) | wordcount }}",
    "concat_list": "{{ (['x' * 1000000] * 1000) ~ '' }}",
    "sum_lists": "{{ ([['x'] * 1000000] * 1000) | sum(start=[]) | length }}",
    "format_fields": "{{ ('{0}' * 100000).format('x' * 1000000) }}",
    "percent_fields": "{{ ('%s' * 100000) % (('x' * 1000000,) * 100000) }}",
    "indent": "{{ ('x\\n' * 500000) | indent(900000) }}",
    "lipsum": "{{ lipsum(1000000) }}",
    "int_squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
}

_GROWTH = ["{v} ~ {v}", "{v} + {v}", "{v} * 2", "{v}.replace('a', 'aa')", "{v} | replace('a', 'aaa')",
           "[{v}, {v}] | join", "'{{0}}{{0}}'.format({v})", "{v} | indent(3, true)", "{v} | string",
           "{v} | tojson", "[{v}] * 3", "([{v}] * 3) | sum(start=[])", "'%s%s' % ({v}, {v})", "{v} | list",
           "{v} | center(2 * ({v} | length))", "{v} | wordwrap(1, wrapstring='ab')"]


def _template(ops: list[int], loops: int, block: bool) -> str:
    body = "".join(f"{{% set ns.x = {_GROWTH[i].format(v='ns.x')} %}}" for i in ops)
    loop = f"{{% for i in range({loops}) %}}{body}{{% endfor %}}"
    if block:
        loop = f"{{% set captured %}}{{% for i in range({loops}) %}}{{{{ ns.x }}}}{{% endfor %}}{{% endset %}}" + loop
    return "{% set ns = namespace(x='ab') %}" + loop + "{{ ns.x | length }}"


def _render_in_child(template: str, limits: dict, address_space: int, timeout: float) -> tuple[str, int]:
    """Renders in a forked child under an address-space limit (so a template that escapes the
    budget fails there instead of taking the machine): (outcome, tracemalloc peak bytes)."""
    import os
    import resource
    import signal
    import tracemalloc

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(r)
        outcome, peak = "rendered", -1
        try:
            vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (vm + address_space, resource.RLIM_INFINITY))
            tracemalloc.start()
            try:
                render(template, [{"role": "user", "content": "hi"}], limits=limits)
            except ChatTemplateError as e:
                outcome = f"ChatTemplateError: {str(e)[:200]}"
            peak = tracemalloc.get_traced_memory()[1]
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            outcome = type(e).__name__
        os.write(w, json.dumps([outcome, peak]).encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return "timeout", -1
        time.sleep(0.01)
    data = os.read(r, 4096)
    os.close(r)
    return tuple(json.loads(data)) if data else ("crashed", -1)


def test_template_memory_bombs_are_bounded():
    """Each bomb fails with a ChatTemplateError naming the size limit it hit, and the render's
    peak memory (tracemalloc) stays within a few times the value limit (1,000,000 characters).
    Each runs in a child under an address-space limit, so the old code fails instead of taking
    the machine."""
    for name, template in MEMORY_BOMBS.items():
        outcome, peak = _render_in_child(template, {"timeout_s": 5.0}, address_space=2 << 30, timeout=60)
        assert outcome.startswith("ChatTemplateError") and ("limit" in outcome or "too large" in outcome), \
            (name, outcome)
        assert peak < 64 << 20, f"{name}: peak {peak / 2**20:.0f} MiB"


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.integers(0, len(_GROWTH) - 1), min_size=1, max_size=4), loops=st.integers(1, 40),
       block=st.booleans())
def test_template_growth_property(ops, loops, block):
    """Any mix of the operations that grow a value, repeated in a loop: the render ends in text
    or a ChatTemplateError, and its peak memory stays within a few times the value limit."""
    limits = {"max_value_len": 20_000, "max_output_chars": 40_000, "max_steps": 50_000, "timeout_s": 5.0}
    template = _template(ops, loops, block)
    outcome, peak = _render_in_child(template, limits, address_space=1 << 30, timeout=30)
    assert outcome == "rendered" or outcome.startswith("ChatTemplateError"), (outcome, template)
    # 20,000 characters are at most 80 KB (UCS-4); a few of them plus Jinja's own state.
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB for {template}"
