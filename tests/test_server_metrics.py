"""`GET /metrics` of `lily serve` (the demo model), read with prometheus_client's own parser.

The references: the `usage` each response reports (prompt, completion and cached tokens), the
HTTP status of each request (200 or a 503 for a full queue) and /health's counters. The
exposition is parsed by `prometheus_client.parser.text_string_to_metric_families`, the
reference parser of the format, not by anything lily wrote.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_server import _request, start_server, stop_server

MAX_QUEUE = 2
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    # One request at a time, so a long one makes the others queue (the gauges' test needs a queue).
    proc, base, _ = start_server("--max-queue", str(MAX_QUEUE), "--max-batch", "1")
    yield base
    stop_server(proc)


def metrics(base: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, through the reference parser."""
    r = _request(base, "GET", "/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[name, tuple(sorted(labels.items()))]


def post(base: str, body: dict):
    return _request(base, "POST", CHAT, json.dumps(body).encode(), JSON, timeout=120)


def stream_usage(base: str, body: dict) -> dict:
    """A streamed request with include_usage: its final usage chunk."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", CHAT, json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
                     JSON)
        resp = conn.getresponse()
        assert resp.status == 200
        usage = None
        for line in resp.read().decode().splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                usage = json.loads(line[5:]).get("usage") or usage
        return usage
    finally:
        conn.close()


def test_metrics_count_what_the_responses_report(server):
    m0 = metrics(server)
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    usages = []
    for i, (msgs, stream, n) in enumerate([
            (conv, False, 1),
            (conv, True, 1),  # the same prompt again: a prompt-cache hit
            ([{"role": "user", "content": "Count to five."}], False, 2),  # two choices, one prompt
            ([{"role": "user", "content": "What is a tuple?"}], True, 1),
            ([{"role": "user", "content": "Say hi."}], False, 1)]):
        body = {"messages": msgs, "max_tokens": 6 + i, "temperature": 0, "n": n}
        if stream:
            usages.append(stream_usage(server, body))
        else:
            r = post(server, body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    m = metrics(server)

    def grew(name: str, **labels) -> float:
        return value(m, name, **labels) - value(m0, name, **labels)

    assert grew("lily_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("lily_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[1] > 0, "the repeated prompt was not a cache hit"
    assert grew("lily_prompt_cache_hit_tokens_total") == sum(cached)
    assert grew("lily_prompt_cache_hit_requests_total") == sum(c > 0 for c in cached)
    assert grew("lily_requests_total", outcome="completed") == len(usages)
    for outcome in ("cancelled", "failed", "rejected"):
        assert grew("lily_requests_total", outcome=outcome) == 0
    assert grew("lily_time_to_first_token_seconds_count") == len(usages)
    assert grew("lily_request_latency_seconds_count") == len(usages)
    assert 0 < grew("lily_time_to_first_token_seconds_sum") < grew("lily_request_latency_seconds_sum")
    # the +Inf bucket of a histogram holds every observation
    assert value(m, "lily_request_latency_seconds_bucket", le="+Inf") == value(m, "lily_request_latency_seconds_count")
    # the worker hands the sequence back to the prompt cache after the answer went out
    settled(server)


def settled(base: str) -> dict:
    """Polls /metrics until both gauges are back to 0 (within 10 s); returns that scrape."""
    t0 = time.perf_counter()
    while (m := metrics(base)) and (value(m, "lily_queue_depth"), value(m, "lily_running_requests")) != (0, 0):
        assert time.perf_counter() - t0 < 10, "the gauges did not go back to 0"
        time.sleep(0.01)
    return m


def test_content_type_is_the_0_0_4_text_format(server):
    r = _request(server, "GET", "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_queue_gauge_rejections_and_cancels(server):
    """A long request runs while others queue: the gauges show it, a request past the queue's
    limit is a 503 counted as rejected, a client that leaves is counted as cancelled, and the
    gauges go back to 0."""
    m0 = metrics(server)
    host, port = server.removeprefix("http://").split(":")
    # A completion the demo model continues well past 1,500 tokens (tests/test_server.py).
    long = http.client.HTTPConnection(host, int(port), timeout=60)
    long.request("POST", "/v1/completions", json.dumps({"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
                                                        "max_tokens": 3000, "temperature": 0, "stream": True}), JSON)
    resp = long.getresponse()
    assert resp.status == 200
    while not resp.fp.readline().startswith(b"data:"):  # generating now
        pass
    codes: list[int] = []
    short = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 4, "temperature": 0}
    threads = [threading.Thread(target=lambda: codes.append(post(server, short).status_code))
               for _ in range(MAX_QUEUE + 2)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    while True:  # until MAX_QUEUE wait and the other 2 were refused, all while the long one runs
        m = metrics(server)
        rejected = value(m, "lily_requests_total", outcome="rejected") - value(m0, "lily_requests_total",
                                                                              outcome="rejected")
        if value(m, "lily_queue_depth") == MAX_QUEUE and rejected == 2:
            break
        assert time.perf_counter() - t0 < 20, "the queue never filled"
        time.sleep(0.02)
    assert value(m, "lily_running_requests") == 1
    long.sock.shutdown(2)  # the long request's client leaves
    long.close()
    for t in threads:
        t.join()
    m = settled(server)
    h = _request(server, "GET", "/health", timeout=5).json()

    def grew(name: str, **labels) -> float:
        return value(m, name, **labels) - value(m0, name, **labels)

    assert sorted(codes) == [200] * MAX_QUEUE + [503] * 2, codes
    assert grew("lily_requests_total", outcome="rejected") == 2
    assert grew("lily_requests_total", outcome="cancelled") == 1
    assert grew("lily_requests_total", outcome="completed") == MAX_QUEUE
    # /health counts the same outcomes
    for outcome in ("completed", "cancelled", "failed", "rejected"):
        assert h[outcome] == value(m, "lily_requests_total", outcome=outcome), outcome
