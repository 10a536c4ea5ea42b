#!/usr/bin/env bash
# Phase J (issue 18): the CPU default mode at the full Qwen3.6-35B-A3B shape on the H200 host's 16
# cores (no GPU), side by side with llama.cpp Q4_0 at 512 and 4K (benchmarks/fullsize/
# side_by_side.sh: lily's default cpu_matmul, then llama-batched-bench on a GGUF of the same
# shapes), then the decode roofline of the same host in the same session:
# benchmarks/roofline.py on lily's checkpoint (membw at 1 and 16 threads, best of 10 passes over
# 2 GiB; the bytes one lily decode step reads, from the checkpoint's tensor sizes, at the mean
# context of each decode run).
# Prepared HERE first (the device has no network): scripts/h200/prepare_llamacpp.sh -> .carry/llama
# Calls (a machine is given back 30 s after a call ends, so they follow each other at once):
#   run(command="setsid bash scripts/h200/phase_j.sh > /tmp/phase_j.out 2>&1 < /dev/null & sleep 540; cat /tmp/phase_j/progress",
#       carry=[".carry/llama"])
#   run(command="sleep 300; cat /tmp/phase_j/progress")      # until "done"
#   run(command="bash scripts/h200/phase_j.sh collect")      # results into $OUT
# `threads` (a later call, ~6 minutes on a fresh machine, nothing carried): lily's decode at 16,
# 8, 4 and again 16 threads on the same shape (benchmarks/fullsize/bench.py at 512, 64 steps),
# the threads' scaling, with the roofline once more, into $OUT:
#   run(command="bash scripts/h200/phase_j.sh threads")
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
W=${W:-/tmp/phase_j}
CKPT=/tmp/qwen36-35b-a3b-random  # side_by_side.sh's (benchmarks/fullsize/run.sh) default
source scripts/h200/phase_cpu.sh
if [ "${1:-}" = collect ]; then
  phase_collect "$W"/roofline_*.txt "$W"/sbs/lily_auto/results.md "$W"/sbs/total.txt
  exit 0
fi
if [ "${1:-}" = threads ]; then
  W=$W/threads phase_start
  OUT=${OUT:-$root/.carry/out}
  mkdir -p "$OUT"
  bash scripts/dev_build.sh > "$OUT/build.log" 2>&1 &
  python3 scripts/make_fullsize.py "$CKPT" --workers 16 > "$OUT/make_fullsize.log" 2>&1
  wait $! || { tail -30 "$OUT/build.log"; exit 1; }
  for t in 16 8 4 16; do
    PYTHONPATH="$root/src" python3 benchmarks/fullsize/bench.py "$CKPT" --threads $t --contexts 512 --decode 64 \
      --out "$W/threads/t$t" > /dev/null 2>&1
    echo "threads $t: $(grep -E '^\| 512 \|' "$W/threads/t$t/results.md" | tail -1)" | tee -a "$OUT/threads.txt"
  done
  python3 benchmarks/roofline.py "$CKPT" --threads 16 --context 544 >> "$OUT/threads.txt" 2>&1
  cat "$OUT/threads.txt"
  exit 0
fi
phase_start
# lily's decode: 64 timed steps, each run bracketed by membw (its paired roofline, in results.md);
# llama-batched-bench keeps its 16.
OUT=$W/sbs THREADS=16 BUDGET_S=900 CONTEXTS=512,4096 DECODE=64 MEMBW=1 \
  bash benchmarks/fullsize/side_by_side.sh > "$W/sbs.log" 2>&1
say "side_by_side rc=$? ($(tail -1 "$W/sbs/total.txt" 2>/dev/null))"
# The roofline after both engines ran (nothing else on the cores): 512 + 33 and 4096 + 33 are the
# mean contexts of lily's 64-step decode runs (one untimed step first).
for ctx in 545 4129; do
  python3 benchmarks/roofline.py "$CKPT" --threads 16 --context $ctx > "$W/roofline_$ctx.txt" 2>&1
  say "roofline at $ctx: rc=$? $(tail -1 "$W/roofline_$ctx.txt")"
done
say "done"
