"""The plan report (benchmarks/metal_plan.py) counts the dispatch sequence that really runs.

- lily._core.gpu_plan (GpuBackend over a recording device, synthetic weights) encodes the same
  number of dispatches and barriers for a decode step as the MSL-on-CPU run of a real tiny
  checkpoint at the same context, on both attention routes.
- At the 35B shape the bytes the dispatches declare equal the minimum computed from the config
  alone to within the activations (a few percent), at 4K / 32K / 128K, with one command buffer
  and one CPU wait per token.
- Every decode dispatch that moves over 1 MB at the 35B shape has at least 64 threadgroups (an
  M-series GPU has 10-40 cores: fewer cannot stream at full bandwidth), at 1K to 128K.
- --json reports every dispatch and the step totals, and labels its tokens/s as an estimate.
- A decode step of B sequences (continuous batching) is the dispatch sequence msl-cpu runs for
  decode_batch; at the 35B shape B <= 7 sequences are one pass that reads the dense weights
  once (each row adds its embedding row and its experts, min(B*k, E) per layer, and its own
  state) in as many dependency stages as one sequence's step, 8 are two passes (7 + 1: passes
  of several sequences stay below the GEMM route).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from fixtures import cases

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _plan_module():
    spec = importlib.util.spec_from_file_location("metal_plan", ROOT / "benchmarks" / "metal_plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("threshold", [100, 4])  # single pass, split-K
def test_plan_matches_executed_dispatches(store, lily, threshold):
    from lily import _core

    path = store.mlx("qwen3_5_moe", 4)
    model = lily.Model.load(path, backend="msl-cpu", backend_options=dict(split_threshold=threshold, split_len=2))
    s = model.session()
    s.prefill(cases.PROMPT[:6])
    d0, b0 = model._engine.gpu_stats[:2]
    s.decode(cases.PROMPT[6])
    d1, b1 = model._engine.gpu_stats[:2]
    rows, (dispatches, barriers, cbs, waits), _ = _core.gpu_plan(
        model.config.to_native(), 7, 4, 64, 8, split_threshold=threshold, split_len=2)
    assert (dispatches, barriers) == (d1 - d0, b1 - b0)
    assert (cbs, waits) == (1, 1)
    assert len(rows) == dispatches
    assert ("attn_combine" in {r[0] for r in rows}) == (threshold < 7)


def test_batched_plan_matches_executed_dispatches(store, lily):
    """Three sequences at position 6 decode in one pass: the plan's dispatches and barriers are
    the msl-cpu run's."""
    from lily import _core

    model = lily.Model.load(store.mlx("qwen3_5_moe", 4), backend="msl-cpu")
    engine = model._engine
    states = [engine.new_state(16) for _ in range(3)]
    for i, st in enumerate(states):
        engine.prefill(st, np.asarray(cases.PROMPT[i:i + 6], np.int32), False)
    d0, b0, c0 = engine.gpu_stats[:3]
    engine.decode_batch(states, np.asarray(cases.PROMPT[6:9], np.int32))
    d1, b1, c1 = engine.gpu_stats[:3]
    rows, (dispatches, barriers, cbs, waits), _ = _core.gpu_plan(model.config.to_native(), 7, 4, 64, 8, batch=3)
    assert (dispatches, barriers, cbs) == (d1 - d0, b1 - b0, c1 - c0) == (len(rows), barriers, 1)


def test_batched_decode_plan_at_35b_shape():
    mp = _plan_module()
    c = mp.config_35b()
    H, k, E = c.hidden, c.top_k, c.n_experts
    expert = 2 * mp.qbytes(c.moe_intermediate, H) + mp.qbytes(H, c.moe_intermediate)
    m = mp.minimum_bytes(c, 4096)
    one = mp.plan(c, 4096, True)
    per_token = {}
    for B, passes in ((1, 1), (4, 1), (7, 1), (8, 2)):
        bp = mp.batch_plan(c, 4096, B)
        assert bp["passes"] == passes
        if passes == 1:
            assert bp["stages"] == one["stages"]  # the segments' mixer dispatches share stages
            want = m["dense weights"] + (B - 1) * mp.qbytes(1, H) + mp.LAYERS * min(B * k, E) * expert
            assert bp["totals"]["weight_bytes"] == want
        assert bp["totals"]["state_bytes"] == B * one["state"]
        per_token[B] = bp["per_token"]["total_bytes"]
    assert per_token[7] < per_token[4] < 0.6 * per_token[1]


def test_plan_bytes_at_35b_shape():
    mp = _plan_module()
    c = mp.config_35b()
    for ctx in (4096, 32768, 131072):
        for kv_half in (False, True):
            p, m = mp.plan(c, ctx, kv_half), mp.minimum_bytes(c, ctx, 2 if kv_half else 4)
            assert (p["command buffers"], p["CPU waits"]) == (1, 1)
            assert p["weights"] == m["dense weights"] + m["active experts"]
            assert p["state"] == m["KV"] + m["DeltaNet + conv state"]
            total = p["weights"] + p["state"] + p["activations"]
            assert 1.0 <= total / sum(m.values()) < 1.05


def _narrow_dispatches(rows, min_threadgroups=64, min_bytes=1_000_000):
    """(kernel, threadgroups, bytes) of the dispatches moving over min_bytes on fewer threadgroups."""
    return {(r[0], r[5], r[2] + r[3] + r[4]) for r in rows if r[2] + r[3] + r[4] > min_bytes and r[5] < min_threadgroups}


def test_decode_dispatches_fill_the_gpu():
    from lily import _core

    c = _plan_module().config_35b()
    for ctx in (1024, 4096, 32768, 131072):
        for kv_half in (False, True):
            rows, _, _ = _core.gpu_plan(c, ctx, 4, 64, 8, kv_half=kv_half)
            assert not _narrow_dispatches(rows), (ctx, kv_half)
            assert all(r[6] > 0 for r in rows)  # threads per threadgroup recorded for each
    # The rule catches the old route: up to 4K positions on one threadgroup per KV head.
    rows, _, _ = _core.gpu_plan(c, 1024, 4, 64, 8, split_threshold=4096, split_len=1024)
    assert {k for k, _, _ in _narrow_dispatches(rows)} == {"attn_decode_float_d256"}


def test_json_report():
    mp = _plan_module()
    c = mp.config_35b()
    report = __import__("json").loads(__import__("json").dumps(mp.json_report(c, [1024, 32768], [512], 512)))
    assert "unverified on Apple hardware" in report["estimate_note"]
    decode = {(d["context"], d["kv_cache"]): d for d in report["decode"]}
    assert set(decode) == {(1024, "f32"), (32768, "f32"), (1024, "f16"), (32768, "f16")}
    for step in [*report["decode"], *report["prefill_last_chunk"]]:
        ds, tot = step["dispatches"], step["totals"]
        assert set(ds[0]) == {"kernel", "stage", "threadgroups", "threads_per_threadgroup", "weight_bytes",
                              "state_bytes", "other_bytes"}
        assert tot["dispatches"] == len(ds)
        assert tot["stages"] == len({d["stage"] for d in ds})
        for key in ("weight_bytes", "state_bytes", "other_bytes"):
            assert tot[key] == sum(d[key] for d in ds)
    for name in mp.GPU_MODELS:  # longer context, more bytes: slower; f16 KV: faster
        tps = {k: d["estimate"][name]["tokens_per_s"] for k, d in decode.items()}
        assert tps[(32768, "f32")] < tps[(32768, "f16")] < tps[(1024, "f16")]
    assert report["prefill_last_chunk"][0]["last_chunk_tokens"] == 512
    assert [(b["batch"], b["passes"]) for b in report["decode_batches"]] == [(1, 1), (4, 1), (8, 2)]


def test_decode_estimate_model():
    """estimate_decode by hand: 1 GB at 100 GB/s x 0.5 efficiency is 20 ms on a full GPU, twice
    that on half the threadgroups it needs, plus the stage cost."""
    mp = _plan_module()
    d = dict(kernel="k", stage=0, weight_bytes=10**9, state_bytes=0, other_bytes=0, threads_per_threadgroup=32)
    opts = dict(cores=10, bandwidth_gbs=100.0, efficiency=0.5, threadgroups_per_core=2, stage_us=1000.0)
    assert mp.estimate_decode([dict(d, threadgroups=20)], **opts)["step_ms"] == pytest.approx(21.0)
    assert mp.estimate_decode([dict(d, threadgroups=10)], **opts)["step_ms"] == pytest.approx(41.0)


@pytest.mark.parametrize("prompt,chunk", [(8, 3), (4, 8)])  # last chunks of 2 and 4 tokens
def test_prefill_plan_matches_executed_dispatches(store, lily, prompt, chunk):
    """gpu_plan_prefill encodes a prompt the way Engine.generate_greedy runs it (chunks, the last
    one as device greedy step 0): the same dispatches, barriers and command buffers as the
    MSL-on-CPU run, the prefill kernels in place of the decode ones, no CPU wait inside a chunk."""
    from lily import _core

    path = store.mlx("qwen3_5_moe", 4)
    model = lily.Model.load(path, backend="msl-cpu", prefill_chunk=chunk)
    s = model.session()
    d0, b0, cb0, _, _ = model._engine.gpu_stats
    model._engine.generate_greedy(s._state, cases.PROMPT[:prompt], 1)
    d1, b1, cb1, _, _ = model._engine.gpu_stats
    p = _core.gpu_plan_prefill(model.config.to_native(), prompt, chunk)
    dispatches, barriers, cbs, waits = p["total"]
    assert (dispatches, barriers, cbs) == (d1 - d0, b1 - b0, cb1 - cb0)
    assert p["chunks"] == -(-prompt // chunk) and waits == p["chunks"] - 1
    assert p["waits_inside_chunks"] == 0
    names = {r[0] for r in p["last_chunk"]}
    assert {"attn_prefill_float_d96", "gdn_prepare", "gdn_scan_dk48", "sample"} <= names
    assert not names & {"attn_decode_float_d96", "gdn_conv", "gdn_recurrence_dk48"}


def test_prefill_plan_at_35b_shape():
    """A 512-token chunk at the 35B shape: no CPU wait inside any chunk, one between chunks;
    the weights it declares are at least the minimum a chunk must read (every expert is
    reachable by 512 x 8 routed rows); scratch is bounded by the chunk, not the prompt."""
    mp = _plan_module()
    c = mp.config_35b()
    plans = {n: mp.prefill_plan(c, n, 512) for n in (512, 4096)}
    for n, p in plans.items():
        assert p["chunks"] == n // 512 and p["waits in chunk"] == 0 and p["waits"] == p["chunks"] - 1
        assert p["weights"] >= mp.minimum_chunk_weight_bytes(c, 512)
    scratch = {n: p["device"] - p["seq state"] for n, p in plans.items()}
    assert scratch[4096] == scratch[512], "scratch memory grows with the prompt"


@pytest.mark.parametrize("field,value,message", [
    ("head_dim", 80, "head_dim 80 has no attention kernels: the kernels are instantiated for 64, 96, 128, 256"),
    ("gdn_k_dim", 96, "DeltaNet key head dim 96 has no recurrence kernels: the kernels are instantiated for "
                      "32, 48, 64, 128"),
])
def test_head_sizes_without_kernels_are_refused(field, value, message):
    """Head sizes are template parameters of the kernels (their per-lane arrays stay in
    registers); a model whose size has no instantiation is a ConfigError naming the ones there are."""
    import lily
    from lily import _core

    c = _plan_module().config_35b()
    setattr(c, field, value)
    if field == "head_dim":
        c.rotary_dim = 20
    with pytest.raises(lily.ConfigError, match=message):
        _core.gpu_plan(c, 64, 4, 64, 8)


def test_gemv_loads_at_the_35b_shape():
    """The decode GEMVs read 16 bytes per lane per step at the 35B shape (every row a whole number
    of 16-byte runs): 4x fewer serial load steps per simdgroup; moe_down runs its 9 jobs on two
    16-lane teams (256-byte rows) instead of one after another on 32 lanes: 5 steps, not 18."""
    mod = _plan_module()
    rows = mod.gemv_loads(mod.config_35b())
    *gemvs, down = rows
    for r in rows:
        assert r["after"]["load_bytes"] == 16 and r["before"]["load_bytes"] == 4
    for r in gemvs:
        assert r["after"]["steps"] * 4 == r["before"]["steps"]
    assert down["kind"].startswith("moe_down") and down["row_bytes"] == 256
    assert (down["after"]["lanes"], down["after"]["steps"], down["before"]["steps"]) == (16, 5, 18)
