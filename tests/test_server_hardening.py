"""The server's request handling against hostile input, in process (lily.server's real Starlette
app driven through ASGI, no sockets; tests/test_server_limits.py covers what needs a socket).

Issue 22, items 1, 2, 7 and 8: every route with and without the API key; bodies that fail to
parse (huge integers, non-finite numbers) and fuzzed bodies never reach a 500; tool schemas are
checked on the request; smaller request rules. References: the demo model through the Python
API, and the rule "4xx for the client's mistakes, never 500".
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lily
from lily.server import APIError, Server, build_app
from lily.tool_calls import parse_output

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
from asgi import request  # noqa: E402

KEY = "k-123"
MODEL = "lily-demo"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


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
    server = Server(model, model_id=MODEL, api_key=KEY, max_queue=4)
    yield build_app(server)
    server.scheduler.shutdown()


class ValidatingServer(Server):
    """Stops accepted requests before the scheduler (as the fuzz target does): only parsing and
    validation run, so thousands of bodies take seconds."""

    async def _run(self, request, job_args):
        raise APIError(503, "accepted (test harness)", code="accepted")


@pytest.fixture(scope="module")
def validating_app(model):
    server = ValidatingServer(model, model_id=MODEL, max_queue=1)
    yield build_app(server)
    server.scheduler.shutdown()


def _call(loop, app, method, path, body=None, *, key=KEY, raw: bytes | None = None):
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    status, resp = loop.run_until_complete(request(app, method, path, data, headers=headers, client_stays=True))
    return status, (json.loads(resp) if resp else None)


# -- item 1: every route, with and without the key ----------------------------------------------

ROUTES = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                    "temperature": 0}),
    ("POST", COMPLETIONS, {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}),
]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_with_and_without_the_key(loop, app, method, path, body):
    """GET /v1/models/{id} answered 500 for every id and never checked the key: the attribute
    Server.model (the served Model) shadowed the route method of the same name."""
    status, resp = _call(loop, app, method, path, body)
    assert status == 200, resp
    if path == "/health":  # the one route without a key: a liveness probe
        assert _call(loop, app, method, path, body, key=None)[0] == 200
        return
    for key in (None, "wrong"):
        status, resp = _call(loop, app, method, path, body, key=key)
        assert status == 401, resp
        assert resp["error"]["code"] == "invalid_api_key"


def test_model_card_and_unknown_model_id(loop, app, model):
    status, card = _call(loop, app, "GET", f"/v1/models/{MODEL}")
    assert status == 200 and card["id"] == MODEL and card["max_model_len"] == model.max_context
    status, resp = _call(loop, app, "GET", "/v1/models/gpt-9")
    assert status == 404 and resp["error"]["code"] == "model_not_found"


# -- item 2: bodies that fail to parse, and fuzzed bodies: never a 500 ---------------------------

@pytest.mark.parametrize("raw", [
    b'{"model": "lily-demo", "max_tokens": ' + b"1" * 5000 + b"}",           # > 4,300 digits
    b'{"messages": [{"role": "user", "content": "x"}], "seed": -' + b"9" * 4301 + b"}",
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "top_p": Infinity}',
    b'{"prompt": "x", "min_p": -Infinity}',
    b'{"prompt": "x", "temperature": 1e999}',
], ids=["int-5000-digits", "int-4302-digits", "nan", "inf", "-inf", "1e999"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unparseable_numbers_are_400(loop, validating_app, path, raw):
    """An integer of more than 4,300 digits raised ValueError out of json.loads (a 500); NaN and
    infinities passed the range checks."""
    status, resp = _call(loop, validating_app, "POST", path, raw=raw, key=None)
    assert status == 400, resp
    assert resp["error"]["code"] in ("invalid_json", "invalid_value"), resp


class _Digits:
    """An integer literal of `n` digits: past Python's 4,300-digit int conversion limit, which
    neither json nor hypothesis can hold as an int."""

    def __init__(self, n: int, sign: str = ""):
        self.n, self.sign = n, sign

    def __repr__(self):
        return f"<{self.sign}{self.n}-digit integer>"


def _json_values():
    scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
               | st.text(max_size=20) | st.sampled_from([_Digits(4301), _Digits(9000, "-"), _Digits(4400)]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _dump(value) -> bytes:
    if isinstance(value, _Digits):
        return value.sign.encode() + b"7" * value.n
    if isinstance(value, dict):
        return b"{" + b",".join(json.dumps(k).encode() + b":" + _dump(v) for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(_dump(v) for v in value) + b"]"
    return json.dumps(value).encode()


FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
          "logprobs", "top_logprobs", "n", "stream", "stream_options", "tools", "tool_choice",
          "chat_template_kwargs", "enable_thinking", "echo", "suffix", "best_of", "logit_bias", "stop_token_ids",
          "response_format", "user", "metadata", "parallel_tool_calls", "modalities", "prediction"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from([CHAT, COMPLETIONS]),
       body=st.one_of(
           st.binary(max_size=64),
           _json_values().map(_dump),
           st.fixed_dictionaries({}, optional={f: _json_values() for f in FIELDS}).map(_dump),
           st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}]),
                                  "tools": st.lists(st.fixed_dictionaries({
                                      "type": st.just("function"),
                                      "function": st.fixed_dictionaries(
                                          {"name": st.just("f")},
                                          optional={"parameters": _json_values()})}), max_size=2)},
                                 optional={f: _json_values() for f in FIELDS if f not in ("messages", "tools")}).map(_dump)))
def test_fuzzed_bodies_never_answer_500(loop, validating_app, path, body):
    """The property behind items 2 and 7: whatever the body, the answer is a 4xx or the harness's
    'accepted' 503, never a 500."""
    status, resp = loop.run_until_complete(request(validating_app, "POST", path, body))
    assert status not in (0, 500), (body[:300], resp[:500])


# -- item 7: tool schemas are checked on the request -------------------------------------------

@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"city": {"type": 5}}},
    {"type": "object", "properties": {"city": {"type": True}}},
    {"type": "object", "properties": {"city": {"type": 1.5}}},
    {"type": "object", "properties": {"city": {"type": ["string", 7]}}},
    {"type": "object", "properties": {"city": {"type": "strnig"}}},
    {"type": "object", "properties": ["city"]},
    {"type": "object", "required": "city"},
    "an object",
    [1, 2],
])
def test_bad_tool_schema_is_400(loop, validating_app, parameters):
    """A parameter whose type is a number, true or 1.5 reached the tool-call parser, which raised
    TypeError (a 500) the moment the model wrote that parameter."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]}
    status, resp = _call(loop, validating_app, "POST", CHAT, body, key=None)
    assert status == 400, resp
    assert resp["error"]["param"].startswith("tools[0]"), resp


def test_good_tool_schema_is_accepted(loop, validating_app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": ["integer", "null"]}},
                "required": ["city"]}}}]}
    assert _call(loop, validating_app, "POST", CHAT, body, key=None)[0] == 503  # accepted


# -- item 8: smaller request rules ---------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("top_k", 10**12), ("top_k", 2**31), ("seed", 10**30),
                                         ("max_tokens", 10**12)])
def test_huge_integers_get_lilys_own_message(loop, validating_app, field, value):
    """top_k 10^12 came back as nanobind's raw signature dump ("incompatible function arguments")."""
    body = {"model": MODEL, "prompt": "Hi", field: value}
    status, resp = _call(loop, validating_app, "POST", COMPLETIONS, body, key=None)
    if field in ("seed", "max_tokens"):  # in range by their own rules: accepted
        assert status == 503, resp
        return
    assert status == 400, resp
    msg = resp["error"]["message"]
    assert resp["error"]["param"] == field and field in msg
    assert "incompatible" not in msg and "__init__" not in msg and "nanobind" not in msg, msg


def test_tool_choice_required_without_tools_is_400(loop, validating_app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required"}
    status, resp = _call(loop, validating_app, "POST", CHAT, body, key=None)
    assert status == 400 and resp["error"]["param"] == "tool_choice", resp


def test_completions_context_error_names_prompt(loop, validating_app, model):
    ids = [5] * (model.max_context + 10)
    for prompt in (ids, "word " * (2 * model.max_context)):
        status, resp = _call(loop, validating_app, "POST", COMPLETIONS, {"model": MODEL, "prompt": prompt}, key=None)
        assert status == 400, resp
        assert resp["error"]["code"] == "context_length_exceeded" and resp["error"]["param"] == "prompt", resp


@pytest.mark.parametrize("chars", [30_000, 1_200_000, 5_000_000])
def test_overlong_chat_message_is_context_length_exceeded(loop, validating_app, chars):
    """A long message hit the template sandbox's value limit (1,000,000 characters built by +) or
    its output limit (4,000,000) and came back as a chat template error."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": ("word " * chars)[:chars]}]}
    status, resp = _call(loop, validating_app, "POST", CHAT, body, key=None)
    assert status == 400, resp
    assert resp["error"]["code"] == "context_length_exceeded" and resp["error"]["param"] == "messages", resp


@pytest.mark.parametrize("path,body", [
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "What is a tuple?"}], "max_tokens": 6,
            "temperature": 0}),
    (COMPLETIONS, {"model": MODEL, "prompt": "The json module", "max_tokens": 6, "temperature": 0}),
])
def test_exactly_repeated_request_reuses_its_prefix(loop, app, model, path, body):
    """A request sent twice prefilled its whole prompt twice: the cache kept a snapshot at the
    prompt's end only, and a prompt must leave >= 1 token to prefill."""
    status, first = _call(loop, app, "POST", path, body)
    assert status == 200, first
    status, again = _call(loop, app, "POST", path, body)
    assert status == 200, again
    n = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens"] == n
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    ref = model.generate(body.get("messages") or body["prompt"], max_tokens=6, temperature=0)
    for r in (first, again):
        choice = r["choices"][0]
        if path == CHAT:
            assert choice["message"]["content"] == parse_output(ref.text).content
        else:
            assert choice["text"] == ref.text
