#!/usr/bin/env bash
# The real Qwen3.6-35B-A3B shape end to end on one machine, in one command:
#   1. build lily (scripts/dev_build.sh) while scripts/make_fullsize.py writes the 19.5 GB
#      random-weight checkpoint (exact MLX 4-bit release layout) to local disk;
#   2. benchmarks/fullsize/bench.py: load time, RSS after load / after a generation, prefill and
#      decode tokens/s at 512, 4K, 32K (each context only if it fits the time left), peak RSS.
# Results: $OUT/results.{json,md}, logs in $OUT.
#
#   OUT=/tmp/out THREADS=16 BUDGET_S=480 benchmarks/fullsize/run.sh
# Env: CKPT (checkpoint dir, default /tmp/qwen36-35b-a3b-random), TOKENIZER (folder with
# tokenizer.json from scripts/make_tokenizer.py; default build/fullsize-tokenizer if present),
# CONTEXTS (default 512,4096,32768), BUDGET_S (seconds for the whole script, default 480),
# BUILD=0 to skip the build, CPU_MATMUL (auto, int8 or f32; default auto: Model.load's default), USE_MMAP (auto, true or
# false: Model.load's use_mmap; default auto, which reads the weights into memory when they fit),
# DECODE (timed decode steps after each prefill, default 16), MEMBW=1 (bracket each timed decode
# with a quick membw: bench.py --membw, decode against its paired roofline).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
start=$(date +%s)
OUT=${OUT:-/tmp/fullsize-out}
THREADS=${THREADS:-16}
BUDGET_S=${BUDGET_S:-480}
CKPT=${CKPT:-/tmp/qwen36-35b-a3b-random}
CONTEXTS=${CONTEXTS:-512,4096,32768}
TOKENIZER=${TOKENIZER:-build/fullsize-tokenizer}
PY=$(command -v python3 || command -v python)
mkdir -p "$OUT"

{ nproc; free -g; df -h /tmp; lscpu | grep -E 'Model name|Flags' | cut -c1-400; "$PY" --version; } >"$OUT/machine.txt" 2>&1 || true

# Build in the background while the checkpoint is written (the writer is mostly disk-bound).
BUILD=${BUILD:-1}  # 0: use the lily already importable from src/ (local testing)
( [ "$BUILD" = 0 ] && exit 0; t=$(date +%s); scripts/dev_build.sh >"$OUT/build.log" 2>&1; echo "build_s=$(( $(date +%s) - t ))" >>"$OUT/build.log" ) &
build_pid=$!

tok_args=()
[ -f "$TOKENIZER/tokenizer.json" ] && tok_args=(--tokenizer "$TOKENIZER")
if [ ! -f "$CKPT/model.safetensors.index.json" ]; then
  "$PY" scripts/make_fullsize.py "$CKPT" --workers "$THREADS" "${tok_args[@]}" 2>&1 | tee "$OUT/make_fullsize.log"
fi
ls -la "$CKPT" >"$OUT/checkpoint_ls.txt"
if ! wait "$build_pid"; then
  tail -50 "$OUT/build.log"
  echo "lily build failed" >&2
  exit 1
fi
[ -f "$OUT/build.log" ] && tail -1 "$OUT/build.log"

PYTHONPATH="$root/src" "$PY" benchmarks/fullsize/bench.py "$CKPT" --threads "$THREADS" --out "$OUT" \
  --contexts "$CONTEXTS" --cpu-matmul "${CPU_MATMUL:-auto}" --use-mmap "${USE_MMAP:-auto}" --decode "${DECODE:-16}" \
  ${MEMBW:+--membw} --deadline $(( start + BUDGET_S )) 2>&1 | tee "$OUT/bench.log"
echo "total_s=$(( $(date +%s) - start ))" | tee -a "$OUT/bench.log"
