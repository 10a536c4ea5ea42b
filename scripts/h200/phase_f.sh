#!/usr/bin/env bash
# Phase F: one device call (issues 16 and 19) on the H200 through msl-cuda, at the full
# Qwen3.6-35B-A3B shape (random weights, scripts/make_fullsize.py):
#   1. the decode GEMVs' 16-byte loads, before / after in one build: scripts/h200/fullsize.py
#      with backend_options {"gemv_words": true} (32-bit word reads, moe_down's experts one after
#      another: the kernels as they were) and without, alternated after / before (/ after again,
#      time allowing), each
#      with its timing pass (GPU ms per kernel of one decode step after a 64-token prefill);
#   2. batched decode steps on the GPU (benchmarks/batch_decode.py --backend msl-cuda --check):
#      time per step and tokens/s at B = 1, 2, 4, 7, 8 sequences of ~4K context, each batched
#      step first checked bit for bit against the sequences decoded alone.
# Prepared HERE first: the backend kernels as PTX (LILY_MSL_CUDA_CACHE=$PWD/.carry/ptx_new.build
# python -m lily.msl_cuda compile, then the *.ptx into .carry/ptx_new). H200 figures of kernels
# written for Apple GPUs: they compare two versions of the same kernels on one real GPU.
#   run(command="bash scripts/h200/phase_f.sh", carry=[".carry/ptx_new"], timeout_s=600)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/h200/msl_cuda_env.sh
full_checkpoint
fs() {  # name, extra args
  local name=$1; shift
  timeout 150 python3 scripts/h200/fullsize.py /tmp/ckpt_full --contexts 512,4096 --check-max 0 --decode 32 \
    --threads 16 --timing-prefill 64 --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  say "$name rc=$?"
}
fs after
fs before --backend-options '{"gemv_words": true}'
timeout 200 python3 benchmarks/batch_decode.py --model /tmp/ckpt_full --backend msl-cuda --batch 1,2,4,7,8 \
  --context 4096 --check --json "$OUT/batch_decode.json" > "$OUT/batch_decode.log" 2>&1
say "batch_decode rc=$?"
tail -12 "$OUT/batch_decode.log"
# The second "after" run last: it is the one the call's time limit may cut.
[ $(( $(date +%s) - t0 )) -lt 420 ] && fs after2
for n in after before after2; do echo "== $n"; grep -E "^\|" "$OUT/$n/fullsize.md" | head -8; done
