"""The plan report (benchmarks/metal_plan.py) counts the dispatch sequence that really runs.

- lily._core.gpu_plan (GpuBackend over a recording device, synthetic weights) encodes the same
  number of dispatches and barriers for a decode step as the MSL-on-CPU run of a real tiny
  checkpoint at the same context, on both attention routes.
- At the 35B shape the bytes the dispatches declare equal the minimum computed from the config
  alone to within the activations (a few percent), at 4K / 32K / 128K, with one command buffer
  and one CPU wait per token.
"""

from __future__ import annotations

import importlib.util

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
