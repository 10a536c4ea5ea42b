"""`lily serve` against the official OpenAI Python client, with the shipped demo model.

One server process (python -m lily serve, 127.0.0.1, a free port, an API key, a small queue)
serves the whole module. References: the Python API in this process (greedy generation of the
same messages, checked elsewhere against teacher-forced logits), the tokenizer, and the same
server answering one client at a time.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest

import lily
from lily.server import StreamSplitter
from lily.tool_calls import parse_output

ROOT = Path(__file__).resolve().parents[1]
# Where the lily under test was imported from (site-packages in CI, src/ in a dev tree):
# subprocesses must see the same one.
LILY_PARENT = str(Path(lily.__file__).resolve().parent.parent)
KEY = "test-key-123"
MAX_QUEUE = 8
MODEL = "lily-demo"


class Resp:
    """A raw HTTP answer (stdlib http.client: no dependency on the client's HTTP library)."""

    def __init__(self, status: int, body: bytes, headers: dict | None = None):
        self.status_code, self.text = status, body.decode("utf-8", "replace")
        self.headers = headers or {}  # lower-cased names

    def json(self):
        return json.loads(self.text)


def _request(base: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             timeout: float = 60) -> Resp:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Resp(r.status, r.read(), {k.lower(): v for k, v in r.getheaders()})
    finally:
        conn.close()


def demo_no_eos_bias() -> dict[str, float]:
    """OpenAI ``logit_bias`` banning the demo model's end-of-sequence tokens: a request then runs
    to its max_tokens whatever the demo's habits (the long requests of the disconnect tests)."""
    config = json.loads((lily.model.demo_model_path() / "generation_config.json").read_text())
    return {str(t): -100.0 for t in config["eos_token_id"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, preexec_fn=None) -> tuple[subprocess.Popen, str, int]:
    """`python -m lily serve` with `args` on a free port of 127.0.0.1, once /health answers:
    (process, base URL, port). The caller stops it with stop_server."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=LILY_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", "--port", str(port), "--log-level", "warning",
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec_fn)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"lily serve exited: {proc.stdout.read()}")
        try:
            if _request(base, "GET", "/health", timeout=1).status_code == 200:
                return proc, base, port
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("lily serve did not come up in 60 s")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> str:
    """Stops a start_server process; returns what it logged."""
    proc.terminate()
    try:
        return proc.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]


@pytest.fixture(scope="module")
def server():
    proc, base, _ = start_server("--api-key", KEY, "--max-queue", str(MAX_QUEUE))
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model():
    return lily.Model.load()


def _health(server) -> dict:
    return _request(server, "GET", "/health", timeout=5).json()


def _open(server, path: str, body: dict) -> http.client.HTTPConnection:
    """A request left open (raw http.client), so the test can walk away from it."""
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    return conn


def _leave(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away
    conn.close()


def _wait_until_idle(server, what: str) -> dict:
    t0 = time.perf_counter()
    while (h := _health(server))["running"] or h["queued"]:
        assert time.perf_counter() - t0 < 10, f"the engine kept {what} after the client left"
        time.sleep(0.02)
    return h


def _chat(client, messages, **kw):
    kw.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = _health(server)
    assert h["status"] == "ok" and h["model"] == MODEL


def test_chat_matches_python_api(client, model):
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a list?"}]
    r = _chat(client, messages)
    ref = model.generate(messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == parse_output(ref.text).content
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.prompt_tokens
    assert r.usage.completion_tokens == ref.completion_tokens
    assert r.usage.total_tokens == ref.prompt_tokens + ref.completion_tokens


def test_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Describe a dictionary."}]
    full = _chat(client, messages, max_tokens=24)
    stream = _chat(client, messages, max_tokens=24, stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, []
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert roles == ["assistant"]
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_and_logprobs(client, model):
    prompt = "The standard library"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    ref = model.generate(prompt, max_tokens=10, temperature=0, logprobs=3)
    assert r.choices[0].text == ref.text
    lp = r.choices[0].logprobs
    assert lp.tokens == [model.tokenizer.decode([e["token"]]) for e in ref.logprobs]
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-4)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    chunks = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True, logprobs=3) if c.choices]
    assert "".join(c.text for c in chunks) == ref.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]  # one token each
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [list(t) for s in streamed for t in s.top_logprobs] == [list(t) for t in lp.top_logprobs]
    # Token-id prompts and the echo-free default max_tokens (16) of the completions API.
    ids = model.tokenizer.encode(prompt)
    r2 = client.completions.create(model=MODEL, prompt=ids, temperature=0)
    assert r2.usage.prompt_tokens == len(ids) and r2.usage.completion_tokens <= 16


def test_chat_logprobs(client, model):
    messages = [{"role": "user", "content": "What is a set?"}]
    r = _chat(client, messages, max_tokens=5, logprobs=True, top_logprobs=2)
    ref = model.generate(messages, max_tokens=5, temperature=0, logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    texts = [model.tokenizer.decode([e["token"]]) for e in ref.logprobs]
    assert [c.token for c in content] == texts
    assert [bytes(c.bytes).decode("utf-8") for c in content] == texts
    # Streamed, each token's entry comes with its chunk: the same entries.
    stream = _chat(client, messages, max_tokens=5, logprobs=True, top_logprobs=2, stream=True)
    streamed = [c for ev in stream for ch in ev.choices if ch.logprobs is not None for c in ch.logprobs.content]
    def entries(cs):  # texts exactly; the logprobs apart (the prompt comes from the prefix cache now)
        return [(c.token, c.bytes, [(t.token, t.bytes) for t in c.top_logprobs]) for c in cs]

    def logprobs(cs):
        return [[c.logprob] + [t.logprob for t in c.top_logprobs] for c in cs]

    assert entries(streamed) == entries(content)
    assert np.allclose(logprobs(streamed), logprobs(content), atol=1e-4)


def test_seed_reproducible_sampling(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about modules."}], max_tokens=12,
              temperature=1.0, seed=11)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_call_request(client, model):
    # A conversation with an earlier tool call and its result: the server must render both
    # (arguments arrive as a JSON string) exactly like the Python API with the same tools.
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And in Paris?"},
    ]
    r = _chat(client, messages, tools=TOOLS, tool_choice="auto", max_tokens=20)
    api_messages = [dict(m) for m in messages]
    api_messages[1] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    ref = model.generate(api_messages, tools=TOOLS, max_tokens=20, temperature=0)
    assert r.usage.prompt_tokens == ref.prompt_tokens
    parsed = parse_output(ref.text, tools=TOOLS)
    msg = r.choices[0].message
    assert (msg.content or "") == parsed.content
    assert [c.function.name for c in msg.tool_calls or []] == [c["function"]["name"] for c in parsed.tool_calls]
    assert r.choices[0].finish_reason == ("tool_calls" if parsed.tool_calls else ref.finish_reason)
    # tool_choice="none" leaves the tools out of the prompt; a named function must exist.
    r_none = _chat(client, messages[:1], tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r_none.usage.prompt_tokens == len(model.encode_prompt(messages[:1]))
    with pytest.raises(openai.BadRequestError):
        _chat(client, messages[:1], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})

    # A named function (or "required") starts the assistant turn with the opening of a call in
    # the model's format; the answer is the parse of that prefix plus the greedy continuation.
    named = {"type": "function", "function": {"name": "get_weather"}}
    r_named = _chat(client, messages[:1], tools=TOOLS, tool_choice=named, max_tokens=24)
    forced = "<tool_call>\n<function=get_weather>\n"
    prompt = np.concatenate([model.encode_prompt(messages[:1], tools=TOOLS),
                             np.asarray(model.tokenizer.encode(forced), dtype=np.int32)])
    ref_named = model.generate(prompt, max_tokens=24, temperature=0)
    assert r_named.usage.prompt_tokens == len(prompt)
    parsed_named = parse_output(forced + ref_named.text, tools=TOOLS)
    msg_named = r_named.choices[0].message
    assert [c.function.name for c in msg_named.tool_calls or []] == [c["function"]["name"] for c in parsed_named.tool_calls]
    assert (msg_named.content or "") == parsed_named.content


def test_stream_splitter_matches_parse_output():
    # Outputs as a thinking, tool-calling Qwen model writes them, streamed in small pieces:
    # the deltas must add up to parse_output's reasoning and content of the whole text.
    texts = [
        ("let me think\n</think>\n\nThe answer is 4.", True),
        ("<think>plan</think>\n\nSure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
         "</parameter>\n</function>\n</tool_call>", False),
        ("Plain answer with a < sign and </thin text.", False),
        ("still thinking when cut off", True),
    ]
    for text, started in texts:
        parsed = parse_output(text, tools=TOOLS, reasoning_started=started)
        for step in (1, 3, 7):
            sp = StreamSplitter(started)
            got = {"reasoning_content": "", "content": ""}
            for i in range(0, len(text), step):
                for d in sp.feed(text[i:i + step]):
                    for k, v in d.items():
                        got[k] += v
            for d in sp.finish(parsed):
                for k, v in d.items():
                    got[k] += v
            assert got["content"] == parsed.content, (text, step)
            assert got["reasoning_content"] == (parsed.reasoning or ""), (text, step)


def test_concurrent_clients_get_their_own_answers(client, server):
    prompts = [f"Question {i}: what is {w}?" for i, w in enumerate(
        ["a list", "a tuple", "a set", "a dict", "a class", "a module", "an iterator", "a generator"])]
    alone = {}
    t0 = time.perf_counter()
    for p in prompts:
        alone[p] = _chat(client, [{"role": "user", "content": p}], max_tokens=12).choices[0].message.content
    serial_s = time.perf_counter() - t0
    out, lat = {}, {}

    def run(p):
        t = time.perf_counter()
        out[p] = _chat(client, [{"role": "user", "content": p}], max_tokens=12).choices[0].message.content
        lat[p] = time.perf_counter() - t

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert out == alone
    print(f"\n[concurrency] {len(prompts)} clients: wall {wall:.2f} s (serial {serial_s:.2f} s), latency "
          f"min {min(lat.values()):.2f} s max {max(lat.values()):.2f} s")
    assert _health(server)["running"] is False


def test_disconnect_mid_stream_frees_the_engine(server, client):
    before = _health(server)
    conn = _open(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 3000,
        "temperature": 0.7, "seed": 1, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200
    n = 0
    while n < 5:
        line = resp.fp.readline()
        assert line, "stream ended early"
        n += line.startswith(b"data:")
    _leave(conn)  # mid-stream
    after = _wait_until_idle(server, "generating")
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["last_cancel_steps"] is not None and after["last_cancel_steps"] <= 1
    print(f"\n[disconnect] engine free {after['last_cancel_release_s'] * 1e3:.1f} ms after the cancel, "
          f"{after['last_cancel_steps']} step(s) ran after it")
    # and the server keeps serving correctly
    assert _chat(client, [{"role": "user", "content": "What is a list?"}], max_tokens=4).usage.completion_tokens >= 1


def test_disconnect_of_a_non_streamed_request_frees_the_engine(server, client):
    """Issue 22, item 3: a non-streamed request whose client leaves mid-generation. The server
    noticed only after a 0.25 s gap between tokens, which a generating engine never leaves, so
    the request ran to its end; now the client's http.disconnect cancels it at once."""
    before = _health(server)
    conn = _open(server, "/v1/completions", {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
                                             "max_tokens": 3000, "temperature": 0, "logit_bias": demo_no_eos_bias()})
    t0 = time.perf_counter()
    while not _health(server)["running"]:
        assert time.perf_counter() - t0 < 30, "the job never started"
        time.sleep(0.005)
    time.sleep(0.3)  # decoding by now
    _leave(conn)
    after = _wait_until_idle(server, "generating")
    assert after["completed"] == before["completed"], "the request ran to its end after its client left"
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["last_cancel_reason"] == "client_disconnected"
    assert after["last_cancel_steps"] is not None and after["last_cancel_steps"] <= 1
    print(f"\n[disconnect, non-streamed] engine free {after['last_cancel_release_s'] * 1e3:.1f} ms after the "
          f"cancel, {after['last_cancel_steps']} step(s) ran after it, {after['last_cancel_tokens']} tokens generated")
    assert _chat(client, [{"role": "user", "content": "What is a list?"}], max_tokens=4).usage.completion_tokens >= 1


def test_disconnect_during_prefill_frees_the_engine(server, client, model):
    """A client that leaves while its long prompt is being prefilled: the job stops at the next
    prefill chunk (max_tokens=1, so a job that got past its prefill would have completed), and
    the server keeps serving."""
    before = _health(server)
    rng = np.random.default_rng(7)  # fresh words: nothing of it is in the prompt cache
    words = [model.tokenizer.decode([int(t)]) for t in rng.integers(1000, 4000, 3400)]
    prompt = "".join(words)
    n_prompt = len(model.encode_prompt([{"role": "user", "content": prompt}]))
    assert 3000 < n_prompt < model.max_context - 16, n_prompt
    conn = _open(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0})
    t0 = time.perf_counter()
    while not _health(server)["running"]:
        assert time.perf_counter() - t0 < 30, "the job never started"
        time.sleep(0.005)
    _leave(conn)  # during the prefill
    after = _wait_until_idle(server, "prefilling")
    assert after["completed"] == before["completed"], "the prefill finished before the disconnect landed"
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["last_cancel_steps"] is not None and after["last_cancel_steps"] <= 1
    print(f"\n[disconnect in prefill of {n_prompt} tokens] engine free "
          f"{after['last_cancel_release_s'] * 1e3:.1f} ms after the cancel, "
          f"{after['last_cancel_steps']} chunk(s) ran after it")
    assert _chat(client, [{"role": "user", "content": "What is a list?"}], max_tokens=4).usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def serial_server():
    """A server running one request at a time (--max-batch 1), so a second one queues; on one
    thread, so that a long generation leaves a client time to queue behind it and leave."""
    proc, base, _ = start_server("--api-key", KEY, "--max-batch", "1", "--threads", "1")
    yield base
    stop_server(proc)


@pytest.mark.parametrize(("loaded", "served", "expected"), [(3, None, 3), (3, 2, 2), (None, None, None)])
def test_serve_keeps_the_max_batch_the_model_was_loaded_with(monkeypatch, loaded, served, expected):
    """serve(model) from Python: a max_batch given at load stays, one given to serve wins, and
    without either the default applies. uvicorn is not started: the Server that serve()
    built is caught on its way to build_app, and its engine workers (one per generation slot)
    are counted."""
    import uvicorn

    import lily.server
    from lily.model import default_max_batch

    built = []
    monkeypatch.setattr(lily.server, "build_app", lambda server: built.append(server))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    model = lily.Model.load(max_batch=loaded)
    lily.server.serve(model, model_id=MODEL, max_batch=served)
    try:
        if expected is None:
            expected = default_max_batch(model._engine)
        assert model.max_batch == expected
        assert len(built[0].scheduler._threads) == expected
    finally:
        built[0].scheduler.shutdown()


def test_disconnect_while_queued_drops_the_job(serial_server):
    """A client that leaves while its request waits behind another never gets engine time: the
    job is dropped when its turn comes (neither completed nor run), and the server serves on."""
    server = serial_server
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    before = _health(server)

    def open_request(prompt: str, max_tokens: int, **extra) -> http.client.HTTPConnection:
        return _open(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "stream": True, **extra})

    # A long job: the demo model's end-of-sequence tokens banned (logit_bias), so it writes its
    # 4,000 tokens, about 3 s on one thread. (Left free, it stops after ~230 tokens: a job
    # shorter than this test's window once the kernels got faster.)
    no_eos = {str(t): -100 for t in lily.Model.load().eos_token_ids}
    running = open_request("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", 4000, logit_bias=no_eos)
    resp = running.getresponse()
    assert resp.status == 200
    while not resp.fp.readline().startswith(b"data:"):  # (raw chunked lines) until it generates
        pass
    waiting = open_request("The json module", 8)
    t0 = time.perf_counter()
    while _health(server)["queued"] < 1:
        assert time.perf_counter() - t0 < 10, "the second request was never queued"
        time.sleep(0.01)
    _leave(waiting)  # a streamed request's disconnect is seen at once
    time.sleep(0.1)
    assert _health(server)["running"], "the first job ended on its own: no queue to leave"
    _leave(running)
    h = _wait_until_idle(server, "working")
    assert h["completed"] == before["completed"] and h["failed"] == before["failed"]
    assert h["cancelled"] == before["cancelled"] + 2
    assert _chat(client, [{"role": "user", "content": "What is a list?"}], max_tokens=4).usage.completion_tokens >= 1


def test_follow_up_reports_cached_tokens_and_equals_uncached(client, model):
    first = [{"role": "system", "content": "You are a Python tutor."}, {"role": "user", "content": "What is a list?"}]
    r1 = _chat(client, first, max_tokens=16)
    follow = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And a tuple?"}]
    r2 = _chat(client, follow, max_tokens=16)
    ref = model.generate(follow, max_tokens=16, temperature=0)  # from scratch, nothing cached
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens == ref.prompt_tokens
    assert r2.choices[0].message.content == parse_output(ref.text).content
    # streamed follow-up: usage chunk reports the cache as well, same text
    follow2 = follow + [{"role": "assistant", "content": r2.choices[0].message.content},
                        {"role": "user", "content": "Thanks."}]
    usage, text = None, ""
    for ev in _chat(client, follow2, max_tokens=8, stream=True, stream_options={"include_usage": True}):
        usage = ev.usage or usage
        text += "".join(c.delta.content or "" for c in ev.choices)
    assert usage.prompt_tokens_details.cached_tokens >= r2.usage.prompt_tokens
    assert text == parse_output(model.generate(follow2, max_tokens=8, temperature=0).text).content


def _post(server, path, content=None, *, key=KEY, json_body=None):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if json_body is not None:
        content = json.dumps(json_body)
    if isinstance(content, str):
        content = content.encode()
    return _request(server, "POST", path, content, headers)


def _err(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert isinstance(body["message"], str) and body["message"]
    return body


def test_malformed_and_hostile_requests(server, client):
    msgs = [{"role": "user", "content": "hi"}]
    ok = {"model": MODEL, "messages": msgs, "max_tokens": 2}
    _err(_post(server, "/v1/chat/completions", "{not json"), 400)
    _err(_post(server, "/v1/chat/completions", b"\xff\xfe{}"), 400)
    _err(_post(server, "/v1/chat/completions", "[" * 100000 + "]" * 100000), 400)
    _err(_post(server, "/v1/chat/completions", json_body=[1, 2]), 400)
    _err(_post(server, "/v1/chat/completions", json_body={"model": MODEL}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "messages": "hi"}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "messages": [{"role": "user", "content": 5}]}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    e = _err(_post(server, "/v1/chat/completions", json_body={**ok, "max_tokens": -1}), 400)
    assert e["param"] == "max_tokens"
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "max_tokens": "ten"}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "max_tokens": True}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "temperature": "hot"}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "temperature": 5}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "top_p": -1}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "stop": [1, 2]}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "stop": ["x" * 100000]}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "n": 17}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "guided_json": {}}), 400)  # not OpenAI, not lily
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "tools": "all"}), 400)
    _err(_post(server, "/v1/chat/completions", json_body={**ok, "stream": "yes"}), 400)
    e = _err(_post(server, "/v1/chat/completions", json_body={**ok, "messages": [
        {"role": "user", "content": "word " * 5000}]}), 400)
    assert e["code"] == "context_length_exceeded"
    _err(_post(server, "/v1/completions", json_body={"model": MODEL, "prompt": [10**9]}), 400)
    _err(_post(server, "/v1/completions", json_body={"model": MODEL, "prompt": {"a": 1}}), 400)
    _err(_post(server, "/v1/chat/completions", b"x" * (17 << 20)), 413)
    e = _err(_post(server, "/v1/chat/completions", json_body={**ok, "model": "gpt-9"}), 404)
    assert e["code"] == "model_not_found"
    _err(_post(server, "/v1/chat/completions", json_body=ok, key="wrong"), 401)
    assert _request(server, "GET", "/v1/models").status_code == 401
    _err(_request(server, "GET", "/v1/nothing"), 404)
    _err(_request(server, "GET", "/v1/chat/completions"), 405)
    # through the official client: typed exceptions
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=msgs)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=-5)
    # still serving, nothing stuck
    h = _health(server)
    assert h["running"] is False and h["queued"] == 0
    assert _chat(client, msgs, max_tokens=2).usage.completion_tokens >= 1


def test_full_queue_gets_503_and_server_recovers(server, client):
    n = MAX_QUEUE + 24  # more than the queue and the 8 running requests (--max-batch default) hold
    codes = [None] * n
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 6, "temperature": 0}

    def run(i):
        codes[i] = _post(server, "/v1/chat/completions", json_body=body).status_code

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(codes) <= {200, 503}
    assert 503 in codes and codes.count(200) >= MAX_QUEUE
    r = _post(server, "/v1/chat/completions", json_body=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert _health(server)["rejected"] >= 1


def test_openai_client_example_runs(server):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"), "--base-url", server + "/v1",
                        "--api-key", KEY], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "[chat]" in p.stdout and "cached prompt tokens" in p.stdout and "[completion]" in p.stdout
