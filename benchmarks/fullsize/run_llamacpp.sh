#!/usr/bin/env bash
# llama.cpp's CPU build at the full Qwen3.6-35B-A3B shape: the speed anchor next to
# benchmarks/fullsize/run.sh (lily). On a machine with no network:
#   1. build llama-bench from the llama.cpp source of the llama-cpp-python 0.3.36 sdist
#      (LLAMA_SRC: a .tar.xz of its vendor/llama.cpp), explicit SIMD flags, AMX off
#      (REFERENCE.md: llama.cpp's AMX matmul segfaults on these hosts);
#   2. meanwhile benchmarks/fullsize/make_gguf.py writes a random Q4_0 GGUF of the same shapes
#      from TEMPLATE (metadata of a converter-written qwen35moe GGUF, real tokenizer);
#   3. MODE=bench (default): llama-bench at 16 threads: pp512 + tg16, pp4096, tg16 at depth 4096.
#      MODE=batched: llama-batched-bench once per context in CONTEXTS (-npp C -ntg 16 -npl 1):
#      one prompt of C tokens, then 16 decode steps at that depth, so a long context costs one
#      prefill, not two (llama-bench re-fills the depth for its tg test); peak RSS of each run
#      from the kernel's child-rusage (llama.cpp does not report it).
# Steps 1-2 are skipped when their outputs already exist in $WORK / $GGUF (a second call).
# Outputs in $OUT: llama_*.log, llama_bench_*.{md,json}, llama_batched_*.txt.
#
#   OUT=/tmp/out THREADS=16 BUDGET_S=380 benchmarks/fullsize/run_llamacpp.sh
#   OUT=/tmp/out MODE=batched CONTEXTS=512,4096 benchmarks/fullsize/run_llamacpp.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
start=$(date +%s)
OUT=${OUT:-/tmp/fullsize-out}
THREADS=${THREADS:-16}
BUDGET_S=${BUDGET_S:-380}
LLAMA_SRC=${LLAMA_SRC:-build/fullsize-llama/llama.cpp-src.tar.xz}
TEMPLATE=${TEMPLATE:-build/fullsize-llama/template.gguf}
GGUF=${GGUF:-/tmp/qwen36-35b-a3b-random-q4_0.gguf}
WORK=${WORK:-/tmp/llamacpp}
PY=$(command -v python3 || command -v python)
mkdir -p "$OUT" "$WORK"
left() { echo $(( start + BUDGET_S - $(date +%s) )); }

MODE=${MODE:-bench}
CONTEXTS=${CONTEXTS:-512,4096,32768}
src="$WORK/llama.cpp"
bench="$WORK/build/bin/llama-bench"
batched="$WORK/build/bin/llama-batched-bench"
# Setup, skipped when an earlier call on this machine left the binaries and the GGUF.
if [ ! -x "$batched" ] || [ ! -f "$GGUF" ]; then
[ -d "$src" ] || tar -xJf "$LLAMA_SRC" -C "$WORK"
simd=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if grep -q avx512f /proc/cpuinfo; then
  simd+=(-DGGML_AVX512=ON)
  grep -q avx512_vnni /proc/cpuinfo && simd+=(-DGGML_AVX512_VNNI=ON)
  grep -q avx512_bf16 /proc/cpuinfo && simd+=(-DGGML_AVX512_BF16=ON)
  grep -q avx512vbmi /proc/cpuinfo && simd+=(-DGGML_AVX512_VBMI=ON)
fi
grep -q avx_vnni /proc/cpuinfo && simd+=(-DGGML_AVX_VNNI=ON)
echo "simd: ${simd[*]}" >"$OUT/llama_build.log"
(
  t=$(date +%s)
  cmake -S "$src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF "${simd[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DGGML_METAL=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF &&
  cmake --build "$WORK/build" -j "$THREADS" --target llama-bench llama-batched-bench
  rc=$?
  echo "build_s=$(( $(date +%s) - t )) rc=$rc"
  exit $rc
) >>"$OUT/llama_build.log" 2>&1 &
build_pid=$!

PYTHONPATH="$src/gguf-py" "$PY" benchmarks/fullsize/make_gguf.py "$TEMPLATE" "$GGUF" --workers 8 \
  >"$OUT/llama_make_gguf.log" 2>&1 || { tail -20 "$OUT/llama_make_gguf.log"; exit 1; }
tail -1 "$OUT/llama_make_gguf.log"
if ! wait "$build_pid"; then tail -30 "$OUT/llama_build.log"; exit 1; fi
tail -1 "$OUT/llama_build.log"
fi

run() {  # name, seconds needed, llama-bench args...
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "skipped $name: $(left) s left, needs ~$need" | tee -a "$OUT/llama_skipped.txt"; return; fi
  timeout "$(left)" "$bench" -m "$GGUF" -t "$THREADS" "$@" -o md >"$OUT/llama_bench_$name.md" 2>"$OUT/llama_bench_$name.log"
  echo "[$name rc=$?]"; cat "$OUT/llama_bench_$name.md"
}

batched_run() {  # context: prompt of that many tokens, then 16 decode steps at that depth
  local ctx=$1 log="$OUT/llama_batched_$1.txt"
  # Estimated from llama.cpp's last measured rate on this shape (~90 tok/s at 16 threads).
  local need=$(( ctx / 60 + 30 ))
  if [ "$(left)" -lt "$need" ]; then echo "skipped batched $ctx: $(left) s left, needs ~$need" | tee -a "$OUT/llama_skipped.txt"; return; fi
  "$PY" - "$(left)" "$batched" -m "$GGUF" -t "$THREADS" -c $(( ctx + 64 )) -b 2048 -ub 512 \
      -npp "$ctx" -ntg 16 -npl 1 >"$log" 2>&1 <<'PYEOF'
import resource, subprocess, sys
limit = float(sys.argv[1])
try:
    rc = subprocess.run(sys.argv[2:], timeout=limit).returncode
except subprocess.TimeoutExpired:
    rc = "timeout"
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB
print(f"[llama-batched-bench rc={rc} peak_rss_gb={peak * 1024 / 1e9:.2f}]")
PYEOF
  echo "[batched $ctx]"; grep -E '^\|' "$log"; tail -1 "$log"
}

if [ "$MODE" = batched ]; then
  for ctx in ${CONTEXTS//,/ }; do batched_run "$ctx"; done
else
  run pp512_tg16 30 -p 512 -n 16 -r 2
  run pp4096 60 -p 4096 -n 0 -r 1 --no-warmup
  run tg16_at4096 60 -p 0 -n 16 -d 4096 -r 1 --no-warmup
fi
echo "total_s=$(( $(date +%s) - start ))"
