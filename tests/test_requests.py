"""Request features of issue 20: no silent ignores, logit_bias, stop token ids, structured output.

References: the OpenAI Python client's own request types (which fields the API has) and OpenAI's
documented errors ("Unrecognized request argument supplied"); NumPy for the biased distribution
(log-softmax of logits + bias, argmax of teacher-forced logits + bias); jsonschema and ``re``
for structured output. The server runs in process (its real Starlette app through ASGI).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from openai.types import chat as chat_types
from openai.types import completion_create_params as legacy_params
from openai.types.chat import completion_create_params as chat_params
from scipy import stats

import lily
from lily import _core
from lily.generation import GenerationStats, token_loop
from lily.server import MESSAGE_KEYS, REQUEST_FIELDS, Server, build_app

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
from asgi import request  # noqa: E402

pytest.importorskip("llguidance", reason="structured output needs the structured extra (scripts/test.sh installs it)")

MODEL = "lily-demo"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model():
    return lily.Model.load()


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def app(model):
    server = Server(model, model_id=MODEL, max_queue=4)
    yield build_app(server)
    server.scheduler.shutdown()


def _post(loop, app, path, body):
    status, resp = loop.run_until_complete(request(app, "POST", path, json.dumps(body).encode(), client_stays=True))
    return status, json.loads(resp)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


# -- no silent ignores --------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint,params", [("chat", chat_params.CompletionCreateParamsBase),
                                             ("completions", legacy_params.CompletionCreateParamsBase)])
def test_every_openai_field_is_classified(endpoint, params):
    """Each field of OpenAI's request type (from the official client) is used, accepted as
    metadata or refused by name; none falls through to "unrecognized"."""
    fields = REQUEST_FIELDS[endpoint]
    known = fields["used"] | fields["metadata"] | set(fields["unsupported"])
    assert set(params.__annotations__) - {"stream"} <= known
    assert not fields["extension"] & set(params.__annotations__)  # extensions are lily's own


@pytest.mark.parametrize("path,base", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "Hi"})])
@pytest.mark.parametrize("field", ["foo_bar", "guided_json", "ignore_eos", "top_a"])
def test_unrecognized_field_is_400(loop, app, path, base, field):
    status, resp = _post(loop, app, path, {**base, "max_tokens": 1, field: 1})
    assert status == 400
    assert resp["error"]["message"] == f"Unrecognized request argument supplied: {field}"  # OpenAI's wording
    assert resp["error"]["param"] == field


def test_unrecognized_nested_fields_are_400(loop, app):
    for extra, name in ((dict(stream=True, stream_options={"include_usage": True, "chunk_size": 4}),
                         "stream_options.chunk_size"),
                        (dict(response_format={"type": "json_object", "schema": {}}), "response_format.schema"),
                        (dict(response_format={"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "object"}, "extra": 1}}), "response_format.json_schema.extra")):
        status, resp = _post(loop, app, CHAT, {"messages": HI, "max_tokens": 1, **extra})
        assert status == 400, resp
        assert resp["error"]["message"] == f"Unrecognized request argument supplied: {name}"


MESSAGE_TYPES = {"system": chat_types.ChatCompletionSystemMessageParam,
                 "developer": chat_types.ChatCompletionDeveloperMessageParam,
                 "user": chat_types.ChatCompletionUserMessageParam,
                 "assistant": chat_types.ChatCompletionAssistantMessageParam,
                 "tool": chat_types.ChatCompletionToolMessageParam}


@pytest.mark.parametrize("role", list(MESSAGE_TYPES))
def test_message_keys_are_openais(role):
    """Each role takes exactly the keys of OpenAI's message type (the official client's), the
    assistant lily's reasoning_content too."""
    extension = {"reasoning_content"} if role == "assistant" else set()
    assert MESSAGE_KEYS[role] == set(MESSAGE_TYPES[role].__annotations__) | extension


@pytest.mark.parametrize("messages,path", [
    ([{"role": "user", "content": "Hi", "foo": 1}], "messages[0].foo"),
    ([{"role": "system", "content": "Be brief"}, *HI, {"role": "assistant", "content": "Hello", "thinking": "x"}],
     "messages[2].thinking"),
    ([{"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}], "messages[0].name"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}], "messages[0].content[0].cache_control"),
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": 0}]}],
     "messages[1].tool_calls[0].index"),
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "strict": True}}]}],
     "messages[1].tool_calls[0].function.strict"),
])
def test_unrecognized_message_keys_are_400_by_path(loop, app, messages, path):
    status, resp = _post(loop, app, CHAT, {"messages": messages, "max_tokens": 1})
    assert status == 400, resp
    assert resp["error"] == {"message": f"Unrecognized request argument supplied: {path}", "param": path,
                             "type": "invalid_request_error", "code": "unrecognized_argument"}


@pytest.mark.parametrize("message,path", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
     "messages[1].content[0]"),
    ({"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "input_audio", "input_audio": {
        "data": "", "format": "wav"}}]}, "messages[1].content[1]"),
    ({"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}, "messages[1].content[0]"),
    ({"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, "messages[1].audio"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
     "messages[1].function_call"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "custom", "custom": {
        "name": "f", "input": "x"}}]}, "messages[1].tool_calls[0].type"),
])
def test_openai_message_features_lily_lacks_are_refused_by_name(loop, app, message, path):
    status, resp = _post(loop, app, CHAT, {"messages": [*HI, message], "max_tokens": 1})
    assert status == 400, resp
    assert resp["error"]["code"] == "unsupported_parameter" and resp["error"]["param"] == path
    assert resp["error"]["message"].startswith(f"Unsupported parameter: '{path}' is not supported by lily (")


@pytest.mark.parametrize("message,param", [
    ({"role": {"a": 1}, "content": "be brief"}, "messages[0].role"),
    ({"role": ["user"], "content": "be brief"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": {"a": 1}, "text": "hi"}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": [{"type": ["text"], "text": "hi"}]}, "messages[0].content[0].type"),
])
def test_unhashable_role_or_part_type_is_400(loop, app, message, param):
    """Found by the server fuzz target (seed regress_message_role_object): an object as a role
    was looked up in the table of message keys, a TypeError and a 500."""
    status, resp = _post(loop, app, CHAT, {"messages": [message], "max_tokens": 1})
    assert status == 400 and resp["error"]["param"] == param, resp


def test_openai_message_keys_lily_takes(loop, app):
    """Null audio / function_call, names, a text part's prompt_cache_breakpoint (a cache hint) are
    accepted; an earlier refusal (field or part) is what the assistant said."""
    said = [{"role": "user", "content": "Hi", "name": "ann"}, {"role": "assistant", "content": "No."},
            {"role": "user", "content": "Why?"}]
    status, want = _post(loop, app, CHAT, {"messages": said, "max_tokens": 1})
    assert status == 200, want
    for refused in ({"role": "assistant", "content": None, "refusal": "No.", "audio": None, "function_call": None,
                     "name": "bot"},
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "No."}], "refusal": None}):
        messages = [{"role": "user", "content": [{"type": "text", "text": "Hi", "prompt_cache_breakpoint": {
            "mode": "explicit"}}], "name": "ann"}, refused, said[2]]
        status, resp = _post(loop, app, CHAT, {"messages": messages, "max_tokens": 1})
        assert status == 200, resp
        assert resp["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    status, resp = _post(loop, app, CHAT, {"messages": [{"role": "user", "content": [
        {"type": "refusal", "refusal": "x"}]}], "max_tokens": 1})  # a refusal part is the assistant's only
    assert status == 400 and resp["error"]["param"] == "messages[0].content[0].type", resp


UNSUPPORTED = [
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "parallel_tool_calls", False),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "verbosity", "low"),
    (CHAT, "web_search_options", {}),
    (CHAT, "moderation", {"model": "omni-moderation-latest"}),
    (CHAT, "functions", [{"name": "f", "parameters": {"type": "object"}}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "n", 17),
    (COMPLETIONS, "echo", True),
    (COMPLETIONS, "suffix", "x"),
    (COMPLETIONS, "best_of", 2),
    (COMPLETIONS, "n", 0),
]


@pytest.mark.parametrize("path,field,value", UNSUPPORTED, ids=[f"{'chat' if p == CHAT else 'legacy'}-{f}" for p, f, _ in UNSUPPORTED])
def test_unsupported_openai_field_is_400_naming_it(loop, app, path, field, value):
    base = {"messages": HI} if path == CHAT else {"prompt": "Hi"}
    status, resp = _post(loop, app, path, {**base, "max_tokens": 1, field: value})
    assert status == 400, resp
    assert f"'{field}'" in resp["error"]["message"] and resp["error"]["param"] == field
    assert status == 400 and resp["error"]["code"] in ("unsupported_parameter", "invalid_value")


WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["C", "F"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23},
                             "maxItems": 3}},
    "required": ["city", "unit", "days", "hours"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "strict": True, "parameters": {
    "type": "object", "properties": {"at": {"type": "object", "properties": {
        "h": {"type": "integer", "minimum": 0, "maximum": 23}, "m": {"type": "integer", "minimum": 0, "maximum": 59}},
        "required": ["h", "m"], "additionalProperties": False}, "loud": {"type": "boolean"}},
    "required": ["at", "loud"], "additionalProperties": False}}}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strict_tool_calls_follow_their_schemas(loop, app, seed):
    """tool_choice "required" / named with strict tools: every call's arguments (parsed back by
    the server into OpenAI's JSON string) validate against the tool's parameters (jsonschema)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ALARM)}
    # A named function is called once. "required" allows more calls, which a small model may keep
    # writing until max_tokens: the stop string ends it after the first (parsed as if closed).
    for choice, stop in (({"type": "function", "function": {"name": "set_alarm"}}, None),
                         ("required", "</tool_call>")):
        status, resp = _post(loop, app, CHAT, {
            "messages": [{"role": "user", "content": "Weather in Paris, and wake me at 7."}], "max_tokens": 300,
            "temperature": 1.0, "seed": seed, "tools": [WEATHER, ALARM], "tool_choice": choice, "stop": stop})
        assert status == 200, resp
        c = resp["choices"][0]
        assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1, c
        call = c["message"]["tool_calls"][0]["function"]
        if isinstance(choice, dict):
            assert call["name"] == "set_alarm"
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


@pytest.mark.parametrize("seed", [0, 1])
def test_strict_tools_under_auto_are_constrained(loop, app, model, seed):
    """tool_choice "auto" with strict tools: the answer is free text, or a call whose arguments
    follow the schema (jsonschema). A logit bias towards <tool_call> makes the model call; the
    grammar then writes arguments the schema allows, where the unconstrained model writes none."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ALARM)}
    call_open = model.tokenizer.token_to_id("<tool_call>")
    body = {"messages": [{"role": "user", "content": "Weather in Paris, and wake me at 7."}], "max_tokens": 300,
            "temperature": 1.0, "seed": seed, "tools": [WEATHER, ALARM], "stop": "</tool_call>",
            "logit_bias": {str(call_open): 100}}
    status, resp = _post(loop, app, CHAT, body)
    assert status == 200, resp
    c = resp["choices"][0]
    assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1, c
    call = c["message"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    free = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in (WEATHER, ALARM)]
    status, resp = _post(loop, app, CHAT, {**body, "tools": free})  # the same request, nothing enforced
    assert status == 200, resp
    assert not resp["choices"][0]["message"].get("tool_calls"), resp  # the demo model writes no valid call
    # Without the bias: text (never an unconstrained call), or calls that follow their schemas.
    del body["logit_bias"], body["stop"]
    status, resp = _post(loop, app, CHAT, {**body, "max_tokens": 40})
    assert status == 200, resp
    message = resp["choices"][0]["message"]
    assert "<tool_call>" not in (message["content"] or "")
    for tc in message.get("tool_calls") or ():
        jsonschema.validate(json.loads(tc["function"]["arguments"]), schemas[tc["function"]["name"]])


def test_strict_tools_under_auto_grammar(model):
    """The turn grammar under "auto", run by llguidance on token ids: free text (EOS allowed),
    text then a call that follows the schema; a call with arguments the schema refuses, and text
    writing the call's opening in pieces, are held to the call format."""
    import llguidance

    from lily.structured import _index, tool_call_grammar

    tok = model.tokenizer
    grammar = tool_call_grammar(tok, [WEATHER], strict=[True], tool_choice="auto")
    call_open, call_close = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")

    def accepts(ids) -> bool:
        matcher = llguidance.LLMatcher(_index(tok, model.eos_token_ids), grammar.text, log_level=0)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    args = "<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nC\n</parameter>\n"
    call = [call_open, *tok.encode("\n<function=get_weather>\n" + args + "<parameter=days>\n3\n</parameter>\n"
                                   "<parameter=hours>\n[7, 8]\n</parameter>\n</function>\n"), call_close]
    assert accepts(tok.encode("Paris is sunny."))
    assert accepts([*tok.encode("Let me check.\n\n"), *call])
    assert accepts(call) and not accepts(call[:-1])
    bad = [call_open, *tok.encode("\n<function=get_weather>\n" + args + "<parameter=days>\n9\n</parameter>\n")]
    assert not accepts(bad)  # days > 7
    assert not accepts(tok.encode("x <tool_call>\nhello"))  # an opening written as text is still a call


def test_strict_tools_refused_where_not_enforced(loop, app):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    status, resp = _post(loop, app, CHAT, {"messages": HI, "max_tokens": 1, "tools": [WEATHER],
                                           "response_format": rf})  # "auto": one grammar, the answer's or the calls'
    assert status == 400 and resp["error"]["param"] == "response_format", resp
    bad = json.loads(json.dumps(WEATHER))
    bad["function"]["parameters"]["properties"]["hours"]["uniqueItems"] = True
    status, resp = _post(loop, app, CHAT, {"messages": HI, "max_tokens": 1, "tools": [bad], "tool_choice": "required"})
    assert status == 400 and "uniqueItems" in resp["error"]["message"] and resp["error"]["param"] == "tools", resp


def test_metadata_fields_are_accepted_and_change_nothing(loop, app, model):
    metadata = dict(user="u1", metadata={"k": "v"}, store=False, service_tier="auto", safety_identifier="s",
                    prompt_cache_key="p", prompt_cache_retention="24h", prompt_cache_options={"ttl": "30m"},
                    prediction={"type": "content", "content": "Hello"}, parallel_tool_calls=True,
                    modalities=["text"], stream_options={"include_usage": True, "include_obfuscation": False})
    status, resp = _post(loop, app, CHAT, {"messages": HI, "max_tokens": 8, "temperature": 0, **metadata})
    assert status == 200, resp
    assert resp["choices"][0]["message"]["content"] == model.generate(HI, max_tokens=8, temperature=0).content
    status, resp = _post(loop, app, COMPLETIONS, {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "user": "u"})
    assert status == 200, resp


def test_python_generate_refuses_unknown_arguments(model):
    with pytest.raises(TypeError, match="response_format"):
        model.generate("Hi", response_format={"type": "json_object"})  # type: ignore[call-overload]
    with pytest.raises(lily.RequestError, match="guided_json"):
        model.chat().send("Hi", guided_json={})


# -- logit_bias ---------------------------------------------------------------------------------


def test_sampler_logprobs_are_the_biased_distribution():
    """log p = log_softmax(logits + bias) (NumPy), top logprobs in its order; greedy = its argmax."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    bias = {3: 4.0, 17: -100.0, int(np.argmax(logits)): -2.5, 999: 7.25}
    ref = logits.astype(np.float64)
    for t, b in bias.items():
        ref[t] += b
    ref = _log_softmax(ref)
    s = _core.Sampler(_core.SamplingParams(temperature=0.0, top_logprobs=5))
    s.set_logit_bias(list(bias.items()))
    tok, lp, top = s.sample(logits)
    assert tok == int(np.argmax(ref))
    assert lp == pytest.approx(ref[tok], abs=1e-5)
    assert [t for t, _ in top] == list(np.argsort(-ref, kind="stable")[:5])
    np.testing.assert_allclose([p for _, p in top], np.sort(ref)[::-1][:5], atol=1e-5)


def test_sampler_bias_comes_before_the_penalties():
    """The documented order (llama.cpp's chain): l + bias, then the repetition penalty (CTRL:
    divide positive, multiply negative) and presence/frequency on the biased value (NumPy)."""
    logits = np.array([1.0, -0.5, 2.0, 0.25, -1.5, 0.75], dtype=np.float32)
    bias = [(1, 1.5), (2, -3.0), (4, 0.5)]  # token 1: -0.5 -> +1.0 (now divided), 2: 2.0 -> -1.0 (multiplied)
    window = np.array([1, 2, 2, 4], dtype=np.int32)
    ref = logits.astype(np.float64)
    for t, b in bias:
        ref[t] += b
    for t, count in zip(*np.unique(window, return_counts=True), strict=True):
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
        ref[t] -= 0.2 + 0.1 * count
    s = _core.Sampler(_core.SamplingParams(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1,
                                           top_logprobs=6))
    s.set_logit_bias(bias)
    _, _, top = s.sample(logits, window)
    got = dict(top)
    np.testing.assert_allclose([got[t] for t in range(6)], _log_softmax(ref), atol=1e-5)


def test_sampler_draws_follow_the_biased_distribution():
    """Draws at temperature 1 over 8 tokens: a chi-square test against softmax(logits + bias)."""
    logits = np.array([0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 0.0, 1.5], dtype=np.float32)
    bias = [(0, 2.0), (4, -3.0), (5, 3.0)]
    p = logits.astype(np.float64)
    for t, b in bias:
        p[t] += b
    p = np.exp(_log_softmax(p))
    s = _core.Sampler(_core.SamplingParams(temperature=1.0, seed=7))
    s.set_logit_bias(bias)
    n = 20000
    counts = np.bincount([s.sample(logits)[0] for _ in range(n)], minlength=8)
    assert stats.chisquare(counts, p * n).pvalue > 1e-3


def test_sampler_refuses_bad_bias():
    s = _core.Sampler(_core.SamplingParams())
    with pytest.raises(lily.RequestError, match="finite"):
        s.set_logit_bias([(1, float("inf"))])
    s.set_logit_bias([(50, 1.0)])
    with pytest.raises(lily.RequestError, match="outside the vocabulary"):
        s.sample(np.zeros(10, dtype=np.float32))


def test_generate_with_logit_bias_is_the_biased_greedy_path(model):
    """Each greedy token = argmax(teacher-forced logits + bias), NumPy on model.logits."""
    prompt = model.tokenizer.encode("The quick brown fox")
    plain = model.generate(prompt, max_tokens=6, temperature=0, repetition_penalty=1).tokens
    first = model.logits(prompt)[-1]
    runner_up = int(np.argsort(-first, kind="stable")[1])
    bias = {runner_up: float(first.max() - first[runner_up]) + 0.5, plain[1]: -100.0}
    # repetition_penalty=1: the demo's generation_config penalizes repeats, this is plain argmax
    out = model.generate(prompt, max_tokens=6, temperature=0, logit_bias=bias, repetition_penalty=1).tokens
    assert out[0] == runner_up != plain[0]
    context = list(prompt)
    for tok in out:
        row = model.logits(context)[-1].astype(np.float64)
        for t, b in bias.items():
            row[t] += b
        assert tok == int(np.argmax(row))
        context.append(tok)


def test_logit_bias_keeps_requests_off_the_device_loop():
    """A GPU backend's device loop has no bias: such a request samples every token on the host."""
    logits = np.zeros(16, dtype=np.float32)

    def no_device_loop(*_):
        raise AssertionError("a biased request took the device loop")

    chunks = token_loop(lambda ids: logits, lambda tok: logits, np.array([1], dtype=np.int32), chunk=8,
                        params=_core.SamplingParams(), max_tokens=4, eos_ids=(), detokenizer=None, stop=None,
                        want_logprobs=False, history=(), stats=GenerationStats(), device_loop=no_device_loop,
                        logit_bias=[(9, 1.0)])
    assert [c.token for c in chunks] == [9, 9, 9, 9]


def test_generate_refuses_bad_logit_bias(model):
    for bias, match in (({-1: 1.0}, "outside the vocabulary"), ({10**9: 1.0}, "outside the vocabulary"),
                        ({"5": 1.0}, "token id"), ({5: float("nan")}, "finite"), ([(5, 1.0)], "dict")):
        with pytest.raises(lily.RequestError, match=match):
            model.generate("Hi", max_tokens=1, logit_bias=bias)


def test_server_logit_bias(loop, app, model):
    ids = model.tokenizer.encode("Once upon a time")
    want = model.generate(ids, max_tokens=5, temperature=0, logit_bias={77: 30.0, 12: -100.0}).text
    status, resp = _post(loop, app, COMPLETIONS, {"prompt": ids, "max_tokens": 5, "temperature": 0,
                                                   "logit_bias": {"77": 30, "12": -100}})
    assert status == 200, resp
    assert resp["choices"][0]["text"] == want
    for bad in ({"x": 1}, {"5": 101}, {"5": True}, {str(model.tokenizer.vocab_size): 1}, [1], {"\u00b2": 1},
                {"9" * 5000: 1}, {"-1": 1}):
        status, resp = _post(loop, app, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, "logit_bias": bad})
        assert status == 400 and resp["error"]["param"] == "logit_bias", resp


# -- stop token ids and token strings with logprobs ----------------------------------------------


def test_stop_token_ids_end_generation_like_eos(model):
    prompt = model.tokenizer.encode("The quick brown fox")
    plain = model.generate(prompt, max_tokens=8, temperature=0)
    stop_at = next(i for i, t in enumerate(plain.tokens) if i >= 2 and t not in plain.tokens[:i])
    r = model.generate(prompt, max_tokens=8, temperature=0, stop_token_ids=[plain.tokens[stop_at]])
    assert r.tokens == plain.tokens[:stop_at] and r.finish_reason == "stop"
    assert r.text == model.tokenizer.decode(plain.tokens[:stop_at], skip_special_tokens=True)
    with pytest.raises(lily.RequestError, match="stop token id"):
        model.generate(prompt, max_tokens=1, stop_token_ids=[-3])


def test_server_stop_token_ids(loop, app, model):
    ids = model.tokenizer.encode("The quick brown fox")
    plain = model.generate(ids, max_tokens=8, temperature=0)
    stop_at = next(i for i, t in enumerate(plain.tokens) if i >= 2 and t not in plain.tokens[:i])
    status, resp = _post(loop, app, COMPLETIONS, {"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                   "stop_token_ids": [plain.tokens[stop_at]]})
    assert status == 200, resp
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert resp["choices"][0]["text"] == model.tokenizer.decode(plain.tokens[:stop_at], skip_special_tokens=True)
    status, resp = _post(loop, app, COMPLETIONS, {"prompt": ids, "max_tokens": 1, "stop_token_ids": ["7"]})
    assert status == 400 and resp["error"]["param"] == "stop_token_ids"


def test_python_logprobs_carry_token_strings(model):
    r = model.generate("Hello", max_tokens=4, temperature=0, logprobs=3)
    for entry, tok in zip(r.logprobs, r.tokens, strict=True):
        assert entry["token"] == tok and entry["text"] == model.tokenizer.decode([tok])
        assert all(alt["text"] == model.tokenizer.decode([alt["token"]]) for alt in entry["top_logprobs"])


# -- structured output -----------------------------------------------------------------------------

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["cat", "dog", "parrot"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "vaccinated": {"type": "boolean"},
                           "visits": {"type": "array", "items": {"type": "object", "properties": {
                               "year": {"type": "integer", "minimum": 2000, "maximum": 2030},
                               "ok": {"type": "boolean"}}, "required": ["year", "ok"],
                               "additionalProperties": False}, "maxItems": 2}},
            "required": ["name", "vaccinated", "visits"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1, 2, None])
def test_json_schema_output_validates(model, seed):
    """Nested objects, enums, arrays: the output parses and validates (jsonschema), whether the
    model samples (seeds 0-2, temperature 1) or is greedy (None)."""
    kw = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
    r = model.generate([{"role": "user", "content": "A pet, as JSON."}], json_schema=PET, max_tokens=300, **kw)
    assert r.finish_reason == "stop", r.text
    jsonschema.validate(json.loads(r.content), PET)


@pytest.mark.parametrize("pattern", [r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no|maybe)", r"[a-z]{2,5}@[a-z]{3}\.(com|org)"])
def test_regex_output_matches(model, pattern):
    for seed in range(3):
        r = model.generate("Answer:", regex=pattern, max_tokens=40, temperature=1.0, seed=seed)
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


def test_grammar_output(model):
    grammar = 'start: "[" item ("," item)* "]"\nitem: "x" | "y" | "z"'
    r = model.generate("List:", grammar=grammar, max_tokens=30, temperature=1.0, seed=4)
    assert re.fullmatch(r"\[[xyz](,[xyz])*\]", r.text), r.text


def test_structured_logprobs_are_of_the_masked_distribution(model):
    """Alternatives shown are tokens the grammar allows (the sampler's mask: masked tokens are not
    alternatives), and the chosen tokens' probabilities sum to at most 1."""
    r = model.generate("Answer:", regex=r"(yes|no)", max_tokens=5, temperature=0, logprobs=5)
    assert r.text in ("yes", "no")
    first = r.logprobs[0]
    assert all(("yes".startswith(a["text"]) or "no".startswith(a["text"])) and a["text"]
               for a in first["top_logprobs"])
    assert sum(np.exp(a["logprob"]) for a in first["top_logprobs"]) <= 1 + 1e-5


def test_rejected_schemas_are_value_errors_naming_the_problem(model):
    with pytest.raises(ValueError, match="uniqueItems"):
        model.generate("x", json_schema={"type": "array", "uniqueItems": True}, max_tokens=1)
    with pytest.raises(ValueError, match="regex"):
        model.generate("x", regex="([", max_tokens=1)
    with pytest.raises(ValueError, match="at most one of"):
        model.generate("x", regex="a", grammar='start: "a"', max_tokens=1)
    with pytest.raises(ValueError, match="json_schema must be a dict"):
        model.generate("x", json_schema="{}", max_tokens=1)  # type: ignore[arg-type]


def test_server_response_format_json_schema(loop, app):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": "A pet"}], "max_tokens": 300, "temperature": 0.9,
                "seed": 11, "response_format": rf, "stream": stream}
        status, resp = loop.run_until_complete(
            request(app, "POST", CHAT, json.dumps(body).encode(), client_stays=True))
        assert status == 200, resp
        if stream:
            events = [json.loads(line[5:]) for line in resp.decode().splitlines()
                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        else:
            content = json.loads(resp)["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), PET)


def test_server_response_format_json_object(loop, app):
    status, resp = _post(loop, app, CHAT, {"messages": HI, "max_tokens": 200, "temperature": 0,
                                           "response_format": {"type": "json_object"}})
    assert status == 200, resp
    content = resp["choices"][0]["message"]["content"]
    if resp["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert content.startswith("{")


@pytest.mark.parametrize("rf,match", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}}},
     "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {"type": "string"}}}}, "not"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strng"}}}, "not a valid JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "must be a JSON Schema object"),
    ({"type": "grammar", "grammar": "x"}, "must be"),
])
def test_server_rejected_schema_is_400(loop, app, rf, match):
    status, resp = _post(loop, app, CHAT, {"messages": HI, "max_tokens": 5, "response_format": rf})
    assert status == 400, resp
    assert match in resp["error"]["message"] and resp["error"]["param"].startswith("response_format")


def test_chat_turns_take_the_same_rules(model):
    """Chat.send takes logit_bias, stop_token_ids and structured output per turn, as generate does."""
    chat = model.chat()
    r = chat.send("A pet, as JSON.", json_schema=PET, max_tokens=300, temperature=0)
    jsonschema.validate(json.loads(r.content), PET)
    assert chat.messages[-1]["content"] == r.content
    r = chat.send("Yes or no?", regex=r"(yes|no)", max_tokens=5, temperature=1.0, seed=1)
    assert r.content in ("yes", "no")
    with pytest.raises(lily.RequestError, match="logit_bias"):
        chat.send("Hi", logit_bias={-1: 2.0})
    assert chat.messages[-1]["content"] == r.content  # the refused turn left nothing behind


# -- n > 1 ---------------------------------------------------------------------------------------


def _sse_events(raw: bytes) -> list[dict]:
    return [json.loads(line[5:]) for line in raw.decode().splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def test_n_choices_are_independent_generations_from_one_prefill(loop, app, model, monkeypatch):
    """Choice i = the Python API's generation with seed + i from a fresh state; the prompt is
    prefilled once (later choices prefill only its last token, for its logits)."""
    messages = [{"role": "user", "content": "Tell me a story about a fox and a crow."}]
    want = [model.generate(messages, max_tokens=12, temperature=1.0, seed=5 + i) for i in range(3)]
    prefilled = []
    real_prefill = lily.Session.prefill
    monkeypatch.setattr(lily.Session, "prefill", lambda self, chunk: prefilled.append(len(chunk))
                        or real_prefill(self, chunk))
    app.state.server.scheduler.cache.clear()
    status, resp = _post(loop, app, CHAT, {"messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 5,
                                           "n": 3})
    assert status == 200, resp
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in resp["choices"]] == [w.content for w in want]
    assert len({w.content for w in want}) > 1  # the seeds do differ
    assert sum(prefilled) == want[0].prompt_tokens + 2
    assert resp["usage"]["prompt_tokens"] == want[0].prompt_tokens
    assert resp["usage"]["completion_tokens"] == sum(w.completion_tokens for w in want)


def test_n_choices_stream_with_their_index(loop, app, model):
    """The server's SSE for n = 2: chunks carry their choice's index; each choice's deltas
    concatenate to the non-streamed choice and to the Python API's streamed n."""
    body = {"messages": HI, "max_tokens": 10, "temperature": 1.0, "seed": 9, "n": 2,
            "stream_options": {"include_usage": True}}
    status, resp = _post(loop, app, CHAT, body)
    assert status == 200, resp
    status, raw = loop.run_until_complete(request(app, "POST", CHAT, json.dumps({**body, "stream": True}).encode(),
                                                  client_stays=True))
    assert status == 200
    events = _sse_events(raw)
    text = {0: "", 1: ""}
    finishes = {}
    for e in events:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    assert [text[i] for i in (0, 1)] == [c["message"]["content"] for c in resp["choices"]]
    assert finishes == {i: c["finish_reason"] for i, c in enumerate(resp["choices"])}
    python = model.generate(HI, n=2, max_tokens=10, temperature=1.0, seed=9, stream=True)
    assert [text[i] for i in (0, 1)] == [t for _i, t in sorted(_by_choice(python)[0].items())]
    usage = events[-1]["usage"]
    assert usage.pop("prompt_tokens_details")["cached_tokens"] > 0  # the same prompt again: reused
    assert usage == {k: v for k, v in resp["usage"].items() if k != "prompt_tokens_details"}


def test_n_choices_for_completions_and_structured_output(loop, app, model):
    status, resp = _post(loop, app, COMPLETIONS, {"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "n": 2})
    assert status == 200, resp
    greedy = model.generate("Once upon", max_tokens=6, temperature=0).text
    assert [c["text"] for c in resp["choices"]] == [greedy, greedy]  # greedy: the same twice, as OpenAI's
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    status, resp = _post(loop, app, CHAT, {"messages": [{"role": "user", "content": "A pet"}], "max_tokens": 300,
                                           "temperature": 1.0, "seed": 3, "n": 2, "response_format": rf})
    assert status == 200, resp
    for c in resp["choices"]:  # each choice starts the grammar afresh
        jsonschema.validate(json.loads(c["message"]["content"]), PET)


def test_python_n_choices_equal_solo_runs_from_one_prefill(model, monkeypatch):
    """Model.generate(n=3): a list of results, choice i the solo run with seed + i (the server's
    rule), greedy choices identical, and the prompt prefilled once (later choices only its last
    token, counted as cached)."""
    from lily.model import Session

    messages = [{"role": "user", "content": "Tell me a story about a fox and a crow."}]
    solo = [model.generate(messages, max_tokens=12, temperature=1.0, seed=5 + i, logprobs=2) for i in range(3)]
    prefilled = []
    real_prefill = Session.prefill
    monkeypatch.setattr(Session, "prefill", lambda self, ids, all_logits=False: prefilled.append(len(ids))
                        or real_prefill(self, ids, all_logits))
    choices = model.generate(messages, n=3, max_tokens=12, temperature=1.0, seed=5, logprobs=2)
    assert isinstance(choices, list) and len(choices) == 3
    assert [c.tokens for c in choices] == [s.tokens for s in solo]
    assert [c.content for c in choices] == [s.content for s in solo]
    assert [c.logprobs for c in choices] == [s.logprobs for s in solo]
    assert len({s.text for s in solo}) > 1  # the seeds do differ
    prompt = solo[0].prompt_tokens
    assert sum(prefilled) == prompt + 2
    assert [c.cached_tokens for c in choices] == [0, prompt - 1, prompt - 1]
    monkeypatch.undo()

    greedy = model.generate("Once upon", n=2, max_tokens=6, temperature=0)
    assert greedy[0].tokens == greedy[1].tokens == model.generate("Once upon", max_tokens=6, temperature=0).tokens
    one = model.generate("Once upon", n=1, max_tokens=6, temperature=0)  # n given: a list, even of one
    assert isinstance(one, list) and one[0].tokens == greedy[0].tokens


def test_python_n_choices_with_a_prompt_cache_and_structured_output(model):
    cache = model.session()
    cache.prefill(model.encode_prompt("Once upon a time"))
    prompt = model.encode_prompt("Once upon a time there was")
    solo = [model.generate(prompt, max_tokens=8, temperature=1.0, seed=11 + i) for i in range(2)]
    choices = model.generate(prompt, n=2, max_tokens=8, temperature=1.0, seed=11, prompt_cache=cache)
    assert [c.tokens for c in choices] == [s.tokens for s in solo]
    assert cache.position == len(model.encode_prompt("Once upon a time"))  # the cache is left as it was
    pets = model.generate([{"role": "user", "content": "A pet"}], n=2, max_tokens=300, temperature=1.0, seed=3,
                          json_schema=PET, enable_thinking=False)
    for c in pets:  # each choice starts the grammar afresh
        jsonschema.validate(json.loads(c.text), PET)


@pytest.mark.parametrize("n,stream,message", [(0, False, "n must be at least 1"), (2.0, False, "n must be an integer"),
                                              (True, False, "n must be an integer"),
                                              (0, True, "n must be at least 1")])
def test_python_n_refusals(model, n, stream, message):
    with pytest.raises(lily.RequestError, match=message):
        model.generate("Hi", n=n, stream=stream, max_tokens=1)
    assert model.generate("Hi", max_tokens=1).finish_reason == "length"  # the model is free again


def _by_choice(stream) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str]]:
    """A streamed n's text, tokens and finish reason per choice index."""
    text: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for c in stream:
        text[c.index] = text.get(c.index, "") + c.text
        tokens.setdefault(c.index, []).extend([] if c.token is None else [c.token])
        if c.finish_reason is not None:
            assert c.index not in finish  # one last chunk per choice
            finish[c.index] = c.finish_reason
    return text, tokens, finish


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5)])
def test_python_n_choices_stream_with_their_index(model, sampling):
    """generate(n=3, stream=True): chunks tagged with their choice (OpenAI's choices[].index), each
    choice's concatenated text and tokens those of the non-streamed n=3 with the same seed, its
    results the same results; a chat prompt's content split out as for the list."""
    messages = [{"role": "user", "content": "Tell me a story about a fox and a crow."}]
    want = model.generate(messages, n=3, max_tokens=12, logprobs=2, **sampling)
    stream = model.generate(messages, n=3, max_tokens=12, logprobs=2, stream=True, **sampling)
    assert isinstance(stream, lily.batching.BatchStream)
    text, tokens, finish = _by_choice(stream)
    assert [text[i] for i in range(3)] == [w.text for w in want]
    assert [tokens[i] for i in range(3)] == [w.tokens for w in want]
    assert finish == {i: w.finish_reason for i, w in enumerate(want)}
    for got, w in zip(stream.results, want, strict=True):
        assert (got.text, got.content, got.logprobs, got.cached_tokens) == (w.text, w.content, w.logprobs,
                                                                           w.cached_tokens)
    if sampling["temperature"]:
        assert len({w.text for w in want}) > 1  # the seeds do differ
    assert model._generation.held == 0  # the stream's end freed the model
    one = model.generate(messages, n=1, max_tokens=12, stream=True, **sampling)  # n given: a BatchStream, even of one
    assert _by_choice(one)[0] == {0: want[0].text}


def test_python_n_stream_closed_or_dropped_frees_the_model():
    """A streamed n stopped early: close() (and leaving a with block) ends the running choice
    ("cancelled", its text so far kept), starts no later one and returns with the model free;
    a stream dropped after break is garbage-collected and frees it too. On a model of one
    generation slot, a later generate would wait forever otherwise."""
    import gc
    import time

    model = lily.Model.load(max_batch=1)
    prompt = "Once upon a time"
    with model.generate(prompt, n=3, max_tokens=200, temperature=1.0, seed=1, stream=True) as stream:
        first = next(stream)
    assert first.index == 0
    assert stream.results[0].finish_reason == "cancelled" and stream.results[0].text.startswith(first.text)
    assert stream.results[1:] == [None, None]
    assert model._generation.held == 0
    for _chunk in model.generate(prompt, n=3, max_tokens=200, temperature=1.0, seed=1, stream=True):
        break
    gc.collect()
    deadline = time.monotonic() + 10
    while model._generation.held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model._generation.held == 0
    solo = model.generate(prompt, max_tokens=4, temperature=1.0, seed=2)
    assert solo.finish_reason == "length"


# -- hostile schemas ---------------------------------------------------------------------------------

_KEYWORDS = ["type", "properties", "items", "enum", "const", "required", "additionalProperties", "anyOf", "oneOf",
             "allOf", "not", "minLength", "maxLength", "minimum", "maximum", "pattern", "format", "minItems",
             "maxItems", "uniqueItems", "$ref", "$defs", "prefixItems", "patternProperties", "if", "then"]
_TYPES = ["object", "array", "string", "integer", "number", "boolean", "null"]


def _schemas():
    from hypothesis import strategies as st

    leaf = st.one_of(st.sampled_from(_TYPES), st.integers(-3, 50), st.booleans(), st.text(max_size=6),
                     st.lists(st.sampled_from(_TYPES + ["a", "b"]), max_size=3))
    return st.recursive(leaf, lambda kids: st.one_of(
        st.dictionaries(st.sampled_from(_KEYWORDS + ["a", "b"]), kids, max_size=4),
        st.lists(kids, max_size=3)), max_leaves=12)


@pytest.fixture(scope="module")
def validating_app(model):
    # The hardening tests' server that stops accepted requests before the scheduler.
    from test_server_hardening import ValidatingServer

    server = ValidatingServer(model, model_id=MODEL, max_queue=1)
    yield build_app(server)
    server.scheduler.shutdown()


def test_generated_schemas_never_answer_500(loop, validating_app):
    """Any schema (valid or not for the meta-schema, satisfiable or not, keywords llguidance
    lacks) in response_format or a strict tool is accepted or a 400 naming it, never a 500."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(schema=_schemas())
    def check(schema):
        tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
        for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                      {"tools": [tool], "tool_choice": "required"}):
            status, resp = _post(loop, validating_app, CHAT, {"messages": HI, "max_tokens": 4, **extra})
            assert status in (400, 503), resp
            if status == 400:
                assert resp["error"]["param"].startswith(("response_format", "tools")), resp

    check()


def test_gpu_backend_samples_biased_and_constrained_requests_on_the_host(monkeypatch):
    """On a GPU backend (the Metal kernels run on the CPU: msl-cpu) a plain greedy request takes
    the device loop, a biased or constrained one the host loop, which applies the bias (the
    first token = NumPy's argmax of the prompt's logits + bias) and the mask (re.fullmatch)."""
    from lily.batching import Batcher

    gpu = lily.Model.load(backend="msl-cpu")
    starts = []
    real_row = Batcher.device_row
    monkeypatch.setattr(Batcher, "device_row", lambda self, *a: starts.append(1) or real_row(self, *a))
    prompt = gpu.tokenizer.encode("The quick brown fox")
    # repetition_penalty=1: the demo's default penalty would need the host loop too
    plain = gpu.generate(prompt, max_tokens=4, temperature=0, repetition_penalty=1).tokens
    assert len(starts) == 1  # the device loop runs plain requests
    device_steps = gpu._batcher.stats.device_steps
    assert device_steps > 0
    first = gpu.logits(prompt)[-1].astype(np.float64)
    runner_up = int(np.argsort(-first, kind="stable")[1])
    bias = {runner_up: float(first.max() - first[runner_up]) + 0.5}
    out = gpu.generate(prompt, max_tokens=4, temperature=0, logit_bias=bias, repetition_penalty=1).tokens
    first[runner_up] += bias[runner_up]
    assert out[0] == int(np.argmax(first)) == runner_up != plain[0]
    r = gpu.generate("Phone:", regex=r"\(\d{3}\) \d{3}-\d{4}", max_tokens=20, temperature=1.0, seed=2)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.text), r.text
    assert len(starts) == 1 and gpu._batcher.stats.device_steps == device_steps  # neither of those took it
