"""Whole-model decode through the Metal backend's dispatch sequence, run by the MSL-on-CPU
runtime (backend="msl-cpu"), on tiny 4-bit checkpoints of each model type converted by mlx-lm.

- Logits of prefill and of every decode step against mlx-lm on the same bytes (TOL_MLX, top-1
  at every position) and against lily's CPU backend; greedy generation equals mlx-lm's.
- The attention route thresholds are lowered (backend_options) so one sequence crosses them:
  prefill and the first decode steps take the single pass, later steps split-K + combine.
- A decode step under the runtime's dependency-checking mode (every group of dispatches that
  the hazard tracker left without a barrier also runs in reverse) and randomized thread
  interleavings: no missing edge, no missing barrier.
- One command buffer and one CPU wait per decode step; snapshots and forks of the GPU state.

The fiber runtime is slow: the tiny models and few tokens keep this file near a minute.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from fixtures import cases
from fixtures.references import rel_err

TOL = cases.TOL_MLX
# Decode contexts 15..23 (prefill 14): single pass up to 18 positions, split-K (splits of 4
# positions, the last one partial) beyond.
ROUTES = dict(split_threshold=18, split_len=4)
MODELS = [("qwen3_5_moe", 4, 64, "bfloat16"), ("qwen3_5", 4, 64, None), ("qwen3_next", 4, 64, None)]


def _check(got, want, what, tol=TOL):
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.0e}"
    bad = np.nonzero(got.reshape(-1, got.shape[-1]).argmax(-1) != want.reshape(-1, want.shape[-1]).argmax(-1))[0]
    assert bad.size == 0, f"{what}: top-1 differs at rows {bad.tolist()}"


@pytest.fixture(scope="module", params=[pytest.param(m, id=cases.case_id(m)) for m in MODELS])
def case(request, store, lily):
    path = store.mlx(*request.param)
    # max_batch=1: one generation at a time (batched generations: tests/test_device_batch.py).
    gpu = lily.Model.load(path, backend="msl-cpu", backend_options={**ROUTES, **cases.F32_KV}, max_batch=1)
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32")
    return gpu, cpu, store.mlx_reference(path)


def test_prefill_then_decode(case):
    gpu, cpu, ref = case
    s, c = gpu.session(), cpu.session()
    n = cases.DECODE_SPLIT
    got = s.prefill(cases.PROMPT[:n], all_logits=True)
    _check(got, ref.prompt[:n], "prefill vs mlx-lm")
    _check(got, c.prefill(cases.PROMPT[:n], all_logits=True), "prefill vs cpu backend")
    for i in range(n, len(cases.PROMPT)):
        route = "split-K" if i + 1 > ROUTES["split_threshold"] else "single pass"
        got = s.decode(cases.PROMPT[i])
        _check(got, ref.prompt[i], f"decode at position {i} ({route}) vs mlx-lm")
        _check(got, c.decode(cases.PROMPT[i]), f"decode at position {i} ({route}) vs cpu backend")


def test_greedy_generation(case):
    gpu, cpu, ref = case
    got = gpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS).tokens
    assert got == ref.gen_tokens, "greedy tokens differ from mlx-lm's"
    assert got == cpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS).tokens


def test_one_pass_and_one_wait_per_decode_step(case):
    gpu, _, _ = case
    s = gpu.session()
    s.prefill(cases.PROMPT[:3])
    d0, b0, cb0, w0, _ = gpu._engine.gpu_stats
    for tok in cases.PROMPT[3:6]:
        s.decode(tok)
    d1, b1, cb1, w1, _ = gpu._engine.gpu_stats
    assert (cb1 - cb0, w1 - w0) == (3, 3), "a decode step must be one command buffer and one CPU wait"
    assert b1 - b0 < d1 - d0, "the hazard tracker placed a barrier before every dispatch"


def test_device_greedy_pipelined(case):
    """Engine.generate_greedy on a GPU backend: the argmax is written on the device into the
    next step's input slot and step N+1 is committed before step N's token is read (two steps
    in flight). Tokens equal mlx-lm's greedy ones; stopping early discards the step made past
    the stop, so the state continues exactly as if decoded token by token."""
    gpu, cpu, ref = case
    eng = gpu._engine
    s = gpu.session()
    s.prefill(cases.GEN_PROMPT[:-1])
    cb0, w0 = eng.gpu_stats[2:4]
    got = eng.generate_greedy(s._state, cases.GEN_PROMPT[-1], cases.GEN_TOKENS)
    _, _, cb1, w1, in_flight = eng.gpu_stats
    assert got == ref.gen_tokens
    assert s.position == len(cases.GEN_PROMPT) + cases.GEN_TOKENS - 1
    assert (cb1 - cb0, w1 - w0, in_flight) == (cases.GEN_TOKENS, cases.GEN_TOKENS, 2)

    stop = 4  # stop after the 5th token: the 6th step was already committed and must be undone
    s = gpu.session()
    s.prefill(cases.GEN_PROMPT[:-1])
    got = eng.generate_greedy(s._state, cases.GEN_PROMPT[-1], cases.GEN_TOKENS, [ref.gen_tokens[stop]])
    assert got == ref.gen_tokens[:stop + 1]
    assert s.position == len(cases.GEN_PROMPT) + stop
    want = cpu.session().prefill(cases.GEN_PROMPT + ref.gen_tokens[:stop + 1])
    _check(s.decode(got[-1]), want, "decode after a discarded pipelined step vs cpu backend")


# Requests Model.generate runs in the device loop: greedy, and seeded draws with every filter.
DEVICE_REQUESTS = [dict(temperature=0), dict(temperature=0.9, seed=1),
                   dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=2), dict(temperature=1.3, seed=3)]


def test_generate_chooses_tokens_on_the_device(case, lily, monkeypatch):
    """Model.generate on a GPU backend: after the first token every token is chosen on the
    device (argmax or the seeded draw) and fed to the next step there. The GPU sampler is
    bit-identical to the CPU sampler, so with a seed the tokens equal the CPU backend's (the
    logits agree to ~1e-5, far from moving a draw across a boundary at these sizes). Requests
    that need the logits on the host (penalties, logprobs) take the host loop and agree too."""
    gpu, cpu, _ = case
    loops = []
    device_loop = lily.Session.device_loop

    def spy(self, *args):
        loop = device_loop(self, *args)
        loops.append((self._model is gpu, loop is not None))
        return loop

    monkeypatch.setattr(lily.Session, "device_loop", spy)
    for kw in DEVICE_REQUESTS:
        got = gpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS, **kw)
        want = cpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS, **kw)
        assert got.tokens == want.tokens, f"{kw}: msl-cpu {got.tokens}, cpu {want.tokens}"
        assert got.finish_reason == want.finish_reason == "length"
    assert [on for is_gpu, on in loops if is_gpu] == [True] * len(DEVICE_REQUESTS)
    assert not any(on for is_gpu, on in loops if not is_gpu), "the CPU backend has no device loop"

    loops.clear()
    for kw in (dict(temperature=0.8, seed=4, repetition_penalty=1.3), dict(temperature=0.8, seed=5, logprobs=True)):
        got = gpu.generate(cases.GEN_PROMPT, max_tokens=6, **kw).tokens
        assert got == cpu.generate(cases.GEN_PROMPT, max_tokens=6, **kw).tokens
    assert loops == [], "penalties and logprobs must keep the host loop"

    # An end-of-sequence token met in the device loop stops generation like on the host.
    first = gpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS, **DEVICE_REQUESTS[2]).tokens
    eos = first[6]
    monkeypatch.setattr(type(gpu), "eos_token_ids", property(lambda self: (eos,)))
    got = gpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS, **DEVICE_REQUESTS[2])
    assert got.tokens == first[:first.index(eos)] and got.finish_reason == "stop"


def test_sampled_device_loop_stops_and_rolls_back(case, lily):
    """Engine-level: the device continues the host sampler's stream; ending the loop undoes the
    step already committed past the last token read, so the state continues exactly like the
    CPU backend's after decoding the same tokens one by one."""
    from lily._core import Sampler, SamplingParams

    gpu, cpu, _ = case
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=21)
    c = cpu.session()
    logits = c.prefill(cases.GEN_PROMPT)
    ref, want = Sampler(params), []
    for _ in range(5):
        want.append(ref.sample(logits)[0])
        logits = c.decode(want[-1])

    s = gpu.session()
    sampler = Sampler(params)
    first = sampler.sample(s.prefill(cases.GEN_PROMPT))[0]
    assert first == want[0]
    eng = gpu._engine
    assert eng.begin_device_decode(s._state, first, 10, sampler)
    with pytest.raises(lily.RequestError, match="device decode loop"):
        gpu.session().prefill(cases.GEN_PROMPT[:2])  # nothing may interleave with the loop
    got = [first] + [eng.next_device_token(s._state) for _ in range(3)]
    eng.end_device_decode(s._state)
    assert got == want[:4]
    assert s.position == len(cases.GEN_PROMPT) + 3, "the step past the last read token was not undone"
    _check(s.decode(got[-1]), logits_after(cpu, cases.GEN_PROMPT + got), "decode after the device loop vs cpu")


def test_device_loop_refuses_penalties_even_when_greedy(case, lily):
    """The device argmax cannot apply a repetition penalty or report logprobs: asking for either
    is an error whether the sampler draws or is greedy (temperature 0), never a silent skip."""
    from lily._core import Sampler, SamplingParams

    gpu, _, _ = case
    s = gpu.session()
    first = int(np.argmax(s.prefill(cases.GEN_PROMPT)))
    for kw in (dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.0, top_logprobs=2),
               dict(temperature=1.0, presence_penalty=0.5)):
        with pytest.raises(lily.RequestError, match="penalties and logprobs need the logits on the host"):
            gpu._engine.begin_device_decode(s._state, first, 4, Sampler(SamplingParams(**kw)))
    assert s.position == len(cases.GEN_PROMPT), "a refused loop leaves the state as it was"


def logits_after(model, tokens):
    return model.session().prefill(tokens)


def test_block_kv_layout_across_the_threshold(store, lily):
    """Prefill in chunks of 3 with block_threshold 5 and blocks of 2 positions: the first chunk
    stays in the contiguous cache, the second moves it into blocks, the fifth adds a second
    arena (growth without copying); chunks run the flash prefill over blocks; decode steps past
    split_threshold take split-K over blocks.
    Logits of every position and greedy tokens against mlx-lm and the CPU backend."""
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    ref = store.mlx_reference(path)
    opts = dict(split_threshold=18, split_len=4, block_threshold=5, block_len=2, **cases.F32_KV)
    gpu = lily.Model.load(path, backend="msl-cpu", prefill_chunk=3, backend_options=opts)
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32")
    s, c = gpu.session(), cpu.session()
    n = cases.DECODE_SPLIT
    gpu._engine.gpu_records(True)
    got = s.prefill(cases.PROMPT[:n], all_logits=True)
    kernels = [r[0] for r in gpu._engine.gpu_records(True)]
    assert {"attn_prepare_float", "attn_prepare_blocks_float", "attn_prefill_blocks_float_d96"} <= set(kernels), \
        "no layout switch, or no flash prefill over blocks"
    _check(got, ref.prompt[:n], "prefill across the block threshold vs mlx-lm")
    _check(got, c.prefill(cases.PROMPT[:n], all_logits=True), "prefill across the block threshold vs cpu")
    for i in range(n, len(cases.PROMPT)):
        got = s.decode(cases.PROMPT[i])
        _check(got, ref.prompt[i], f"block decode at position {i} vs mlx-lm")
        _check(got, c.decode(cases.PROMPT[i]), f"block decode at position {i} vs cpu backend")
    kernels = [r[0] for r in gpu._engine.gpu_records(False)]
    assert "attn_decode_blocks_float_d96" in kernels and "attn_combine" in kernels, "split-K over blocks not taken"
    assert "attn_decode_float_d96" not in kernels
    got = gpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS).tokens
    assert got == ref.gen_tokens == cpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS).tokens


def test_state_fork_and_snapshot(case):
    gpu, _, ref = case
    s = gpu.session()
    n = cases.DECODE_SPLIT
    s.prefill(cases.PROMPT[:n])
    twin = s.fork()
    snap = s._state.snapshot()
    first = s.decode(cases.PROMPT[n])
    _check(twin.decode(cases.PROMPT[n]), first, "forked state")
    s.decode(cases.PROMPT[n + 1])
    s._state.restore(snap)
    _check(s.decode(cases.PROMPT[n]), ref.prompt[n], "decode after restoring a snapshot")


def test_decode_step_has_no_missing_dependency(store, lily):
    """check_dependencies reruns every barrier-free group of dispatches in reverse; the
    interleaving mode reruns each dispatch with random thread orders. Any undeclared data edge
    or missing threadgroup barrier raises LilyError naming the kernels."""
    path = store.mlx("qwen3_next", 4)  # grouped projections + a dense MLP layer + MoE layers
    model = lily.Model.load(path, backend="msl-cpu",
                            backend_options=dict(split_threshold=4, split_len=2, check_dependencies=True,
                                                 interleavings=1, **cases.F32_KV))
    s = model.session()
    s.prefill(cases.PROMPT[:4])
    for tok in cases.PROMPT[4:6]:  # contexts 5 and 6: split-K route
        got = s.decode(tok)
    _check(got, store.mlx_reference(path).prompt[5], "checked decode step vs mlx-lm")


def test_qwen3_5_moe_dependency_check(store, lily):
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    model = lily.Model.load(path, backend="msl-cpu", backend_options=dict(check_dependencies=True, **cases.F32_KV))
    s = model.session()
    s.prefill(cases.PROMPT[:2])
    _check(s.decode(cases.PROMPT[2]), store.mlx_reference(path).prompt[2], "checked decode step vs mlx-lm")


def test_gemv_word_loads_match_vector_loads(store, lily):
    """backend_options gemv_words=True (the decode GEMVs read 32-bit words, the earlier kernels'
    reads: the A/B knob of scripts/h200/fullsize.py) against the default 16-byte loads: both
    match the CPU backend, and the two differ only by the order of float sums."""
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32").session()
    runs = {}
    for words in (False, True):
        model = lily.Model.load(path, backend="msl-cpu", backend_options=dict(gemv_words=words, **cases.F32_KV))
        s = model.session()
        s.prefill(cases.PROMPT[:3])
        runs[words] = np.asarray(s.decode(cases.PROMPT[3]))
    cpu.prefill(cases.PROMPT[:3])
    want = np.asarray(cpu.decode(cases.PROMPT[3]))
    for words, got in runs.items():
        _check(got, want, f"decode step vs cpu backend (gemv_words={words})")
    assert rel_err(runs[True], runs[False]) < 1e-5
    # ... and the default did take the 16-byte path (its sums run in another order: not bit-equal)
    assert not np.array_equal(runs[True], runs[False])


def test_decode_under_address_sanitizer(store, lily):
    """Every kernel of a prefill (its 4 tokens on the GEMM route: gemm_min_rows = 3) and of
    decode steps on both attention routes, built with
    AddressSanitizer (activation, state and KV buffers are exact-size allocations): no
    out-of-bounds access, and the same logits as the CPU backend."""
    import os
    import subprocess
    import textwrap
    from pathlib import Path

    from test_msl_cpu_bugs import _asan_runtime, _clang_file

    path = store.mlx("qwen3_next", 4)
    script = textwrap.dedent(f"""
        import numpy as np, lily
        from fixtures import cases
        from fixtures.references import rel_err
        gpu = lily.Model.load({str(path)!r}, backend="msl-cpu",
                              backend_options=dict(asan=True, split_threshold=4, split_len=2, gemm_min_rows=3,
                                                   kv_dtype="float32"))
        cpu = lily.Model.load({str(path)!r}, backend="cpu", cpu_matmul="f32")
        s, c = gpu.session(), cpu.session()
        errs = [rel_err(s.prefill(cases.PROMPT[:4]), c.prefill(cases.PROMPT[:4]))]
        errs += [rel_err(s.decode(t), c.decode(t)) for t in cases.PROMPT[4:6]]
        print("max rel err", max(errs), flush=True)
    """)
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, LD_PRELOAD=_asan_runtime(), ASAN_OPTIONS="detect_leaks=0",
               ASAN_SYMBOLIZER_PATH=_clang_file("-print-prog-name", "llvm-symbolizer", "llvm-19"),
               PYTHONPATH=os.pathsep.join([str(Path(lily.__file__).resolve().parent.parent), str(tests)]))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    err = float(r.stdout.split("max rel err")[1])
    assert err <= TOL, f"rel err {err:.2e} under ASan"


def test_default_half_precision_kv_cache(store, lily):
    """The GPU backends' default KV cache is float16: half the cache's bytes per position; k and
    v are rounded to f16 once (relative 2^-11), scores and sums stay f32, so logits stay within
    1e-3 of mlx-lm's f32 (and of the CPU backend's) with the same top-1, and greedy tokens are
    the CPU backend's. kv_dtype="float32" is the reference option, "auto" the default."""
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    ref = store.mlx_reference(path)
    model = lily.Model.load(path, backend="msl-cpu", backend_options=ROUTES)
    f32 = lily.Model.load(path, backend="msl-cpu", backend_options={**ROUTES, **cases.F32_KV})
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32")
    assert (model._engine.kv_dtype, f32._engine.kv_dtype) == ("float16", "float32")
    # Half the bytes per position: a working set with room for 100.5 f32 positions beside the
    # weights and the DeltaNet state fits 100 of them, or 201 in float16.
    from test_gpu_host import _sizes

    weights, per_f32_position, fixed = _sizes(path)
    ws = dict(working_set=weights + fixed + 100 * per_f32_position + per_f32_position // 2)
    fits = {kv: lily.Model.load(path, backend="msl-cpu", backend_options=dict(ws, kv_dtype=kv))._engine.max_fitting_context
            for kv in ("float32", "auto")}
    assert fits == {"float32": 100, "auto": 201}
    s = model.session()
    n = cases.DECODE_SPLIT
    for i, got in enumerate([s.prefill(cases.PROMPT[:n], all_logits=True)]
                            + [s.decode(cases.PROMPT[i])[None] for i in range(n, len(cases.PROMPT))]):
        want = ref.prompt[:n] if i == 0 else ref.prompt[n + i - 1][None]
        _check(got, want, f"step {i} with the default float16 KV cache vs mlx-lm", tol=1e-3)
    assert rel_err(got, ref.prompt[-1][None]) > 0  # (f16 rounding is visible: not the f32 cache's path)
    want = cpu.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS, repetition_penalty=1).tokens
    assert model.generate(cases.GEN_PROMPT, max_tokens=cases.GEN_TOKENS, repetition_penalty=1).tokens == want
    with pytest.raises(lily.ConfigError, match="kv_dtype"):
        lily.Model.load(path, backend="msl-cpu", backend_options=dict(kv_dtype="int8"))


def test_backend_errors(store, lily):
    path = store.mlx("qwen3_5", 4)
    if sys.platform != "darwin":
        with pytest.raises(lily.ConfigError, match="msl-cpu"):
            lily.Model.load(path, backend="metal")  # Linux builds have no Metal
    with pytest.raises(lily.ConfigError, match="unknown backend"):
        lily.Model.load(path, backend="cuda")


def test_kernel_sources_are_embedded(store, lily, tmp_path):
    """The kernels and the MSL-on-CPU prelude come from the extension itself: a fresh process
    whose LILY_SOURCE_DIR is an empty folder, whose cwd is elsewhere and whose kernel cache is
    empty decodes with backend="msl-cpu" and matches the CPU backend."""
    import os
    import subprocess
    import textwrap
    from pathlib import Path

    path = store.mlx("qwen3_5", 4)
    script = textwrap.dedent(f"""
        import numpy as np, lily
        gpu = lily.Model.load({str(path)!r}, backend="msl-cpu", backend_options=dict(kv_dtype="float32"))
        cpu = lily.Model.load({str(path)!r}, backend="cpu", cpu_matmul="f32")
        prompt = {cases.PROMPT[:5]!r}
        s, c = gpu.session(), cpu.session()
        got = [s.prefill(prompt)] + [s.decode(t) for t in prompt[:2]]
        want = [c.prefill(prompt)] + [c.decode(t) for t in prompt[:2]]
        err = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))
        print("max rel err", err, flush=True)
    """)
    empty, cache, cwd = tmp_path / "empty", tmp_path / "cache", tmp_path / "elsewhere"
    for d in (empty, cache, cwd):
        d.mkdir()
    env = dict(os.environ, LILY_SOURCE_DIR=str(empty), LILY_MSL_CPU_CACHE=str(cache),
               PYTHONPATH=str(Path(lily.__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert float(r.stdout.split("max rel err")[1]) <= TOL
    assert not any(empty.iterdir())
    trees = list(cache.glob("sources-*"))
    assert len(trees) == 1 and (trees[0] / "csrc/msl_cpu/prelude/metal_stdlib").is_file()
    assert (trees[0] / "metal/sampling.metal").is_file()
