#!/usr/bin/env bash
# lily and llama.cpp at the full Qwen3.6-35B-A3B shape on one machine, one after the other in
# one command: the same-host pair that issue 9 asks for, up to 32K tokens of context.
#
#   1. benchmarks/fullsize/run.sh: build lily, write the random-weight checkpoint, then lily's
#      load / RSS / prefill + decode at each context, once per LILY_RUNS entry (by default the
#      default mode, cpu_matmul="auto" = int8 on these hosts, at CONTEXTS);
#   2. benchmarks/fullsize/run_llamacpp.sh MODE=batched: build llama.cpp, write the Q4_0 GGUF of
#      the same shapes, then one llama-batched-bench run per context (prefill, then 16 decode
#      steps at that depth; peak RSS).
# Each step gets the time left of BUDGET_S. Results: $OUT/lily_<mode>/results.{json,md}, $OUT/llama_*,
# and $OUT/side_by_side.tar.gz with everything (for a caller that can fetch only a few files).
#
#   OUT=/tmp/sbs THREADS=16 BUDGET_S=1500 bash benchmarks/fullsize/side_by_side.sh
#
# A 32K prompt takes minutes per engine on a CPU, longer than some job runners let one command
# run. On such a runner start it in its own process session and poll:
#   setsid nohup bash benchmarks/fullsize/side_by_side.sh >/tmp/sbs.log 2>&1 < /dev/null &
#   ... later: tail /tmp/sbs.log; test -f $OUT/DONE
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
start=$(date +%s)
OUT=${OUT:-/tmp/sbs}
THREADS=${THREADS:-16}
BUDGET_S=${BUDGET_S:-1500}
CONTEXTS=${CONTEXTS:-512,4096,32768}
left() { echo $(( start + BUDGET_S - $(date +%s) )); }
mkdir -p "$OUT"
rm -f "$OUT/DONE"

# lily first: its first run also builds lily and writes the checkpoint whose shapes both
# engines use. LILY_RUNS lists "cpu_matmul[/mmap]:contexts" runs, one process each (cpu_matmul:
# auto, int8 or f32; "/mmap": the checkpoint stays mapped, use_mmap=True, instead of the default
# read into memory); e.g. LILY_RUNS="auto:512,4096 f32:512,4096" adds the f32 reference mode. llama.cpp's share of
# the budget is kept back: its setup (~90 s) plus its rate (~90 tok/s, measured on this shape)
# over the contexts.
LILY_RUNS=${LILY_RUNS:-"auto:$CONTEXTS"}
llama_need=$(( 90 + $(echo "$CONTEXTS" | tr ',' '\n' | awk '{s += $1 / 80 + 30} END {print int(s)}') ))
build=1
for run in $LILY_RUNS; do
  mode=${run%%:*} ctxs=${run#*:}
  matmul=${mode%/mmap} use_mmap=auto
  [ "$matmul" != "$mode" ] && use_mmap=true
  echo "[side_by_side] lily $mode at $ctxs: $(( $(left) - llama_need )) s (llama.cpp keeps ~$llama_need s)"
  OUT="$OUT/lily_${mode//\//_}" THREADS=$THREADS CONTEXTS=$ctxs CPU_MATMUL=$matmul USE_MMAP=$use_mmap BUILD=$build \
    BUDGET_S=$(( $(left) - llama_need )) bash benchmarks/fullsize/run.sh
  echo "[side_by_side] lily $mode rc=$? at $(( $(date +%s) - start )) s"
  build=0
done

OUT="$OUT" THREADS=$THREADS MODE=batched CONTEXTS=$CONTEXTS BUDGET_S=$(left) \
  bash benchmarks/fullsize/run_llamacpp.sh
echo "[side_by_side] llama.cpp rc=$? at $(( $(date +%s) - start )) s"

echo "total_s=$(( $(date +%s) - start ))" | tee "$OUT/total.txt"
tar -czf /tmp/side_by_side.tar.gz -C "$OUT" . && mv /tmp/side_by_side.tar.gz "$OUT/"
touch "$OUT/DONE"
