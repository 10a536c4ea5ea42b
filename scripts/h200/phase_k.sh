#!/usr/bin/env bash
# Phase K: one device call (issue 16) on the H200 through msl-cuda: the simdgroup-matrix prefill
# attention (8-token x 8-head query tiles, 8 simdgroups) against the scalar one it replaced (one
# simd_sum per score, same tiles), side by side on the same synthetic state: one 512-token chunk after
# 32,256 cached positions at the full 35B shape (scripts/h200/prefill_kv_traffic.py), each
# tree's GPU time per attn_prefill dispatch, the KV bytes it declares, the chunk's last logits
# of the two compared, then the new kernel's DRAM / L2 bytes under Nsight Compute.
# H200 figures (msl-cuda emulates simdgroup_matrix products with shuffles; 50 MB L2), not
# Apple figures. Results: benchmarks/results/2026-12-02-h200-phase-k/.
# Prepared HERE first (needs clang-19):
#   PYTHONPATH=src LILY_MSL_CUDA_CACHE=$PWD/.carry/ptx_new.build python -m lily.msl_cuda compile
#     (then the *.ptx into .carry/ptx_new)
#   the tree before the change in .carry/old (git archive <commit>, less docs, tests and the demo
#     weights) and its kernels the same way with LILY_SOURCE_DIR=$PWD/.carry/old into .carry/ptx_old,
#     from the working tree that is carried (a PTX key also hashes headers of the tree it runs in)
#   run(command="bash scripts/h200/phase_k.sh", carry=[".carry/ptx_new", ".carry/old", ".carry/ptx_old"])
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/h200/msl_cuda_env.sh
full_checkpoint
traffic() {  # traffic NAME [script args...]: one timing pass, logits saved
  local name=$1; shift
  timeout 200 python3 scripts/h200/prefill_kv_traffic.py /tmp/ckpt_full --timing --out "$OUT/$name" \
    --logits "/tmp/logits_$name.npy" "$@" > "$OUT/$name.log" 2>&1
  say "$name rc=$?"; tail -12 "$OUT/$name.log"
}
traffic new
# The tree before the change: its own extension and kernels, the same script and checkpoint.
(cd .carry/old && bash scripts/dev_build.sh > "$OUT/build_old.log" 2>&1) || { tail -20 "$OUT/build_old.log"; exit 1; }
say "built old"
PYTHONPATH="$root/.carry/old/src:$root/scripts/h200" LILY_SOURCE_DIR="$root/.carry/old" \
  LILY_MSL_CUDA_CACHE="$root/.carry/ptx_old" traffic old
python3 - "$OUT" <<'PY' | tee "$OUT/compare.json"
import json, sys
import numpy as np
new, old = np.load("/tmp/logits_new.npy"), np.load("/tmp/logits_old.npy")
print(json.dumps({"max_abs_diff": float(np.abs(new - old).max()), "max_abs_logit": float(np.abs(old).max()),
                  "same_argmax": bool(new.argmax() == old.argmax()),
                  "top5_new": np.argsort(-new)[:5].tolist(), "top5_old": np.argsort(-old)[:5].tolist()}))
PY
timeout 240 ncu --target-processes all --kernel-name regex:attn_prefill --launch-count 2 \
  --metrics dram__bytes_read.sum,lts__t_bytes.sum,gpu__time_duration.sum --csv \
  python3 scripts/h200/prefill_kv_traffic.py /tmp/ckpt_full --out "$OUT/ncu" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
say "ncu rc=$?"; grep -E "attn_prefill|==ERROR|==WARN" "$OUT/ncu.csv" "$OUT/ncu.err" | head -20
