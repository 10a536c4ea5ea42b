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
