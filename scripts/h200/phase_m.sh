#!/usr/bin/env bash
# Phase M: one device call (issue 16 §2, "several sequences per dispatch") on the H200 through
# msl-cuda, at the full Qwen3.6-35B-A3B shape (random weights, scripts/make_fullsize.py):
#   1. one sequence against the CPU backend at a 512-token prompt (scripts/h200/fullsize.py
#      --check-max 512): the attention and DeltaNet kernels now reach the cache and state by
#      address through a one-entry sequence table;
#   2. batched decode steps (benchmarks/batch_decode.py --check): each step of B = 1, 2, 4, 7
#      sequences of ~4K context checked bit for bit against the sequences decoded alone, and
#      timed, with the mixers one dispatch per kernel for all B sequences;
#   3. the tree before the change (one attention / DeltaNet dispatch group per sequence), built
#      beside it, the same batched steps: the two side by side in one call.
# Prepared HERE first (needs clang-19):
#   PYTHONPATH=src LILY_MSL_CUDA_CACHE=$PWD/.carry/ptx_new.build python -m lily.msl_cuda compile
#     (then the *.ptx into .carry/ptx_new)
#   the tree before the change in .carry/old (git archive <commit>, less docs, tests and the demo
#     weights) and its kernels the same way with LILY_SOURCE_DIR=$PWD/.carry/old into .carry/ptx_old,
#     from the working tree that is carried (a PTX key also hashes headers of the tree it runs in)
#   run(command="bash scripts/h200/phase_m.sh", carry=[".carry/ptx_new", ".carry/old", ".carry/ptx_old"])
# H200 figures of kernels written for Apple GPUs (Apple figures unverified): they compare two
# versions of the same host and kernels on one real GPU.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/h200/msl_cuda_env.sh
full_checkpoint
batch() {  # batch NAME: the batched decode steps of this tree
  timeout 200 python3 benchmarks/batch_decode.py --model /tmp/ckpt_full --backend msl-cuda --batch 1,2,4,7 \
    --context 4096 --check --json "$OUT/batch_$1.json" > "$OUT/batch_$1.log" 2>&1
  say "batch $1 rc=$?"; tail -8 "$OUT/batch_$1.log"
}
batch new
timeout 200 python3 scripts/h200/fullsize.py /tmp/ckpt_full --contexts 512 --check-max 512 --decode 8 \
  --threads 16 --timing-prefill 0 --out "$OUT/fullsize" > "$OUT/fullsize.log" 2>&1
say "fullsize rc=$?"; grep -E "^\|" "$OUT/fullsize/fullsize.md" | head -6
(cd .carry/old && bash scripts/dev_build.sh > "$OUT/build_old.log" 2>&1) || { tail -20 "$OUT/build_old.log"; exit 1; }
say "built old"
PYTHONPATH="$root/.carry/old/src:$root/scripts/h200" LILY_SOURCE_DIR="$root/.carry/old" \
  LILY_MSL_CUDA_CACHE="$root/.carry/ptx_old" batch old
