#!/usr/bin/env bash
# Phase G: one device call (issue 19) on the H200 through msl-cuda, at the full Qwen3.6-35B-A3B
# shape (random weights, scripts/make_fullsize.py): batched decode steps of B sequences of ~4K
# context, on the host loop (benchmarks/batch_decode.py: Engine.decode_batch, argmax on the
# host) and in the device loop over the B sequences (--device-loop: Engine.begin_device_batch,
# each row's token chosen on the GPU and fed to the next step there, depth 2), one after the
# other in one session; --check: each batched host step equals the sequences decoded alone bit
# for bit, and the device loop's tokens equal the host loop's greedy tokens step by step.
# Prepared HERE first: the kernels as PTX (see phase_f.sh) in .carry/ptx_new.
#   run(command="bash scripts/h200/phase_g.sh", carry=[".carry/ptx_new"], timeout_s=600)
set -uo pipefail
bd() {  # name, extra args
  local name=$1; shift
  timeout 200 python3 benchmarks/batch_decode.py --model /tmp/ckpt_full --backend msl-cuda --batch 1,2,4,7 \
    --context 4096 --steps 16 --warmup 3 --check --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  say "$name rc=$?"
  tail -8 "$OUT/$name.log"
}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/h200/msl_cuda_env.sh
full_checkpoint
bd device_loop --device-loop
bd host_loop
