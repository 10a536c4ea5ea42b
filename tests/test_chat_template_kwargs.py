"""Every `chat_template_kwargs` key reaches the chat template — from `render`, `Model.generate`,
`Chat` and the server's request field — checked against transformers' `apply_chat_template` on
the same template and messages. The template is lily's Qwen3.5/3.6 one, which keeps the reasoning
of every assistant turn when `preserve_thinking` is true, as Qwen3.6's own template does (and
only the turns after the last user query otherwise)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

import lily
from lily.chat_template import render, template_kwargs
from qwen_fixture import TEMPLATE_PATH, qwen_dir  # noqa: F401
from test_server import _request, start_server, stop_server

TEMPLATE = TEMPLATE_PATH.read_text()
HISTORY = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "First question"},
    {"role": "assistant", "content": "First answer", "reasoning_content": "old thoughts"},
    {"role": "user", "content": "Second question"},
    {"role": "assistant", "content": "<think>\nolder style thoughts\n</think>\n\nSecond answer"},
    {"role": "user", "content": "Third question"},
]


@pytest.fixture(scope="module")
def hf(qwen_dir):  # noqa: F811
    return PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"), eos_token="<|im_end|>")


def _want(hf, **kwargs) -> str:
    return hf.apply_chat_template(HISTORY, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True,
                                  **kwargs)


@pytest.mark.parametrize("preserve", [None, True, False], ids=["preserve_unset", "preserve_on", "preserve_off"])
@pytest.mark.parametrize("thinking", [None, True, False], ids=["think_default", "think_on", "think_off"])
def test_preserve_thinking_renders_as_transformers(hf, preserve, thinking):
    kwargs = {} if preserve is None else {"preserve_thinking": preserve}
    extra = {} if thinking is None else {"enable_thinking": thinking}
    want = _want(hf, **kwargs, **extra)
    got = render(TEMPLATE, HISTORY, add_generation_prompt=True, **template_kwargs(kwargs, thinking))
    assert got == want
    # the flag did something: the earlier turns' reasoning is kept only with preserve_thinking
    assert ("old thoughts" in got) == bool(preserve)
    assert ("older style thoughts" in got) == bool(preserve)


def test_template_kwargs_are_validated():
    assert template_kwargs({"preserve_thinking": True, "x": 1}, False) == {
        "preserve_thinking": True, "x": 1, "enable_thinking": False}
    assert template_kwargs({"enable_thinking": True}, None) == {"enable_thinking": True}
    assert template_kwargs({"enable_thinking": None}, None) == {}
    with pytest.raises(ValueError, match="disagrees"):
        template_kwargs({"enable_thinking": True}, False)
    with pytest.raises(ValueError, match="'enable_thinking' must be a boolean"):
        template_kwargs({"enable_thinking": "no"}, None)
    for key in ("messages", "tools", "add_generation_prompt", "limits"):
        with pytest.raises(ValueError, match=repr(key)):
            template_kwargs({key: 1}, None)
    with pytest.raises(ValueError, match="not a template variable name"):
        template_kwargs({"not a name": 1}, None)
    with pytest.raises(ValueError, match="must be an object"):
        template_kwargs(["preserve_thinking"], None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo model with lily's Qwen3.5/3.6 template in place of its own."""
    out = tmp_path_factory.mktemp("kwargs_model") / "m"
    shutil.copytree(lily.model.demo_model_path(), out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def demo_hf(model_dir):
    return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def model(model_dir):
    return lily.Model.load(model_dir)


def _prompt_tokens(hf, **kwargs) -> int:
    return len(hf(_want(hf, **kwargs), add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("preserve", [True, False])
def test_generate_and_chat_pass_every_key(model, demo_hf, preserve):
    hf = demo_hf
    kwargs = {"preserve_thinking": preserve}
    assert model.render_chat(HISTORY, chat_template_kwargs=kwargs, enable_thinking=False) == _want(
        hf, enable_thinking=False, **kwargs)
    want = _prompt_tokens(hf, **kwargs)
    r = model.generate(HISTORY, max_tokens=1, chat_template_kwargs=kwargs)
    assert r.prompt_tokens == want
    chat = model.chat(chat_template_kwargs=kwargs, max_tokens=1)
    for m in HISTORY[:-1]:
        chat.add_message(**m)
    assert chat.send(HISTORY[-1]["content"]).prompt_tokens == want
    with pytest.raises(lily.RequestError, match="disagrees"):
        model.generate(HISTORY, max_tokens=1, enable_thinking=True, chat_template_kwargs={"enable_thinking": False})


def test_server_passes_every_key(model_dir, demo_hf):
    hf = demo_hf
    proc, base, _ = start_server("--model", str(model_dir))
    try:
        def post(body):
            return _request(base, "POST", "/v1/chat/completions", timeout=120,
                            headers={"Content-Type": "application/json"},
                            body=json.dumps({"model": str(model_dir), "messages": HISTORY, "max_tokens": 1, **body}).encode())

        for preserve in (True, False):
            r = post({"chat_template_kwargs": {"preserve_thinking": preserve}})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == _prompt_tokens(hf, preserve_thinking=preserve)
        r = post({"chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and "'messages'" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "chat_template_kwargs"
        r = post({"chat_template_kwargs": {"enable_thinking": "yes"}})
        assert r.status_code == 400 and "enable_thinking" in r.json()["error"]["message"]
    finally:
        stop_server(proc)
