"""benchmarks/serve_load.py's statistics, against a `lily serve` of the demo model.

References: the server's own counters (/metrics, read with prometheus_client's parser) and the
same requests sent again without streaming (greedy, so the same tokens): the load generator
must report the tokens the server says it generated, not what it assumed it asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_server import ROOT, _request, start_server, stop_server

sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_load  # noqa: E402


@pytest.fixture(scope="module")
def server():
    proc, base, _ = start_server("--served-model-name", serve_load.MODEL_NAME)
    yield base
    stop_server(proc)


def counters(base: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(_request(base, "GET", "/metrics").text):
        for s in family.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def test_percentile_is_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert serve_load.percentile(xs, 50) == 50 and serve_load.percentile(xs, 99) == 99
    assert serve_load.percentile(xs, 100) == 100
    assert serve_load.percentile([3.0, 1.0, 2.0], 50) == 2
    assert serve_load.percentile([5.0, 1.0], 99) == 5  # two samples: p99 is the slower


def test_prompts_are_distinct_per_client_and_request():
    prompts = {serve_load.prompt_text(c, i, 30) for c in range(16) for i in range(4)}
    assert len(prompts) == 64
    assert serve_load.prompt_text(3, 1, 30) == serve_load.prompt_text(3, 1, 30)  # seeded


def test_load_generator_reports_what_the_server_generated(server):
    before = counters(server)
    clients, per_client, max_tokens = 2, 2, 8
    row, reqs = serve_load.run_level(server, "lily", clients, per_client, max_tokens=max_tokens, prompt_words=20)
    after = counters(server)
    assert sorted((r.client, r.index) for r in reqs) == [(c, i) for c in range(clients) for i in range(per_client)]
    generated = after["lily_generation_tokens_total"] - before["lily_generation_tokens_total"]
    prompted = after["lily_prompt_tokens_total"] - before["lily_prompt_tokens_total"]
    assert row["completion_tokens"] == sum(r.completion_tokens for r in reqs) == generated > 0
    assert sum(r.prompt_tokens for r in reqs) == prompted
    assert row["requests"] == clients * per_client
    assert row["tokens_per_s"] == pytest.approx(row["completion_tokens"] / row["wall_s"])
    assert 0 <= row["others_cpu_pct"] <= 100
    assert row["completion_tokens_min"] == min(r.completion_tokens for r in reqs)
    assert row["latency_p99_s"] == max(r.latency_s for r in reqs)  # 4 samples: nearest rank is the max
    for r in reqs:
        assert 1 <= r.completion_tokens <= max_tokens
        assert 0 < r.ttft_s <= r.latency_s <= row["wall_s"]
        # the same request, not streamed: the same usage (greedy)
        body = {"model": serve_load.MODEL_NAME, "temperature": 0, "max_tokens": max_tokens, "messages": [
            {"role": "user", "content": serve_load.prompt_text(r.client, r.index, 20)}]}
        usage = _request(server, "POST", "/v1/chat/completions", json.dumps(body).encode(),
                         {"Content-Type": "application/json"}).json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (r.prompt_tokens, r.completion_tokens)


def test_markdown_ratios():
    rows = [{"engine": e, "clients": 2, "requests": 4, "requests_per_client": 2, "wall_s": 10.0,
             "completion_tokens": 512, "completion_tokens_min": 128, "completion_tokens_max": 128,
             "prompt_tokens_mean": 200.0, "tokens_per_s": tps, "latency_p50_s": lat, "latency_p99_s": lat,
             "ttft_p50_s": 0.5} for e, tps, lat in (("lily", 40.0, 4.0), ("llama-server", 80.0, 2.0))]
    info = {"machine": {"cpu": "x", "cores": 2, "memory_GiB": 1, "os": "y", "lily_commit": "z"}, "date": "d",
            "args": {"size": "medium", "threads": 2, "requests": 2, "prompt_tokens": 200, "max_tokens": 128,
                     "ctx_per_slot": 1024, "quiet_cpu": 0.15, "quiet_wait": 240},
            "load_before": 0.0, "load_after": 0.0, "servers": {}, "command": "c"}
    md = serve_load.markdown(rows, info)
    assert "| 2 | 0.50 | 2.00 | 2.00 | 1.00 |" in md


def test_others_cpu_leaves_out_the_named_processes():
    """A busy child counted as "other" when not named, and not when named, over one window."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        anyone = serve_load.OthersCPU([]).start()
        but_child = serve_load.OthersCPU([child.pid]).start()
        time.sleep(1.5)  # measured while the child is alive (a reaped child's /proc entry is gone)
        # the child's own share of the machine: ~1 core of os.cpu_count() for most of the window
        assert anyone.share() - but_child.share() > 0.3 / os.cpu_count()
    finally:
        child.kill()
