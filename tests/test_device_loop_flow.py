"""The device decode loop in every entry point of the one generation flow (lily.request):
``Chat`` turns and the server's jobs choose tokens on the device (GPU backends) as
``Model.generate`` does, and the session records each token the loop feeds it, so rewinding,
the next turn and the server's prefix cache work as after host decoding.

Backend: msl-cpu (the Metal kernels on the CPU) with a float32 KV cache, on the demo model.
Reference: the CPU backend (cpu_matmul="f32"), which has no device loop and decodes on the host;
its tokens, and its sessions' token lists, must be equal. A spy on ``Batcher.device_row`` and
the batcher's count of device-loop steps check that the msl-cpu runs really took the device loop
(so a flow that silently fell back to the host loop fails), and that the CPU runs did not.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import lily
from lily.batching import Batcher

# repetition_penalty=1: the demo's default penalty needs the logits on the host.
GREEDY = dict(temperature=0, repetition_penalty=1)
SEEDED = dict(temperature=0.9, top_k=40, seed=7, repetition_penalty=1)


@pytest.fixture(scope="module")
def models():
    gpu = lily.Model.load(backend="msl-cpu", backend_options={"kv_dtype": "float32"})
    cpu = lily.Model.load(backend="cpu", cpu_matmul="f32")
    return gpu, cpu


@pytest.fixture
def device_loops(monkeypatch):
    """(model is the msl-cpu one, it got a device row) for each Batcher.device_row."""
    started = []
    real = Batcher.device_row

    def spy(self, *args, **kwargs):
        row = real(self, *args, **kwargs)
        started.append((self._engine.backend != "cpu", row is not None))
        return row

    monkeypatch.setattr(Batcher, "device_row", spy)
    return started


def _fed(prompt: list[int], result: lily.GenerationResult) -> list[int]:
    """The tokens a sequence holds after generating ``result`` from ``prompt``: the last sampled
    token is never fed (nothing reads its logits); an end-of-sequence token is not in ``tokens``."""
    out = result.tokens if result.finish_reason == "stop" else result.tokens[:-1]
    return prompt + out


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chat_turns_take_the_device_loop(models, device_loops, sampling):
    """Two chat turns on msl-cpu: the same tokens as the CPU backend's host loop, the second turn
    reusing the first (prompt and answer: the device loop recorded it), and the conversation's
    session holding exactly the rendered prompt + the answer fed to it."""
    runs = {}
    for model in models:
        chat = model.chat(system="You are terse.", max_tokens=10, **sampling)
        turns = []
        for text in ("Tell me about foxes.", "And crows?"):
            prompt = model.tokenizer.encode(model.render_chat(chat.messages + [{"role": "user", "content": text}]))
            result = chat.send(text)
            turns.append(result)
            assert chat._seq.tokens == _fed(prompt, result), f"{model._engine.backend}: the session's tokens"
            assert chat.position == len(chat._seq.tokens)
        runs[model._engine.backend] = turns
    gpu, cpu = runs["msl-cpu"], runs["cpu"]
    assert [r.tokens for r in gpu] == [r.tokens for r in cpu]
    assert gpu[1].cached_tokens == cpu[1].cached_tokens > len(gpu[0].tokens)  # the first answer reused
    assert [on for is_gpu, on in device_loops if is_gpu] == [True, True]
    assert not any(on for is_gpu, on in device_loops if not is_gpu), "the CPU backend has no device loop"


def _run_job(sched, ids: np.ndarray, params, max_tokens: int, n: int = 1) -> list[lily.GenerationResult]:
    from lily.scheduler import Job

    done = threading.Event()
    results, errors = [], []

    def emit(kind, value):
        if kind == "done":
            results.append(value)
        elif kind == "error":
            errors.append(value)
        if errors or len(results) == n:
            done.set()

    sched.submit(Job(ids=ids, params=params, max_tokens=max_tokens, stop=None, want_logprobs=False, emit=emit,
                     n=n))
    assert done.wait(300), "the job did not finish"
    assert not errors, errors
    return results


def test_server_jobs_take_the_device_loop_and_hit_the_prefix_cache(models, device_loops):
    """Scheduler jobs on msl-cpu: a prompt, the same prompt again (a prefix-cache hit), a
    follow-up extending prompt + answer (a hit on every token the device loop fed: none lost)
    and n = 2 seeded choices give the CPU backend's tokens; the cached session holds prompt +
    answer."""
    from lily.generation import sampling_params
    from lily.scheduler import Scheduler

    gpu, cpu = models
    ids = gpu.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then")
    sched = Scheduler(gpu, max_snapshots=8)
    try:
        def params(**kw):
            return sampling_params(gpu.generation_defaults.sampling_kwargs(), {**GREEDY, **kw}, None)

        first = _run_job(sched, np.asarray(ids, np.int32), params(), 12)[0]
        want = cpu.generate(ids, max_tokens=12, **GREEDY)
        assert first.tokens == want.tokens and first.cached_tokens == 0
        (held,) = sched.cache._entries
        assert held.tokens == _fed(ids, first), "the cached session's tokens"

        again = _run_job(sched, np.asarray(ids, np.int32), params(), 12)[0]
        assert again.tokens == want.tokens and again.cached_tokens == len(ids) - 1  # its last token prefilled again

        follow = _fed(ids, first) + gpu.tokenizer.encode(" And then")
        got = _run_job(sched, np.asarray(follow, np.int32), params(), 8)[0]
        assert got.cached_tokens == len(_fed(ids, first)), "the answer the device loop fed was not reused"
        assert got.tokens == cpu.generate(follow, max_tokens=8, **GREEDY).tokens

        choices = _run_job(sched, np.asarray(ids, np.int32), params(temperature=0.9, seed=3), 10, n=2)
        assert [c.tokens for c in choices] == [cpu.generate(ids, max_tokens=10, **{**GREEDY, "temperature": 0.9,
                                                                                   "seed": 3 + i}).tokens
                                               for i in range(2)]
    finally:
        sched.shutdown()
    assert [on for is_gpu, on in device_loops if is_gpu] == [True] * 5  # 3 jobs + 2 choices


def test_server_snapshots_during_the_device_loop_are_the_host_loops(models, device_loops):
    """The server keeps snapshots after 16, 32, 64, ... generated tokens for its prefix cache
    (lily.request: ``snapshot_decoded``). The device loop pauses for them, so a job on msl-cpu
    leaves the cached sequence with snapshots at the same positions as the CPU backend's host
    loop, the same tokens, and a follow-up that shares only the prompt and the answer's first 20
    tokens reuses the first 16 from the snapshot on both."""
    from lily.generation import sampling_params
    from lily.scheduler import Scheduler

    ids = models[0].tokenizer.encode("Write a long story about a fox and a crow.")
    got = {}
    for model in models:
        sched = Scheduler(model, max_snapshots=8)
        try:
            params = sampling_params(model.generation_defaults.sampling_kwargs(), GREEDY, None)
            result = _run_job(sched, np.asarray(ids, np.int32), params, 40)[0]
            assert result.finish_reason == "length", "the answer must run past 32 tokens"
            (held,) = sched.cache._entries
            positions = [s.position for s in held.snapshots]
            follow = ids + result.tokens[:20] + model.tokenizer.encode(" Meanwhile")
            again = _run_job(sched, np.asarray(follow, np.int32), params, 4)[0]
        finally:
            sched.shutdown()
        got[model._engine.backend] = (result.tokens, positions, again.cached_tokens, again.tokens)
    gpu, cpu = got["msl-cpu"], got["cpu"]
    assert {len(ids) + 16, len(ids) + 32} <= set(cpu[1]), cpu[1]
    assert gpu == cpu
    assert cpu[2] == len(ids) + 16
    assert [on for is_gpu, on in device_loops if is_gpu] == [True, True]
