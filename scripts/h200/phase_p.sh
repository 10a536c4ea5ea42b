#!/usr/bin/env bash
# Phase P (issue 18): the interleaved kernel's stream prefetched into L2 on Intel (the 2-core
# Xeon VM's choice, "On Intel" in docs/performance.md) at the full 35B shape on the H200 host's
# Xeon, in one background run on the CPU (no GPU):
#   1. phase J (scripts/h200/phase_j.sh): lily's default mode side by side with llama.cpp Q4_0
#      at 512 and 4K, then the decode roofline of the same host;
#   2. scripts/h200/cpu_ab.sh: this tree (into L2 on Intel) against fab9dcd's linear_int8.cpp
#      (into L1 on Intel), decode at 4 and 16 threads and pool_bench, new old new old.
# Prepared HERE first (the device has no git history and no network):
#   bash scripts/h200/prepare_llamacpp.sh             # -> .carry/llama
#   bash scripts/h200/phase_p.sh prepare              # -> .carry/ab_l1
# Calls (a machine is given back 30 s after a call ends, so they follow each other at once):
#   run(command="setsid bash scripts/h200/phase_p.sh > /tmp/phase_p.out 2>&1 < /dev/null & sleep 560; cat /tmp/phase_p/progress",
#       carry=[".carry/llama", ".carry/ab_l1"])
#   run(command="sleep 540; cat /tmp/phase_p/progress")      # until "done"
#   run(command="bash scripts/h200/phase_p.sh collect")      # results into $OUT
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
W=${W:-/tmp/phase_p}
if [ "${1:-}" = prepare ]; then
  set -e
  rm -rf .carry/ab_l1 && mkdir -p .carry/ab_l1/csrc/cpu
  git show fab9dcd:csrc/cpu/linear_int8.cpp > .carry/ab_l1/csrc/cpu/linear_int8.cpp
  exit 0
fi
source scripts/h200/phase_cpu.sh
if [ "${1:-}" = collect ]; then
  phase_collect "$W"/j/roofline_*.txt "$W"/j/sbs/lily_auto/results.md "$W"/ab_l1/decode.txt "$W"/ab_l1/pool_bench.txt
  exit 0
fi
phase_start
W=$W/j bash scripts/h200/phase_j.sh > "$W/phase_j.log" 2>&1
say "phase J: $(tail -1 "$W/j/progress")"
OUT=$W/ab_l1 BASE=.carry/ab_l1 THREADS="4 16" POOL_BENCH=1 ORDER="new old new old" \
  bash scripts/h200/cpu_ab.sh > "$W/ab_l1.log" 2>&1
say "ab l1 rc=$?: $(tr '\n' ' ' < "$W/ab_l1/decode.txt" 2>/dev/null)"
say "done"
