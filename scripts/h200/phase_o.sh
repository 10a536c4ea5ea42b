#!/usr/bin/env bash
# Phase O (issue 18): the int8 interleaved layout in address order ("One stream in address
# order" in docs/performance.md) on the H200 host's Xeon at the full 35B shape, in one
# background run on the CPU (no GPU):
#   1. phase J (scripts/h200/phase_j.sh): lily's default mode side by side with llama.cpp Q4_0
#      at 512 and 4K, then the decode roofline of the same host;
#   2. scripts/h200/cpu_ab.sh: this tree against the layout before it (linear_int8.cpp of
#      b428ce2), decode at 16 threads and pool_bench, builds alternating new old new old;
#   3. cpu_ab.sh again: this tree (software prefetch into L1, its choice on Intel) against the
#      same kernel without software prefetch (its choice on AMD family 19h), new old new.
# Prepared HERE first (the device has no git history and no network):
#   bash scripts/h200/prepare_llamacpp.sh             # -> .carry/llama
#   bash scripts/h200/phase_o.sh prepare              # -> .carry/ab_layout, .carry/ab_noprefetch
# Calls (a machine is given back 30 s after a call ends, so they follow each other at once):
#   run(command="setsid bash scripts/h200/phase_o.sh > /tmp/phase_o.out 2>&1 < /dev/null & sleep 560; cat /tmp/phase_o/progress",
#       carry=[".carry/llama", ".carry/ab_layout", ".carry/ab_noprefetch"])
#   run(command="sleep 540; cat /tmp/phase_o/progress")      # until "done"
#   run(command="bash scripts/h200/phase_o.sh collect")      # results into $OUT
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
W=${W:-/tmp/phase_o}
if [ "${1:-}" = prepare ]; then
  set -e
  rm -rf .carry/ab_layout .carry/ab_noprefetch
  mkdir -p .carry/ab_layout/csrc/cpu .carry/ab_noprefetch/csrc/cpu
  git show b428ce2:csrc/cpu/linear_int8.cpp > .carry/ab_layout/csrc/cpu/linear_int8.cpp
  # interleaved_prefetch_locality(): 0 (none) on every CPU instead of on AMD family 19h alone.
  sed 's/return family == 0x19 ? 0 : 3;/return 0;/' csrc/cpu/linear_int8.cpp \
    > .carry/ab_noprefetch/csrc/cpu/linear_int8.cpp
  ! cmp -s csrc/cpu/linear_int8.cpp .carry/ab_noprefetch/csrc/cpu/linear_int8.cpp ||
    { echo "the prefetch choice in linear_int8.cpp moved: update the sed above"; exit 1; }
  exit 0
fi
source scripts/h200/phase_cpu.sh
if [ "${1:-}" = collect ]; then
  phase_collect "$W"/j/roofline_*.txt "$W"/j/sbs/lily_auto/results.md "$W"/ab_layout/decode.txt \
    "$W"/ab_layout/pool_bench.txt "$W"/ab_noprefetch/decode.txt
  exit 0
fi
phase_start
W=$W/j bash scripts/h200/phase_j.sh > "$W/phase_j.log" 2>&1
say "phase J: $(tail -1 "$W/j/progress")"
for ab in layout noprefetch; do
  order="new old new old"; [ $ab = noprefetch ] && order="new old new"
  OUT=$W/ab_$ab BASE=.carry/ab_$ab THREADS=16 POOL_BENCH=1 ORDER="$order" \
    bash scripts/h200/cpu_ab.sh > "$W/ab_$ab.log" 2>&1
  say "ab $ab rc=$?: $(tr '\n' ' ' < "$W/ab_$ab/decode.txt" 2>/dev/null)"
done
say "done"
