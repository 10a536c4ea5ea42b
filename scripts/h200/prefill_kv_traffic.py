"""Issue 16: what the prefill attention's KV re-reads cost a real GPU. One 512-token prefill chunk
at a long context (default 32,256 cached positions: the chunk that ends at 32K), at the full
35B shape, through msl-cuda; the KV cache and DeltaNet state are filled synthetically
(long_context.py's synthetic_state) instead of by a 32K prefill.

The plan (benchmarks/metal_plan.py) counts the KV bytes each `attn_prefill` dispatch declares:
every query tile of 8 tokens x 8 heads walks its KV head's cache, so a chunk declares ~64 x the
cache. Concurrent tiles of one KV head read the same positions, so a GPU's cache may serve most
of those reads. Run under Nsight Compute to measure it:

    ncu --kernel-name regex:attn_prefill --launch-count 2 \\
        --metrics dram__bytes_read.sum,lts__t_bytes.sum,gpu__time_duration.sum --csv \\
        python3 scripts/h200/prefill_kv_traffic.py CKPT --out DIR

The script writes DIR/prefill_kv.json: each attn_prefill dispatch's declared state (KV) bytes and
its GPU time (the timing pass), for the measured DRAM bytes to be set beside. H200 figures (50 MB
L2), not Apple figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from long_context import synthetic_state  # this folder

import lily
from fullsize import kernel_table  # this folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--backend", default="msl-cuda", help="msl-cuda (msl-cpu: a local dry run)")
    ap.add_argument("--context", type=int, default=32256, help="positions cached before the chunk")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--timing", action="store_true", help="GPU time per dispatch (not under ncu)")
    ap.add_argument("--logits", type=Path, help="also save the chunk's last logits here (.npy)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    model = lily.Model.load(a.ckpt, backend=a.backend, max_context=a.context + a.chunk + 1,
                            prefill_chunk=a.chunk, backend_options={"timing": True} if a.timing else {})
    engine = model._engine
    st = engine.new_state(a.context + a.chunk + 1)
    st.import_tensors(a.context, synthetic_state(st.export_tensors(), a.context, seed=1))
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, a.chunk).astype(np.int32)
    engine.gpu_records(True)
    if a.timing:
        engine.gpu_timings()
    logits = engine.prefill(st, tokens, False)
    if a.logits:
        np.save(a.logits, np.asarray(logits, np.float32))
    records = engine.gpu_records(False)
    rows = [{"kernel": r[0], "state_bytes": int(r[3])} for r in records if r[0].startswith("attn_prefill")]
    report = {"context": a.context, "chunk": a.chunk, "kv_dtype": engine.kv_dtype, "attn_prefill": rows,
              "declared_state_bytes_per_dispatch": rows[0]["state_bytes"] if rows else 0}
    if a.timing:
        report["kernels"] = [k for k in kernel_table(records, engine.gpu_timings())
                             if k["kernel"].startswith("attn_prefill")]
    (a.out / "prefill_kv.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "attn_prefill"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
