#!/usr/bin/env bash
# Phase I: one device call (issue 16) on the H200 through msl-cuda: the prefill attention's KV
# traffic at the full 35B shape, one 512-token chunk after 32,256 cached positions (synthetic
# state; scripts/h200/prefill_kv_traffic.py): the KV bytes each attn_prefill dispatch declares
# (the plan's count) against the DRAM and L2 bytes Nsight Compute measures for it, and its GPU
# time from the timing pass. H200 figures (50 MB L2), not Apple figures.
#   run(command="bash scripts/h200/phase_i.sh", carry=[".carry/ptx_new"], timeout_s=600)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/h200/msl_cuda_env.sh
full_checkpoint
timeout 200 python3 scripts/h200/prefill_kv_traffic.py /tmp/ckpt_full --timing --out "$OUT/timing" \
  > "$OUT/timing.log" 2>&1
say "timing rc=$?"; tail -30 "$OUT/timing.log"
timeout 300 ncu --target-processes all --kernel-name regex:attn_prefill --launch-count 2 \
  --metrics dram__bytes_read.sum,lts__t_bytes.sum,gpu__time_duration.sum --csv \
  python3 scripts/h200/prefill_kv_traffic.py /tmp/ckpt_full --out "$OUT/ncu" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
say "ncu rc=$?"; grep -E "attn_prefill|==ERROR|==WARN" "$OUT/ncu.csv" "$OUT/ncu.err" | head -20
