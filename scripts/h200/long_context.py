"""Issue 17: decode steps at the model's long contexts (128K, 256K) through the Metal path on a
real GPU, on a KV cache and DeltaNet state filled synthetically (a 256K prefill would take the
whole device session), checked against the CPU backend on the very same synthetic state.

    python3 scripts/h200/long_context.py CKPT --contexts 131072,262144 --out DIR

For each context C: random K / V rows for every attention layer's positions [0, C), random
DeltaNet conv windows and recurrent states (seeded), imported into a GPU state and a CPU state
(State.import_tensors: the path Session.load uses). Then --decode greedy steps on both, fed the
GPU's tokens (so a late disagreement does not change what the two compare): per step the
logits' max |diff| against the CPU (f32 mode: the reference), top-1 agreement, finiteness.
The step's recorded dispatches give the bytes it read, compared with gpu_plan's count for the
same context (the plan is what docs and benchmarks/metal_plan.py quote), and with --timing the
per-kernel GPU times at that context (an event pair around every dispatch) and their GB/s.

Value scales: keys pass an RMSNorm before the cache, so their entries are ~N(0, 1); values are
~N(0, 1) too; the recurrent state is small (N(0, 0.02)), as a decayed sum of rank-1 updates of
l2-normalised keys is. Random keys make softmax weights nearly uniform over the whole context,
which is the hard case for the split-K combine (every split contributes).

H200 figures are not Apple figures: they show the kernels at the real shape and context on a
parallel GPU, not how fast a Mac is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import lily
from fullsize import kernel_markdown, kernel_table  # this folder
from lily import _core


def synthetic_state(template: dict, positions: int, seed: int) -> dict:
    """{name: float32 array} shaped like `template` (a fresh state's export) with `positions`
    KV rows of random values."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in sorted(template.items()):
        shape = list(t.shape)
        if name.startswith("kv."):
            shape[1] = positions  # [Hkv, P, D]
            out[name] = rng.standard_normal(shape, dtype=np.float32)
        elif name.endswith(".S"):
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.float32)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--backend", default="msl-cuda", help="msl-cuda (msl-cpu: a local dry run)")
    ap.add_argument("--contexts", default="131072,262144")
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--cpu-matmul", default="f32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--timing", action="store_true", help="per-kernel GPU times (msl-cuda)")
    ap.add_argument("--copy-gbs", type=float, help="the GPU's measured copy bandwidth (scripts/h200/copy_bw.cu)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    contexts = [int(c) for c in a.contexts.split(",")]
    top = max(contexts) + a.decode + 1
    opts = {"timing": True} if a.timing else {}
    gpu = lily.Model.load(a.ckpt, backend=a.backend, max_context=top, backend_options=opts)
    cpu = lily.Model.load(a.ckpt, backend="cpu", cpu_matmul=a.cpu_matmul, threads=a.threads, max_context=top)
    report: dict = {"backend": a.backend, "cpu_matmul": a.cpu_matmul, "contexts": []}
    for c in contexts:
        t0 = time.perf_counter()
        g = gpu._engine.new_state(c + a.decode + 1)
        r = cpu._engine.new_state(c + a.decode + 1)
        tensors = synthetic_state(r.export_tensors(), c, seed=c)
        g.import_tensors(c, tensors)
        r.import_tensors(c, tensors)
        del tensors
        fill_s = time.perf_counter() - t0
        row: dict = {"context": c, "fill_s": fill_s, "steps": []}
        tok = 1
        for step in range(a.decode):
            if step == a.decode - 1:
                gpu._engine.gpu_records(True)  # record the last step's dispatches
                if a.timing:
                    gpu._engine.gpu_timings()  # drop earlier steps'
            t = time.perf_counter()
            lg = np.asarray(gpu._engine.decode(g, tok), dtype=np.float32)
            gpu_s = time.perf_counter() - t
            t = time.perf_counter()
            lc = np.asarray(cpu._engine.decode(r, tok), dtype=np.float32)
            cpu_s = time.perf_counter() - t
            diff = np.abs(lg - lc)
            row["steps"].append({"gpu_s": gpu_s, "cpu_s": cpu_s, "finite": bool(np.isfinite(lg).all()),
                                 "max_abs_diff": float(diff.max()), "logit_scale": float(np.abs(lc).max()),
                                 "top1_same": int(np.argmax(lg)) == int(np.argmax(lc))})
            tok = int(np.argmax(lg))
        records = gpu._engine.gpu_records(False)
        # The plan of a step at the last step's context (make_fullsize.py's 4-bit, group 64,
        # 8-bit gates: gpu_plan's defaults).
        plan, _, _ = _core.gpu_plan(gpu.config.to_native(), context=c + a.decode,
                                    kv_half=gpu._engine.kv_dtype == "float16")
        row["recorded_bytes"] = int(sum(x[2] + x[3] + x[4] for x in records))
        row["plan_bytes"] = int(sum(x[2] + x[3] + x[4] for x in plan))
        row["recorded_dispatches"], row["plan_dispatches"] = len(records), len(plan)
        if a.timing:
            row["kernels"] = kernel_table(records, gpu._engine.gpu_timings())
            row["kernel_ms"] = sum(k["ms"] for k in row["kernels"])
        report["contexts"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        (a.out / "long_context.json").write_text(json.dumps(report, indent=1))
        del g, r
    md = [f"backend {a.backend}, reference cpu {a.cpu_matmul}; synthetic KV + DeltaNet state; "
          "H200 figures, not Apple figures", "",
          "| context | steps | finite | max abs diff (logit scale) | top-1 same | GPU step ms | CPU step ms | "
          "recorded / plan bytes |", "|---:|---:|---|---|---|---:|---:|---|"]
    for r in report["contexts"]:
        st = r["steps"]
        md.append(f"| {r['context']} | {len(st)} | {all(s['finite'] for s in st)} | "
                  f"{max(s['max_abs_diff'] for s in st):.3g} ({max(s['logit_scale'] for s in st):.3g}) | "
                  f"{sum(s['top1_same'] for s in st)}/{len(st)} | {1e3 * min(s['gpu_s'] for s in st):.1f} | "
                  f"{1e3 * min(s['cpu_s'] for s in st):.0f} | {r['recorded_bytes'] / 1e9:.3f} / "
                  f"{r['plan_bytes'] / 1e9:.3f} GB |")
        if "kernels" in r:
            md += kernel_markdown(r["kernels"], f"one decode step at {r['context']}", a.copy_gbs)
    (a.out / "long_context.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    ok = all(s["finite"] and s["top1_same"] for r in report["contexts"] for s in r["steps"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
