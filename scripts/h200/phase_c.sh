#!/usr/bin/env bash
# Issue 17, phase C: everything of one device session in one background job, most important
# first (a session that runs out of device time loses the tail). Run ON THE H200 MACHINE after
# scripts/h200/prepare.sh here filled .carry/. A device call returns within 10 minutes and the
# machine is given back 30 s after a call ends, so the job runs detached and later calls poll it:
#   run(command="setsid bash scripts/h200/phase_c.sh > /tmp/phase_c.out 2>&1 < /dev/null & sleep 560; cat /tmp/phase_c/progress", carry=[".carry"])
#   run(command="sleep 560; cat /tmp/phase_c/progress")        # again, back to back, until "done"
#   run(command="bash scripts/h200/phase_c.sh collect")        # copies the results into $OUT
# Steps (each under its own time limit; results in /tmp/phase_c):
#   1. build lily; copy_bw.cu (the GPU's copy and read bandwidth: the per-kernel tables' yardstick)
#   2. the kernel tests of the msl-cpu suite on msl-cuda (kernel_tests.sh's selection)
#   3. the random-weight full 35B-A3B checkpoint; fullsize.py: 512 / 4K / 32K prompts against the
#      CPU backend, per-kernel times and GB/s of a 512 prefill and a decode step
#   4. long_context.py: decode steps at 4K, 32K, 128K and 256K on a synthetic KV cache and
#      DeltaNet state, against the CPU backend on the same state, per-kernel times and GB/s
#   5. compute-sanitizer memcheck, synccheck, racecheck over the full 40 layers (a 40-token
#      prefill and 2 decode steps); where a tool does not finish in its limit, the 4-layer model
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
W=/tmp/phase_c
if [ "${1:-}" = collect ]; then
  OUT=${OUT:-$root/.carry/out}
  mkdir -p "$OUT"
  tar -czf "$OUT/phase_c.tar.gz" -C "$W" --exclude='*.ptx' .
  cp "$W"/progress "$W"/*.md "$OUT/" 2>/dev/null
  exit 0
fi
mkdir -p "$W"
say() { echo "$(date +%T) $*" >> "$W/progress"; }
export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}  # kernel_tests.sh says why
say "start"
bash scripts/dev_build.sh > "$W/build.log" 2>&1 || { say "build failed"; tail -30 "$W/build.log" >> "$W/progress"; exit 1; }
say "built"
nvcc -O2 -o /tmp/copy_bw scripts/h200/copy_bw.cu > "$W/copy_bw.log" 2>&1 && /tmp/copy_bw > "$W/copy_bw.json" 2>> "$W/copy_bw.log"
COPY=$(python3 -c "import json; print(json.load(open('$W/copy_bw.json'))['read_gb_s'])" 2>/dev/null || echo 0)
say "copy_bw: $(cat "$W/copy_bw.json" 2>/dev/null)"

OUT="$W/kernel_tests" timeout 300 bash scripts/h200/kernel_tests.sh > "$W/kernel_tests.out" 2>&1
say "kernel tests: $(tail -1 "$W/kernel_tests/kernel_tests.log" 2>/dev/null)"

export PYTHONPATH="$root/src:$root/scripts/h200" LILY_SOURCE_DIR="$root" LILY_MSL_CUDA_CACHE="$root/.carry/ptx" PYTHONUNBUFFERED=1
python3 scripts/make_fullsize.py /tmp/ckpt_full --workers 16 > "$W/make_fullsize.log" 2>&1
say "checkpoint: $(tail -1 "$W/make_fullsize.log")"
timeout 480 python3 scripts/h200/fullsize.py /tmp/ckpt_full --contexts 512,4096,32768 --threads 16 \
  --copy-gbs "$COPY" --out "$W/full" > "$W/fullsize.log" 2>&1
say "fullsize rc=$?"
timeout 480 python3 scripts/h200/long_context.py /tmp/ckpt_full --contexts 4096,32768,131072,262144 --decode 3 \
  --threads 16 --timing --copy-gbs "$COPY" --out "$W/long" > "$W/long_context.log" 2>&1
say "long_context rc=$?"

for tool in synccheck memcheck racecheck; do
  timeout 200 compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/h200/fullsize.py /tmp/ckpt_full \
    --contexts 40 --decode 2 --check-max 0 --timing-prefill 0 --out "$W/$tool" > "$W/sanitizer_full_$tool.log" 2>&1
  rc=$?
  say "$tool full 40 layers rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$W/sanitizer_full_$tool.log" | tail -1)"
done
say "done"
