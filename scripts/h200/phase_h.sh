#!/usr/bin/env bash
# Phase H: one device call (issue 19) on the H200 through msl-cuda: C Python threads generating at
# once on one Model (benchmarks/generate_threads.py: the whole stack, the batcher's device loop
# over the C generations against the same requests on batched host passes), on the demo model
# and at the full Qwen3.6-35B-A3B shape (random weights, scripts/make_fullsize.py).
#   run(command="bash scripts/h200/phase_h.sh", carry=[".carry/ptx_new"], timeout_s=600)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/h200/msl_cuda_env.sh
timeout 200 python3 benchmarks/generate_threads.py --backend msl-cuda --clients 1,2,4,7 --tokens 128 --repeat 3 \
  --json "$OUT/demo.json" > "$OUT/demo.log" 2>&1
say "demo rc=$?"; tail -7 "$OUT/demo.log"
full_checkpoint
timeout 300 python3 benchmarks/generate_threads.py --model /tmp/ckpt_full --backend msl-cuda --clients 1,2,4,7 \
  --tokens 64 --repeat 2 --json "$OUT/full.json" > "$OUT/full.log" 2>&1
say "full rc=$?"; tail -7 "$OUT/full.log"
