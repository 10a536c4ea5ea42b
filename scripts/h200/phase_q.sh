#!/usr/bin/env bash
# Phase Q (issue 18): where a full-size decode step's time goes on the host's 16 cores (no GPU),
# the question runs 9-10 of docs/performance.md leave open (decode at 53-80% of the best
# 16-thread `membw` pass there, 84-87% on the 2-core VM):
#   1. the tree built RelWithDebInfo at -O3 (the release code, with symbols for perf), the
#      full-size checkpoint written meanwhile;
#   2. benchmarks/kernels/stream_ceiling at 16, 8 and 16 threads: lily's lm_head kernel and a
#      decode step's MoE calls against plain reads in one process. If they keep their 2-core
#      share of the plain reads at 16 threads, the kernel streams as well there, and the rest of
#      the gap is outside it;
#   3. scripts/h200/decode_steps.py at 16 threads after a 512- and a 4,096-token prompt, once
#      alone (its tok/s) and once under `perf record -a -e cpu-clock` (every core, idle
#      included) for 4 s of its timed steps; the report by symbol and by thread;
#   4. benchmarks/roofline.py at the same contexts: the best 16-thread `membw` pass.
# Prepared HERE first (the device has neither perf nor a network): Debian's perf and every
# library it loads, its own loader included (the device's glibc may be older):
#   bash scripts/h200/phase_q.sh prepare              # -> .carry/perf
# Calls (a machine is given back 30 s after a call ends, so they follow each other at once):
#   run(command="setsid bash scripts/h200/phase_q.sh > /tmp/phase_q.out 2>&1 < /dev/null & sleep 420; cat /tmp/phase_q/progress",
#       carry=[".carry/perf"])
#   run(command="sleep 240; cat /tmp/phase_q/progress")      # until "done"
#   run(command="bash scripts/h200/phase_q.sh collect")      # results into $OUT
# PERF_ONLY=1 leaves out stream_ceiling and the decode runs without perf: the profile alone, in
# about 3 minutes. `bash scripts/h200/phase_q.sh profile` leaves out the build, the checkpoint and
# stream_ceiling: the decode runs again on a warm machine that ran the phase.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
W=${W:-/tmp/phase_q}
CKPT=/tmp/qwen36-35b-a3b-random
if [ "${1:-}" = prepare ]; then
  set -e
  rm -rf .carry/perf && mkdir -p .carry/perf/lib
  cp "$(command -v perf)" .carry/perf/
  for lib in $(ldd "$(command -v perf)" | awk '/=>/ {print $3}') /lib64/ld-linux-x86-64.so.2; do
    cp -L "$lib" .carry/perf/lib/
  done
  exit 0
fi
source scripts/h200/phase_cpu.sh
if [ "${1:-}" = collect ]; then
  phase_collect "$W"/stream_*.txt "$W"/decode_*.json "$W"/perf_*_sym.txt "$W"/roofline_*.txt
  exit 0
fi
phase_start
# phase_start preloads the device's libstdc++, which needs a newer glibc than the carried one.
perf_=(env -u LD_PRELOAD .carry/perf/lib/ld-linux-x86-64.so.2 --library-path .carry/perf/lib .carry/perf/perf)

if [ "${1:-}" != profile ]; then
  LILY_BUILD_ROOT=build/rwdi bash scripts/dev_build.sh -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O3 -g -DNDEBUG" > "$W/build.log" 2>&1 &
  build=$!
  python3 scripts/make_fullsize.py "$CKPT" --workers 16 > "$W/make_fullsize.log" 2>&1
  say "checkpoint rc=$?"
  wait $build || { say "build failed: $(tail -3 "$W/build.log")"; exit 1; }
  lib=$(ls build/rwdi/*/liblily_core.a | head -1)
  c++ -O3 -march=native -std=c++17 -ffp-contract=off -Icsrc benchmarks/kernels/stream_ceiling.cpp "$lib" \
    -lpthread -o "$W/stream_ceiling" > "$W/stream_build.log" 2>&1
  say "built (stream_ceiling rc=$?)"

  for t in $([ -n "${PERF_ONLY:-}" ] || echo 16 8 16); do
    "$W/stream_ceiling" 20 $t plain,loads,kernel,moe >> "$W/stream_$t.txt" 2>&1
    say "stream_ceiling $t threads: $(grep -E '^(loads|kernel|moe) ' "$W/stream_$t.txt" | tail -3 | awk '{print $1, $NF}' | tr '\n' ' ')"
  done
fi
# decode PROMPT: 16-thread decode alone (not with PERF_ONLY=1), then again with 4 s of it under
# perf (whose tok/s, against the run alone, says what perf costs it).
decode() {
  [ -n "${PERF_ONLY:-}" ] || PYTHONPATH=src python3 scripts/h200/decode_steps.py "$CKPT" --threads 16 --prompt "$1" --warmup 8 \
    --steps 128 > "$W/decode_$1.json" 2>&1
  [ -n "${PERF_ONLY:-}" ] || say "decode at $1 alone: $(tail -1 "$W/decode_$1.json")"
  rm -f "$W/ready"
  PYTHONPATH=src python3 scripts/h200/decode_steps.py "$CKPT" --threads 16 --prompt "$1" --warmup 8 \
    --steps 400 --ready "$W/ready" > "$W/decode_$1_perf.json" 2>&1 &
  local pid=$!
  while [ ! -f "$W/ready" ] && kill -0 $pid 2>/dev/null; do sleep 0.2; done
  "${perf_[@]}" record -a -e cpu-clock -F 999 -o "$W/perf_$1.data" -- sleep 4 > "$W/perf_record_$1.log" 2>&1
  say "perf record at $1 rc=$?: $(tail -1 "$W/perf_record_$1.log")"
  wait $pid
  say "decode at $1 under perf: $(tail -1 "$W/decode_$1_perf.json")"
  "${perf_[@]}" report -i "$W/perf_$1.data" --stdio --no-children --sort dso,sym > "$W/perf_$1_sym.txt" 2>&1
  "${perf_[@]}" report -i "$W/perf_$1.data" --stdio --no-children --sort pid >> "$W/perf_$1_sym.txt" 2>&1
  # The main thread alone: the serial code between parallel regions, and its waits at their ends.
  # By thread and symbol, its rows kept (perf 6.1's --tid filter drops a symbol that another
  # thread's sample reached first: run 12 lost the main thread's kernel and pool rows so).
  echo "# the main thread ($pid), each row a share of every thread's samples" >> "$W/perf_$1_sym.txt"
  "${perf_[@]}" report -i "$W/perf_$1.data" --stdio --no-children --sort pid,sym 2>&1 |
    grep -E "^ +[0-9.]+% +$pid:" | head -80 >> "$W/perf_$1_sym.txt"
}
decode 512
decode 4096
for ctx in 660 4236; do  # 512 / 4096 + 8 warm-up steps + half of 400 steps, about
  python3 benchmarks/roofline.py "$CKPT" --threads 16 --context $ctx > "$W/roofline_$ctx.txt" 2>&1
  say "roofline at $ctx: $(tail -1 "$W/roofline_$ctx.txt")"
done
say "done"
