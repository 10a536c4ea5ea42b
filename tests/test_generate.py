"""The user-facing generation API on the shipped demo model (a real trained checkpoint of the
Qwen3.5-MoE architecture with its own tokenizer and chat template).

References are independent of lily's generation loop: argmax / log-softmax of
``model.logits`` (teacher-forced, checked against transformers elsewhere), from-scratch
generation of the rendered history, and the tokenizer's own decode.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import lily


@pytest.fixture(scope="module")
def model():
    return lily.Model.load()


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_repr_and_default_model(model):
    r = repr(model)
    assert "qwen3_5_moe" in r and "4-bit" in r and "backend=cpu" in r
    assert model.tokenizer is not None and model.tokenizer.chat_template


def test_greedy_matches_argmax_of_teacher_forced_logits(model):
    prompt = "The standard library"
    # repetition_penalty=1: plain argmax (the demo's generation_config.json sets 1.3).
    res = model.generate(prompt, max_tokens=12, temperature=0, repetition_penalty=1)
    ids = model.tokenizer.encode(prompt)
    # Re-derive each greedy token from the teacher-forced logits of prompt + tokens so far.
    logits = model.logits(ids + res.tokens[:-1])
    expected = [int(np.argmax(row)) for row in logits[len(ids) - 1 :]]
    assert res.tokens == expected
    assert res.text == model.tokenizer.decode(res.tokens, skip_special_tokens=True)
    assert res.prompt_tokens == len(ids) and res.completion_tokens == len(res.tokens)
    assert res.finish_reason in ("stop", "length") and res.ttft_s > 0


def test_logprobs_are_log_softmax_of_logits(model):
    res = model.generate("A module is", max_tokens=3, temperature=0, repetition_penalty=1, logprobs=5)
    ids = model.tokenizer.encode("A module is")
    first = _log_softmax(model.logits(ids)[-1])
    lp = res.logprobs[0]
    assert lp["token"] == int(np.argmax(first))
    assert lp["logprob"] == pytest.approx(first[lp["token"]], abs=1e-3)
    top_ids = [t["token"] for t in lp["top_logprobs"]]
    assert top_ids == list(np.argsort(-first)[:5])


def test_seed_reproduces_and_sampling_varies(model):
    a = model.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=7)
    b = model.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=7)
    assert a.tokens == b.tokens
    others = {tuple(model.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=s).tokens)
              for s in range(8, 12)}
    assert len(others | {tuple(a.tokens)}) > 1


def test_stream_concatenates_to_the_result(model):
    kw = dict(max_tokens=40, temperature=0.8, seed=3)
    full = model.generate("The interpreter", **kw)
    chunks = list(model.generate("The interpreter", stream=True, **kw))
    assert "".join(c.text for c in chunks) == full.text
    assert [c.token for c in chunks if c.token is not None] == full.tokens
    assert chunks[-1].finish_reason == full.finish_reason
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_stop_string_spanning_tokens(model):
    base = model.generate("The function returns", max_tokens=40, temperature=0)
    toks = base.tokens
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [model.tokenizer.decode([t]) for t in toks]
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    start = len("".join(pieces[:k])) + 1
    stop = base.text[start : start + len(pieces[k]) + 1]
    assert stop and stop not in base.text[:start]
    res = model.generate("The function returns", max_tokens=40, temperature=0, stop=[stop])
    assert res.finish_reason == "stop"
    assert res.text == base.text[: base.text.index(stop)]
    streamed = "".join(c.text for c in model.generate("The function returns", max_tokens=40, temperature=0,
                                                    stop=stop, stream=True))
    assert streamed == res.text


def test_over_long_prompt_is_refused_before_compute(model):
    too_long = list(range(5)) * (model.max_context // 5 + 1)
    with pytest.raises(lily.RequestError, match="context"):
        model.generate(too_long, max_tokens=1)


def test_bad_sampling_parameters(model):
    with pytest.raises(lily.RequestError):
        model.generate("x", max_tokens=2, top_p=1.5)
    with pytest.raises(lily.RequestError):
        model.generate("x", max_tokens=-1)


def test_threads_are_serialized_with_correct_answers(model):
    prompts = ["The module", "A class", "Exceptions are", "The list"]
    alone = [model.generate(p, max_tokens=15, temperature=0).tokens for p in prompts]
    out = [None] * len(prompts)

    def run(i):
        out[i] = model.generate(prompts[i], max_tokens=15, temperature=0).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == alone


def test_ctrl_c_interrupts_and_leaves_the_model_usable(model, sigint_raises):
    sent = []

    def interrupt():
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(0.3, interrupt)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            # Generations back to back (any one may end early on EOS), so the signal lands
            # inside one of them; bounded, so a lost signal fails instead of hanging.
            deadline = time.monotonic() + 60
            seed = 0
            while time.monotonic() < deadline:
                model.generate("The", max_tokens=200, temperature=0.7, seed=seed)
                seed += 1
        latency = time.perf_counter() - sent[0]
    finally:
        timer.cancel()
    assert latency < 1.0, f"KeyboardInterrupt took {latency:.2f} s"
    res = model.generate("The standard library", max_tokens=5, temperature=0)
    assert res.completion_tokens >= 1


def test_chat_reuses_state_and_equals_from_scratch(model):
    chat = model.chat(system="You answer briefly.", temperature=0)
    for i, q in enumerate(["What is a list?", "And a tuple?", "What about a set?"]):
        r = chat.send(q, max_tokens=24)
        scratch = model.generate(chat.messages[:-1], max_tokens=24, temperature=0)
        assert r.tokens == scratch.tokens
        assert r.text == scratch.text
        assert r.prompt_tokens == scratch.prompt_tokens
        if i > 0:
            # Only the new turn (and any re-rendered tail) went through the model.
            assert r.cached_tokens > 0
            assert r.prefilled_tokens < r.prompt_tokens
        assert chat.position >= r.prompt_tokens


def test_chat_undo_and_stream(model):
    chat = model.chat(temperature=0)
    first = chat.send("Describe a dictionary.", max_tokens=16)
    chat.send("Now something else.", max_tokens=16)
    chat.undo()
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    again = "".join(c.text for c in chat.send("Now something else.", stream=True, max_tokens=16))
    scratch = model.generate(chat.messages[:-1], max_tokens=16, temperature=0)
    assert again == scratch.text
    assert chat.messages[1]["content"] == first.content


def test_chat_with_tools_renders_them(model):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}]
    text = model.render_chat([{"role": "user", "content": "Weather in Oslo?"}], tools=tools)
    assert "get_weather" in text
    chat = model.chat(tools=tools, temperature=0)
    r = chat.send("Weather in Oslo?", max_tokens=8)
    assert isinstance(r.tool_calls, list) and r.content is not None
