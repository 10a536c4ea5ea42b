"""Issue 17, phase B: the whole Qwen3.6-35B-A3B shape through the Metal path on a real GPU
(backend="msl-cuda": the .metal kernels as PTX, driven by the same gpu::Device dispatch code
as Metal), checked against the CPU backend, with per-kernel GPU times.

    python3 scripts/h200/fullsize.py CKPT --contexts 512,4096,32768 --check-max 4096 --out DIR

For each context C (random prompt ids, a fixed seed): one GPU session prefills C tokens, then
decodes --decode greedy steps; the prefill and decode rates are wall time around the calls
(each call waits for its logits). Where C <= --check-max the CPU backend runs the same prompt
and steps: last-position logits compared (max |diff|, and their top-1), the greedy tokens
compared. The f32 CPU mode is the reference up to --f32-max tokens (it is ~1.7x slower than
int8 at this shape); above that the default int8 mode, whose own error is ~1% of the logits.
Then a timing pass (backend option timing=True: an event pair around every dispatch) gives the
GPU milliseconds per kernel of one prefill of --timing-prefill tokens and of one decode step.

These are H200 figures of kernels written for Apple GPUs: they show that the kernels run at the
real shape and long contexts and where the GPU time goes, not how fast a Mac is.

--backend-options JSON is passed to the GPU model loads (Model.load backend_options), so two runs
of one build time a kernel change before and after; the decode GEMVs' 16-byte loads (issue 16):

    python3 scripts/h200/fullsize.py CKPT --contexts 512,4096 --check-max 0 --out DIR/after
    python3 scripts/h200/fullsize.py CKPT --contexts 512,4096 --check-max 0 --out DIR/before \
        --backend-options '{"gemv_words": true}'

(gemv_words: 32-bit word reads, as before; the timing pass's decode table then shows the gemv,
moe_gate_up and moe_down milliseconds of each.)
Writes DIR/fullsize.json and DIR/fullsize.md; prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

import lily


def run_session(model, ids: np.ndarray, steps: int) -> dict:
    s = model.session(len(ids) + steps + 1)
    t0 = time.perf_counter()
    logits = np.asarray(s.prefill(ids), dtype=np.float32).reshape(-1)
    t1 = time.perf_counter()
    first = logits.copy()
    tokens = []
    tok = int(np.argmax(logits))
    t2 = time.perf_counter()
    for _ in range(steps):
        tokens.append(tok)
        logits = np.asarray(s.decode(tok), dtype=np.float32).reshape(-1)
        tok = int(np.argmax(logits))
    t3 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t3 - t2, "logits": first, "tokens": tokens,
            "finite": bool(np.isfinite(first).all() and np.isfinite(logits).all())}


def kernel_table(records, timings) -> list[dict]:
    """Records [(kernel, stage, weight, state, other bytes, tgs, threads)] and timings
    [(kernel, ms)] of the same dispatches, in order -> per kernel: dispatches, bytes (the
    records' count of what each dispatch reads and writes), ms and GB/s, by time."""
    if len(records) != len(timings):
        raise RuntimeError(f"{len(records)} recorded dispatches but {len(timings)} timed ones")
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for rec, (name, ms) in zip(records, timings, strict=True):
        if rec[0] != name:
            raise RuntimeError(f"dispatch order differs: recorded {rec[0]}, timed {name}")
        a = agg[name]
        a[0] += 1
        a[1] += rec[2] + rec[3] + rec[4]
        a[2] += ms
    out = [{"kernel": k, "dispatches": int(n), "bytes": int(b), "ms": ms, "gb_s": b / (ms * 1e6) if ms > 0 else 0.0}
           for k, (n, b, ms) in agg.items()]
    return sorted(out, key=lambda r: -r["ms"])


def kernel_markdown(rows: list[dict], title: str, copy_gbs: float | None) -> list[str]:
    """The per-kernel table: time, bytes, GB/s and % of the measured copy bandwidth."""
    total = sum(k["ms"] for k in rows)
    nbytes = sum(k["bytes"] for k in rows)
    pct = (lambda g: f"{100 * g / copy_gbs:.0f}%") if copy_gbs else (lambda g: "-")
    md = ["", f"GPU time by kernel, {title}: {total:.2f} ms, {nbytes / 1e6:.1f} MB, {nbytes / (total * 1e6):.0f} GB/s"
          + (f" (copy bandwidth {copy_gbs:.0f} GB/s)" if copy_gbs else ""), "",
          "| kernel | dispatches | MB | ms | share | GB/s | % of copy |", "|---|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {k['kernel']} | {k['dispatches']} | {k['bytes'] / 1e6:.1f} | {k['ms']:.3f} | "
           f"{100 * k['ms'] / total:.1f}% | {k['gb_s']:.0f} | {pct(k['gb_s'])} |" for k in rows[:20]]
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--backend", default="msl-cuda", help="msl-cuda (msl-cpu: a local dry run)")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--check-max", type=int, default=4096, help="CPU reference up to this context")
    ap.add_argument("--f32-max", type=int, default=4096, help="the f32 CPU mode up to this context")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--timing-prefill", type=int, default=512, help="0: no timing pass")
    ap.add_argument("--warmup", type=int, default=256,
                    help="an untimed prefill of this many tokens and 2 decode steps first (0: none)")
    ap.add_argument("--copy-gbs", type=float, help="the GPU's measured copy bandwidth (scripts/h200/copy_bw.cu)")
    ap.add_argument("--backend-options", type=json.loads, default={},
                    help='JSON for the GPU loads\' backend_options, e.g. \'{"gemv_words": true}\'')
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    contexts = [int(c) for c in a.contexts.split(",")]
    top = max(contexts) + a.decode + 1

    t = time.perf_counter()
    gpu = lily.Model.load(a.ckpt, backend=a.backend, max_context=top, backend_options=a.backend_options or None)
    report: dict = {"backend": a.backend, "backend_options": a.backend_options, "load_s": time.perf_counter() - t,
                    "contexts": []}
    config = json.loads((a.ckpt / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    cpu_models: dict[str, lily.Model] = {}

    def cpu(mode: str) -> lily.Model:
        if mode not in cpu_models:
            cpu_models.clear()  # one CPU copy of the weights at a time
            cpu_models[mode] = lily.Model.load(a.ckpt, backend="cpu", cpu_matmul=mode, threads=a.threads,
                                               max_context=top)
        return cpu_models[mode]

    rng = np.random.default_rng(0)
    if a.warmup:
        # The first use of each kernel pays the driver's PTX -> SASS compile (seconds): without
        # this, that lands in the first context's figures (phase D's 512 row: 30 tok/s prefill).
        run_session(gpu, np.arange(a.warmup, dtype=np.int32) % vocab, 2)
    for c in contexts:
        ids = rng.integers(0, vocab, c).astype(np.int32)
        g = run_session(gpu, ids, a.decode)
        row = {"context": c, "gpu_prefill_tok_s": c / g["prefill_s"], "gpu_decode_tok_s": a.decode / g["decode_s"],
               "gpu_finite": g["finite"]}
        if c <= a.check_max:
            mode = "f32" if c <= a.f32_max else "int8"
            r = run_session(cpu(mode), ids, a.decode)
            diff = np.abs(g["logits"] - r["logits"])
            row.update(reference=f"cpu {mode}", cpu_prefill_tok_s=c / r["prefill_s"],
                       max_abs_diff=float(diff.max()), logit_scale=float(np.abs(r["logits"]).max()),
                       top1_same=int(np.argmax(g["logits"])) == int(np.argmax(r["logits"])),
                       greedy_same=g["tokens"] == r["tokens"],
                       greedy_prefix=next((i for i, (x, y) in enumerate(zip(g["tokens"], r["tokens"], strict=True)) if x != y),
                                          len(g["tokens"])))
        report["contexts"].append(row)
        print(json.dumps(row), flush=True)
        (a.out / "fullsize.json").write_text(json.dumps(report, indent=1))  # kept if a later step is cut off
    cpu_models.clear()

    # Timing pass: the same backend with an event pair around every dispatch.
    del gpu
    timed = lily.Model.load(a.ckpt, backend=a.backend, max_context=a.timing_prefill + 4,
                            backend_options={**a.backend_options, "timing": True}) if a.backend == "msl-cuda" and a.timing_prefill else None
    if timed is not None:
        s = timed.session(a.timing_prefill + 4)
        timed._engine.gpu_timings()  # drop the load's
        timed._engine.gpu_records(True)
        logits = s.prefill(rng.integers(0, vocab, a.timing_prefill).astype(np.int32))
        report["prefill_kernels"] = kernel_table(timed._engine.gpu_records(True), timed._engine.gpu_timings())
        s.decode(int(np.argmax(logits)))
        report["decode_kernels"] = kernel_table(timed._engine.gpu_records(False), timed._engine.gpu_timings())

    (a.out / "fullsize.json").write_text(json.dumps(report, indent=1))
    opts = f" (backend_options {json.dumps(a.backend_options)})" if a.backend_options else ""
    md = [f"backend {a.backend}{opts}; load {report['load_s']:.1f} s", "",
          "| context | GPU prefill tok/s | GPU decode tok/s | reference | max abs diff (logit scale) | top-1 | greedy |",
          "|---:|---:|---:|---|---:|---|---|"]
    for r in report["contexts"]:
        ref = r.get("reference", "-")
        d = f"{r['max_abs_diff']:.3g} ({r['logit_scale']:.3g})" if "max_abs_diff" in r else "-"
        md.append(f"| {r['context']} | {r['gpu_prefill_tok_s']:.1f} | {r['gpu_decode_tok_s']:.2f} | {ref} | {d} | "
                  f"{r.get('top1_same', '-')} | {r.get('greedy_prefix', '-')}/{a.decode} |")
    for key, title in (("prefill_kernels", f"prefill of {a.timing_prefill}"), ("decode_kernels", "one decode step")):
        if key in report:
            md += kernel_markdown(report[key], title, a.copy_gbs)
    (a.out / "fullsize.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["gpu_finite"] for r in report["contexts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
