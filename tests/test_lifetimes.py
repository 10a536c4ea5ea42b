"""How streams, chat turns and generations end, on the shipped demo model.

A model runs up to ``max_batch`` generations at once (they share engine passes; 8 by default
on the CPU). A stream ends — and frees its slot at once — when it is exhausted, closed,
garbage-collected, interrupted by Ctrl-C, when the same thread starts another generation while
every slot is taken, or when it sat idle past the slots' idle timeout while another generation
waited; its ``result`` then holds the partial text and tokens with finish_reason "cancelled".
A chat turn that does not finish is rolled back (docs/api-generation.md). Tests of the
full-slots rules run the model with ``max_batch = 1`` (the ``serial`` fixture).

References: a full greedy generation of the same prompt (a cancelled stream's tokens are its
prefix), the tokenizer's own decode, and from-scratch generation of the rendered history. The
long generations ban the end-of-sequence tokens (logit_bias -100), so they run to max_tokens
whatever the demo model's habits (the third demo ends "Errors" after one token).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest

import lily


@pytest.fixture(scope="module")
def model():
    return lily.Model.load()


@pytest.fixture
def serial(model):
    """The model with one generation slot (every slot taken by one stream)."""
    model.max_batch = 1
    yield model
    model.max_batch = 8


def _generate_in_thread(model, timeout: float = 30.0):
    """A generation in another thread: returns its result, or None if the model stayed busy."""
    out = []
    t = threading.Thread(target=lambda: out.append(model.generate("Errors", max_tokens=2, temperature=0)),
                         daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else None


def _no_eos(model) -> dict[int, float]:
    return {int(t): -100.0 for t in model.eos_token_ids}


def _partial_stream(model, n: int, prompt: str = "Errors"):
    stream = model.generate(prompt, max_tokens=200, temperature=0, logit_bias=_no_eos(model), stream=True)
    chunks = []
    for c in stream:
        chunks.append(c)
        if len(chunks) == n:
            break
    return stream, chunks


def test_a_stream_broken_out_of_continues_beside_the_next_generate(model):
    """Slots free: the next generate runs beside the open stream, which later goes on as if alone."""
    full = model.generate("Errors", max_tokens=200, temperature=0, logit_bias=_no_eos(model))
    stream, chunks = _partial_stream(model, 4)
    again = model.generate("Errors", max_tokens=200, temperature=0, logit_bias=_no_eos(model))
    assert again.tokens == full.tokens
    rest = [c.token for c in stream if c.token is not None]
    assert [c.token for c in chunks] + rest == full.tokens
    assert stream.result.finish_reason == full.finish_reason


def test_the_next_generate_ends_a_stream_broken_out_of(serial):
    model = serial
    full = model.generate("Errors", max_tokens=200, temperature=0, logit_bias=_no_eos(model))
    stream, chunks = _partial_stream(model, 4)
    # Same thread, stream still referenced and unfinished: the next generate ends it and runs.
    again = model.generate("Errors", max_tokens=200, temperature=0, logit_bias=_no_eos(model))
    assert again.tokens == full.tokens
    r = stream.result
    assert r is not None and r.finish_reason == "cancelled"
    assert r.tokens == full.tokens[:4] == [c.token for c in chunks]
    assert r.text == "".join(c.text for c in chunks)
    assert r.completion_tokens == 4
    assert list(stream) == []  # an ended stream yields nothing more


def test_close_ends_the_generation_and_keeps_the_partial_result(model):
    full = model.generate("Errors", max_tokens=200, temperature=0, logit_bias=_no_eos(model))
    stream, _ = _partial_stream(model, 3)
    stream.close()
    assert stream.result.finish_reason == "cancelled"
    assert stream.result.tokens == full.tokens[:3]
    assert stream.result.text == model.tokenizer.decode(full.tokens[:3], skip_special_tokens=True)[
        : len(stream.result.text)]
    assert _generate_in_thread(model) is not None, "another thread still waits after close()"


def test_garbage_collection_frees_the_model(model):
    stream, _ = _partial_stream(model, 2)
    del stream
    gc.collect()
    assert _generate_in_thread(model) is not None, "a dropped stream kept the model busy"


def test_a_stream_never_started_is_freed_too(model):
    stream = model.generate("Errors", max_tokens=5, stream=True)
    stream.close()
    assert stream.result.finish_reason == "cancelled" and stream.result.tokens == []
    assert model.generate("Errors", max_tokens=2, temperature=0).completion_tokens >= 1


def test_ctrl_c_inside_a_stream_ends_it(model, sigint_raises):
    stream = model.generate("The", max_tokens=100000 // 1000 * 10, temperature=0.7, seed=1, stream=True)
    got = []
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for c in stream:  # restarted on EOS so the signal lands inside some stream
                    got.append(c)
                stream = model.generate("The", max_tokens=1000, temperature=0.7, seed=len(got), stream=True)
    finally:
        timer.cancel()
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert _generate_in_thread(model) is not None


def test_generate_inside_a_running_generation_is_an_error_when_no_slot_is_free(serial):
    model = serial

    def progress(done, total):
        model.generate("x", max_tokens=1)

    with pytest.raises(lily.RequestError, match="inside another"):
        model.generate(list(range(10, 40)), max_tokens=1, on_prefill_progress=progress)
    assert model.generate("Errors", max_tokens=2, temperature=0).completion_tokens >= 1


def test_generate_inside_a_running_generation_runs_when_a_slot_is_free(model):
    inner = []

    def progress(done, total):
        inner.append(model.generate("x", max_tokens=2, temperature=0).tokens)

    outer = model.generate(list(range(10, 40)), max_tokens=3, temperature=0, on_prefill_progress=progress)
    assert inner == [model.generate("x", max_tokens=2, temperature=0).tokens]
    assert outer.tokens == model.generate(list(range(10, 40)), max_tokens=3, temperature=0).tokens


def test_an_idle_stream_loses_its_slot_to_a_waiting_generation(serial):
    """A stream abandoned without close() (still referenced, never stepped again) holds its slot
    only until another generation needs it past the idle timeout."""
    model = serial
    model._generation.idle_timeout_s = 0.5
    try:
        stream, _ = _partial_stream(model, 2)
        other = _generate_in_thread(model, timeout=30)
        assert other is not None and other.completion_tokens >= 1
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
    finally:
        model._generation.idle_timeout_s = 60.0


# -- chat turns: one rule, streamed or not: an unfinished turn is rolled back -----------------------


def test_a_closed_streamed_chat_turn_is_rolled_back(model):
    chat = model.chat(temperature=0)
    chat.send("What is a list?", max_tokens=12)
    before = [dict(m) for m in chat.messages]
    stream = chat.send("And a tuple?", stream=True, max_tokens=50)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert stream.result.finish_reason == "cancelled" and stream.result.completion_tokens == 3
    assert chat.messages == before
    # The next turn renders one user message after the last answer, and equals from scratch.
    r = chat.send("And a set?", max_tokens=16)
    roles = [m["role"] for m in chat.messages]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert r.tokens == model.generate(chat.messages[:-1], max_tokens=16, temperature=0).tokens


def test_a_chat_turn_ended_by_the_next_generate_is_rolled_back(serial):
    model = serial
    chat = model.chat(temperature=0)
    stream = chat.send("What is a list?", stream=True, max_tokens=50)
    next(stream)
    model.generate("Errors", max_tokens=2)  # ends the chat's stream (same thread)
    assert stream.result.finish_reason == "cancelled"
    assert chat.messages == []


def test_an_interrupted_chat_turn_is_rolled_back(model, sigint_raises):
    chat = model.chat(temperature=0.7, seed=3)
    chat.send("What is a list?", max_tokens=8)
    before = [dict(m) for m in chat.messages]
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # each finished turn is undone so the next starts alike
                chat.send("Tell me a long story.", max_tokens=1000)
                chat.undo()
    finally:
        timer.cancel()
    assert chat.messages == before
    r = chat.send("And a tuple?", max_tokens=10, temperature=0)
    assert r.tokens == model.generate(chat.messages[:-1], max_tokens=10, temperature=0).tokens


# -- results ------------------------------------------------------------------------------------------


def test_chat_prompts_split_reasoning_in_generate_as_in_chat(model):
    messages = [{"role": "user", "content": "What is a list?"}]
    r = model.generate(messages, enable_thinking=True, max_tokens=24, temperature=0)
    from lily.tool_calls import parse_output

    rendered = model.render_chat(messages, enable_thinking=True)
    ref = parse_output(r.text, reasoning_started=rendered.rstrip().endswith("<think>"))
    assert rendered.rstrip().endswith("<think>")
    assert r.reasoning == ref.reasoning and r.reasoning  # the prompt opened the think block
    assert r.content == ref.content
    c = model.chat(enable_thinking=True, temperature=0).send("What is a list?", max_tokens=24)
    assert (c.reasoning, c.content, c.tokens) == (r.reasoning, r.content, r.tokens)
    plain = model.generate("The json module", max_tokens=8, temperature=0)
    assert plain.content == plain.text and plain.reasoning is None


def test_logprobs_carry_token_strings(model):
    r = model.generate("A module is", max_tokens=4, temperature=0, logprobs=3)
    for e in r.logprobs:
        assert e["text"] == model.tokenizer.decode([e["token"]])
        assert [t["text"] for t in e["top_logprobs"]] == [model.tokenizer.decode([t["token"]])
                                                          for t in e["top_logprobs"]]
    assert "".join(e["text"] for e in r.logprobs) == r.text
    with model.generate("A module is", max_tokens=4, temperature=0, logprobs=3, stream=True) as s:
        list(s)
    assert s.result.logprobs == r.logprobs


def test_reprs_are_short_and_informative(model):
    r = model.generate("The json module", max_tokens=200, temperature=0)
    text = repr(r)
    assert len(text) < 600 and "finish_reason=" in text and "tok/s" in text
    assert str(r.tokens[:5])[1:-1] not in text  # no token-id dump
    chat = model.chat(temperature=0)
    chat.send("Hi", max_tokens=4)
    assert repr(chat).startswith("<lily.Chat 2 messages") and "tokens in state" in repr(chat)
    s = model.session()
    s.prefill([1, 2, 3])
    assert repr(s) == f"<lily.Session position=3 max_context={s.max_context}>"
    stream = model.generate("The json module", max_tokens=3, temperature=0, stream=True)
    assert "running" in repr(stream)
    list(stream)
    assert "finished: length" in repr(stream) and "3 tokens" in repr(stream)


# -- argument errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, name", [
    ({"temperature": "hot"}, "temperature"), ({"top_k": 2.5}, "top_k"), ({"seed": "x"}, "seed"),
    ({"top_p": None, "min_p": [0.1]}, "min_p"), ({"stop": 5}, "stop"), ({"logprobs": "yes"}, "logprobs"),
    ({"max_tokens": "5"}, "max_tokens"), ({"seed": -1}, "seed"),
])
def test_bad_argument_types_are_one_line_errors(model, kw, name):
    with pytest.raises(lily.RequestError) as e:
        model.generate("x", **kw)
    msg = str(e.value)
    assert name in msg and "\n" not in msg and "incompatible function arguments" not in msg


def test_bad_prompt_and_load_types(model):
    with pytest.raises(lily.RequestError, match="prompt must be") as e:
        model.generate(3.5)
    assert "\n" not in str(e.value)
    with pytest.raises(lily.RequestError, match="token_id"):
        model.session().decode("a")
    for kw, name in [({"threads": "4"}, "threads"), ({"prefill_chunk": 1.5}, "prefill_chunk"),
                     ({"max_context": "1k"}, "max_context"), ({"backend": 1}, "backend")]:
        with pytest.raises(lily.ConfigError) as e:
            lily.Model.load(**kw)
        assert name in str(e.value) and "\n" not in str(e.value)


def test_model_constructor_points_to_load():
    with pytest.raises(TypeError, match=r"Model\.load"):
        lily.Model("some/path")


# -- mlx-lm habits ------------------------------------------------------------------------------------


def test_mlx_lm_style_functions(model, capsys):
    from lily import generate, load, stream_generate

    m, tok = load()
    assert isinstance(m, lily.Model) and tok is m.tokenizer
    ref = m.generate("The json module", max_tokens=12, temperature=0)
    assert generate(m, tok, "The json module", max_tokens=12, temperature=0) == ref.text
    assert generate(m, tok, prompt=tok.encode("The json module"), max_tokens=12, temperature=0) == ref.text
    chunks = list(stream_generate(m, tok, "The json module", max_tokens=12, temperature=0))
    assert "".join(c.text for c in chunks) == ref.text and chunks[-1].finish_reason == ref.finish_reason
    capsys.readouterr()
    generate(m, tok, "The json module", verbose=True, max_tokens=12, temperature=0)
    out = capsys.readouterr().out
    assert out.startswith(ref.text) and "tokens-per-sec" in out
    with pytest.raises(lily.RequestError, match="sampler"):
        generate(m, tok, "x", sampler=lambda x: x)
    with pytest.raises(lily.RequestError, match="tokenizer"):
        generate(m, object(), "x")


def test_a_stream_that_cannot_start_gives_its_slot_back(serial, monkeypatch):
    """A generation whose stream fails to start (here its detokenizer) frees the model's one slot:
    the next generate runs at once instead of waiting for a slot nobody holds."""
    def broken(**_kw):
        raise RuntimeError("detokenizer broke")

    with monkeypatch.context() as m:
        m.setattr(serial.tokenizer, "detokenizer", broken)
        with pytest.raises(RuntimeError, match="detokenizer broke"):
            serial.generate("Errors", max_tokens=2, temperature=0)
    done = []
    t = threading.Thread(target=lambda: done.append(serial.generate("Errors", max_tokens=2, temperature=0)))
    t.start()
    t.join(timeout=30)
    assert done, "the next generate still waited for the slot of the stream that never started"
