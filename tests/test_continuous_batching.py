"""Continuous batching from Python and the server (lily.batching, lily.scheduler): requests that
run at once share engine passes, and each gets exactly the answer it gets alone.

Reference: the same request run alone, one at a time, on the same model (greedy and seeded
sampling: the tokens; Session calls: the logits' float32 bits). On the CPU backend a sequence's
logits do not depend on which other rows share its pass (tests/test_batching.py pins that in
the engine), so any difference here is a scheduling bug: a row given another sequence's state,
a token fed twice or dropped, a sampler reseeded. Each test also checks that passes really held
several sequences (``Batcher.stats``), so a scheduler that silently ran requests one at a time
would fail rather than pass trivially.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import lily
from fixtures.references import assert_same_bits
from test_server import _request, start_server, stop_server


@pytest.fixture(scope="module")
def model():
    return lily.Model.load(threads=2)


PROMPTS = ["The json module", "Errors should never pass silently.", "def fib(n):", "A list is",
           "Beautiful is better than ugly.", "import os", "What is a tuple?", "Count: 1, 2, 3,"]


def _solo(model, prompt, **kw):
    return model.generate(prompt, **kw)


def _in_threads(fn, n):
    out = [None] * n
    errors = []

    def run(i):
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9)])
def test_concurrent_threads_get_their_solo_answers(model, sampling):
    kw = [dict(max_tokens=24, seed=11 + i, **sampling) for i in range(len(PROMPTS))]
    solo = [_solo(model, p, **k).tokens for p, k in zip(PROMPTS, kw, strict=True)]
    before = model._batcher.stats.max_sequences
    model._batcher.stats.max_sequences = 0
    got = _in_threads(lambda i: model.generate(PROMPTS[i], **kw[i]).tokens, len(PROMPTS))
    assert got == solo
    assert model._batcher.stats.max_sequences > 1, "no pass held two sequences: nothing was batched"
    model._batcher.stats.max_sequences = max(before, model._batcher.stats.max_sequences)


def test_a_list_of_prompts_is_one_batch(model):
    solo = [_solo(model, p, max_tokens=16, temperature=0.7, seed=5).tokens for p in PROMPTS]
    results = model.generate(PROMPTS, max_tokens=16, temperature=0.7, seed=5)
    assert [r.tokens for r in results] == solo
    chat = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    assert [r.tokens for r in model.generate(chat, max_tokens=8, temperature=0)] == [
        _solo(model, c, max_tokens=8, temperature=0).tokens for c in chat]


def test_streaming_a_list_tags_chunks_with_their_prompt(model):
    solo = [_solo(model, p, max_tokens=12, temperature=0) for p in PROMPTS]
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    texts: dict[int, str] = {i: "" for i in range(len(PROMPTS))}
    with model.generate(PROMPTS, max_tokens=12, temperature=0, stream=True) as stream:
        for c in stream:
            texts[c.index] += c.text
            if c.token is not None:
                tokens[c.index].append(c.token)
    assert [tokens[i] for i in range(len(PROMPTS))] == [r.tokens for r in solo]
    assert [texts[i] for i in range(len(PROMPTS))] == [r.text for r in solo]
    assert [r.tokens for r in stream.results] == [r.tokens for r in solo]


def test_a_failing_prompt_in_a_list_raises_and_names_it(model):
    with pytest.raises(lily.RequestError, match="context holds"):
        model.generate(["A list is", list(range(5000))], max_tokens=4)


def test_session_calls_from_threads_share_passes_bit_identically(model):
    """Session.decode / prefill from several threads at once: same float32 logits as alone,
    including a long prompt prefilled while the others decode."""
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, size=n).astype(np.int32) for n in (7, 300, 33, 1200)]
    steps = [rng.integers(0, vocab, size=12).astype(np.int32) for _ in prompts]

    def run(i):
        s = model.session(2048)
        out = [s.prefill(prompts[i])]
        out += [s.decode(int(t)) for t in steps[i]]
        return np.stack(out)

    solo = [run(i) for i in range(len(prompts))]
    model._batcher.stats.max_sequences = 0
    got = _in_threads(run, len(prompts))
    for i in range(len(prompts)):
        assert_same_bits(got[i], solo[i], f"sequence {i}")
    assert model._batcher.stats.max_sequences > 1


def test_a_long_prompt_admitted_mid_decode_leaves_the_others_unchanged(model):
    long_prompt = list(np.random.default_rng(9).integers(100, 4000, 1500))
    solo_short = _solo(model, "Count: 1, 2, 3,", max_tokens=40, temperature=0).tokens
    solo_long = _solo(model, long_prompt, max_tokens=4, temperature=0).tokens
    started = threading.Event()

    def short(_):
        s = model.generate("Count: 1, 2, 3,", max_tokens=40, temperature=0, stream=True)
        toks = []
        for c in s:
            if c.token is not None:
                toks.append(c.token)
            if len(toks) == 5:
                started.set()  # the long prompt arrives while this one decodes
        return toks

    def long(_):
        started.wait(60)
        return model.generate(long_prompt, max_tokens=4, temperature=0).tokens

    got = _in_threads(lambda i: (short, long)[i](i), 2)
    assert got == [solo_short, solo_long]


def test_server_clients_get_their_solo_answers_and_a_disconnect_changes_nothing(model):
    """Concurrent streamed clients of `lily serve` (default --max-batch): each gets the tokens it
    gets alone; one client that leaves mid-way leaves the others' answers unchanged."""
    proc, base, port = start_server("--threads", "2")
    try:
        body = lambda p, n: {"model": "lily-demo", "prompt": p, "max_tokens": n, "temperature": 0}  # noqa: E731
        solo = [_request(base, "POST", "/v1/completions", json.dumps(body(p, 20)).encode(),
                         {"Content-Type": "application/json"}, timeout=60).json()["choices"][0]["text"]
                for p in PROMPTS[:4]]

        def client(i):
            if i == 4:  # streams a long answer and leaves after a few chunks
                import http.client

                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", "/v1/completions", json.dumps({**body("Count: 1, 2, 3,", 2000), "stream": True}),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                for _ in range(6):
                    resp.fp.readline()
                conn.sock.shutdown(2)
                conn.close()
                return None
            r = _request(base, "POST", "/v1/completions", json.dumps(body(PROMPTS[i], 20)).encode(),
                         {"Content-Type": "application/json"}, timeout=120)
            return r.json()["choices"][0]["text"]

        got = _in_threads(client, 5)
        assert got[:4] == solo
        health = _request(base, "GET", "/health", timeout=10).json()
        assert health["completed"] == 8 and health["failed"] == 0
    finally:
        stop_server(proc)


def test_kv_budget_admission(model):
    """A request whose context could never fit the KV budget is refused at once, naming both
    sizes; requests that fit only one at a time wait their turn and all complete."""
    from lily.scheduler import Job, Scheduler

    recurrent = model._engine.new_state(1).nbytes  # DeltaNet and conv state, whatever the context
    # Room for one request of <= 64 positions (30 + 30 below), not two; not for 60 + 200.
    sched = Scheduler(model, kv_budget_bytes=recurrent + int(model._engine.kv_bytes(64) * 1.5), cache_bytes=0)
    params = lily._core.SamplingParams()
    try:
        big = Job(ids=np.arange(10, 70, dtype=np.int32), params=params, max_tokens=200, stop=None,
                  want_logprobs=False, emit=lambda *_: None)
        with pytest.raises(lily.RequestError, match=r"needs .* MiB .* KV budget is .* MiB"):
            sched.submit(big)
        done = threading.Semaphore(0)
        results = {}
        running_at_chunks = []

        def emit_for(i):
            def emit(kind, payload):
                if kind == "chunk":
                    running_at_chunks.append(len(sched.running))
                if kind in ("done", "error"):
                    results[i] = (kind, payload)
                    done.release()
            return emit

        for i in range(3):
            sched.submit(Job(ids=np.arange(10 + i, 40 + i, dtype=np.int32), params=params, max_tokens=30, stop=None,
                             want_logprobs=False, emit=emit_for(i)))
        for _ in range(3):
            assert done.acquire(timeout=120)
        assert all(kind == "done" for kind, _ in results.values()), results
        assert sched.stats.completed == 3 and sched.kv_reserved == 0
        assert running_at_chunks and max(running_at_chunks) == 1, "two requests ran beyond the KV budget"
    finally:
        sched.shutdown()


@pytest.fixture(scope="module")
def gpu(store):
    return lily.Model.load(store.mlx("qwen3_5_moe", 4), backend="msl-cpu")


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9)])
def test_gpu_threads_get_their_solo_answers_in_shared_passes(gpu, sampling):
    """A GPU backend (msl-cpu) batches too: a Model there (and `lily serve`) defaults to the
    rows of one pass (7); threads calling generate share the device loop's steps and each gets
    the tokens it gets alone, among them a prompt of 9 tokens, more than a pass of several
    sequences holds (it prefills alone, ending the loop)."""
    from lily.model import default_max_batch

    assert gpu.batches and default_max_batch(gpu._engine) == gpu._engine.batch_rows == gpu.max_batch == 7
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3], list(range(20, 29))]
    kw = [dict(max_tokens=6, seed=5 + i, repetition_penalty=1, **sampling) for i in range(len(prompts))]
    solo = [gpu.generate(p, **k).tokens for p, k in zip(prompts, kw, strict=True)]
    stats = gpu._batcher.stats
    stats.max_sequences = stats.max_device_sequences = 0
    assert _in_threads(lambda i: gpu.generate(prompts[i], **kw[i]).tokens, len(prompts)) == solo
    assert stats.max_device_sequences > 1, "no device-loop step held two sequences: nothing was batched there"
