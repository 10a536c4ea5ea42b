"""The device scripts of issue 17 (scripts/h200/) and benchmarks/host_loop.py (issue 20), dry-run
on msl-cpu with a tiny checkpoint or the demo model, so a device session does not spend its
minutes finding a broken script.

long_context.py fills a GPU state and a CPU state with the same synthetic KV cache and DeltaNet
state (State.import_tensors) past attention's split threshold, decodes on both and compares
against the CPU backend; the dispatches it records must read exactly the bytes gpu_plan counts
for that context (bf16 scales, as the released checkpoints and make_fullsize.py have: the plan
assumes them), and every step's top-1 must agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "h200"))
import long_context  # noqa: E402


def test_long_context_dry_run(store, tmp_path):
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    rc = long_context.main([str(path), "--backend", "msl-cpu", "--contexts", "300,1100", "--decode", "2",
                            "--out", str(tmp_path)])
    report = json.loads((tmp_path / "long_context.json").read_text())
    assert rc == 0
    assert [r["context"] for r in report["contexts"]] == [300, 1100]
    for r in report["contexts"]:
        assert r["recorded_bytes"] == r["plan_bytes"] and r["recorded_dispatches"] == r["plan_dispatches"]
        for s in r["steps"]:
            assert s["finite"] and s["top1_same"]
            assert s["max_abs_diff"] < 1e-2 * s["logit_scale"]  # f16 KV on the GPU path, f32 on the CPU
    assert "| 1100 | 2 | True |" in (tmp_path / "long_context.md").read_text()


def test_host_loop_dry_run(tmp_path):
    """benchmarks/host_loop.py (the GPU host-loop cost, for the H200 on msl-cuda) on msl-cpu: the
    device loop ran for (a), (a) and (b) gave the same tokens (the script checks both), and the
    report has the three requests."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_loop

    out = tmp_path / "host_loop.json"
    assert host_loop.main(["--backend", "msl-cpu", "--tokens", "4", "--repeat", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["a", "b", "c"]
    assert all(r["ms_per_token_median"] > 0 and r["tokens"] >= 2 for r in report["rows"])
