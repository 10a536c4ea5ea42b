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
# GPU=cuda: llama.cpp's CUDA build instead (issue 17, the H200 yardstick): the same source
#   configured with -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 (what GGML_NATIVE picks on an
#   H200; nvcc from /usr/local/cuda/bin when present), every other GPU backend off, the CUDA
#   options at llama.cpp's defaults (CUDA graphs on, FlashAttention kernels for the K/V types
#   f16, q4_0, q8_0, bf16, fatbin compression "size"), the CPU flags as above (the CPU backend
#   still does the token-embedding lookup), in its own build dir $WORK/build-cuda at -j$JOBS (16).
#   Where the toolkit lacks cuBLAS or the driver stub (one assembled from pip wheels), the
#   configure is repeated with the nvidia-cublas wheel's library and headers (the one PyTorch
#   brings, of nvcc's major version) and the driver's libcuda.so.1 (LIBCUDA overrides it).
#   MODE=bench runs llama-bench -ngl 99 (all layers and the output on the GPU) with flash
#   attention at llama-bench's default, auto (on where the backend supports it; the verbose
#   first run's log says what it chose): prefill 512 (-p 512 -n 0 -r 5), decode of 32 tokens at
#   depth 4096 and 32768 (-p 0 -n 32 -d D -r 2: llama-bench prefills the depth once and restores
#   the state for the second repetition), then, as time allows, prefill 4096 and 32768.
# MODE=setup: steps 1-2 only (a first device call: the CUDA build takes minutes).
# SERVER=1: build llama-server too (-DLLAMA_BUILD_SERVER=ON, no web UI), for the full-size server
#   table of benchmarks/serve_load.py (scripts/h200/phase_e.sh); the binary is $WORK/build/bin/llama-server.
# Steps 1-2 are skipped when their outputs already exist in $WORK / $GGUF (a second call: a build
# cut short by the budget resumes where ninja stopped; a GGUF counts once its writer finished).
# TEMPLATE may be xz-compressed (template.gguf.xz, as scripts/h200/prepare_llamacpp.sh writes it);
# LLAMA_SRC and TEMPLATE default to that script's .carry/llama/ when build/fullsize-llama/ is absent.
# Outputs in $OUT: llama_*.log, llama_bench_*.{md,json,log}, llama_batched_*.txt; with GPU=cuda
# llama_cuda_* instead, plus llama_cuda_gpu.txt (nvidia-smi, nvcc --version) and
# llama_cuda_cmake_cache.txt (the CUDA options the build got); build_s in *_build.log.
# DRY_RUN=1 prints the configure, build, GGUF and benchmark commands and runs nothing.
#
#   OUT=/tmp/out THREADS=16 BUDGET_S=380 benchmarks/fullsize/run_llamacpp.sh
#   OUT=/tmp/out MODE=batched CONTEXTS=512,4096 benchmarks/fullsize/run_llamacpp.sh
#   OUT=/tmp/out GPU=cuda MODE=setup BUDGET_S=570 benchmarks/fullsize/run_llamacpp.sh   # then:
#   OUT=/tmp/out GPU=cuda BUDGET_S=570 benchmarks/fullsize/run_llamacpp.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
start=$(date +%s)
OUT=${OUT:-/tmp/fullsize-out}
THREADS=${THREADS:-16}
BUDGET_S=${BUDGET_S:-380}
GPU=${GPU:-}
SERVER=${SERVER:-0}
DRY_RUN=${DRY_RUN:-0}
# The carried copies from scripts/h200/prepare_llamacpp.sh when this checkout has them.
carried=.carry/llama
if [ -f "$carried/llama.cpp-src.tar.xz" ] && [ ! -f build/fullsize-llama/llama.cpp-src.tar.xz ]; then
  LLAMA_SRC=${LLAMA_SRC:-$carried/llama.cpp-src.tar.xz}
  TEMPLATE=${TEMPLATE:-$carried/template.gguf.xz}
fi
LLAMA_SRC=${LLAMA_SRC:-build/fullsize-llama/llama.cpp-src.tar.xz}
TEMPLATE=${TEMPLATE:-build/fullsize-llama/template.gguf}
GGUF=${GGUF:-/tmp/qwen36-35b-a3b-random-q4_0.gguf}
WORK=${WORK:-/tmp/llamacpp}
PY=$(command -v python3 || command -v python)
left() { echo $(( start + BUDGET_S - $(date +%s) )); }
limit() { local l; l=$(left); echo $(( l > 1 ? l : 1 )); }  # for timeout, where 0 means none
show() { printf '%q ' "$@"; echo; }  # a command as DRY_RUN prints it

MODE=${MODE:-bench}
CONTEXTS=${CONTEXTS:-512,4096,32768}
src="$WORK/llama.cpp"
simd=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
  simd+=(-DGGML_AVX512=ON)
  grep -q avx512_vnni /proc/cpuinfo && simd+=(-DGGML_AVX512_VNNI=ON)
  grep -q avx512_bf16 /proc/cpuinfo && simd+=(-DGGML_AVX512_BF16=ON)
  grep -q avx512vbmi /proc/cpuinfo && simd+=(-DGGML_AVX512_VBMI=ON)
fi
grep -q avx_vnni /proc/cpuinfo 2>/dev/null && simd+=(-DGGML_AVX_VNNI=ON)
case "$GPU" in
  "")
    tag=llama build="$WORK/build" gpu_flags=(-DGGML_CUDA=OFF) ngl=() jobs=$THREADS ;;
  cuda)
    # nvcc where the CUDA toolkit installs it, unless CUDACXX / PATH already name one.
    if [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then PATH="/usr/local/cuda/bin:$PATH"; fi
    export CUDACXX=${CUDACXX:-$(command -v nvcc || echo nvcc)}
    tag=llama_cuda build="$WORK/build-cuda" ngl=(-ngl 99) jobs=${JOBS:-16}
    gpu_flags=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 "-DCMAKE_CUDA_COMPILER=$CUDACXX") ;;
  *) echo "GPU=$GPU: only cuda (or empty for the CPU build)" >&2; exit 2 ;;
esac
bench="$build/bin/llama-bench"
batched="$build/bin/llama-batched-bench"
configure=(cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF "${simd[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DGGML_METAL=OFF "${gpu_flags[@]}" -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "-DLLAMA_BUILD_SERVER=$([ "$SERVER" = 1 ] && echo ON || echo OFF)"
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
targets=(llama-bench llama-batched-bench)
[ "$SERVER" = 1 ] && targets+=(llama-server)
compile=(cmake --build "$build" -j "$jobs" --target "${targets[@]}")
template="$TEMPLATE"
[ "${TEMPLATE%.xz}" != "$TEMPLATE" ] && template="$WORK/template.gguf"
# GGUF_ARGS: e.g. "--layers 4 --experts 8" for a small model of the same layout (a local check).
# shellcheck disable=SC2206  # GGUF_ARGS is split into words on purpose
make_gguf=("$PY" benchmarks/fullsize/make_gguf.py "$template" "$GGUF" --workers 8 ${GGUF_ARGS:-})

cuda_fallback() {  # cmake arguments, one a line: cuBLAS of nvcc's major version from the pip wheels, libcuda
  local major dirs d lib lt inc drv
  major=$("$CUDACXX" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  mapfile -t dirs < <("$PY" -c "import nvidia; print(*nvidia.__path__, sep=chr(10))" 2>/dev/null)
  for d in "${dirs[@]}"; do
    lib=$(ls "$d"/*/lib/libcublas.so."$major" 2>/dev/null | head -1)
    [ -n "$lib" ] || continue
    lt="$(dirname "$lib")/libcublasLt.so.$major" inc="$(dirname "$(dirname "$lib")")/include"
    echo "-DCUDA_cublas_LIBRARY=$lib"; echo "-DCUDA_cublasLt_LIBRARY=$lt"; echo "-DCMAKE_CUDA_FLAGS=-I$inc"
    break
  done
  drv=${LIBCUDA:-$(ldconfig -p 2>/dev/null | sed -n 's/.*libcuda\.so\.1 .*=> \(.*\)/\1/p' | head -1)}
  [ -n "$drv" ] && echo "-DCUDA_cuda_driver_LIBRARY=$drv"
}

if [ "$DRY_RUN" = 1 ]; then
  echo "# source: $LLAMA_SRC -> $src; template: $TEMPLATE"
  show "${configure[@]}"
  show "${compile[@]}"
  show "${make_gguf[@]}"
else
mkdir -p "$OUT" "$WORK"
if [ -n "$GPU" ]; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader
    "$CUDACXX" --version | tail -2; } >"$OUT/${tag}_gpu.txt" 2>&1
  cat "$OUT/${tag}_gpu.txt"
fi
# Setup, skipped when an earlier call on this machine left the binaries and the GGUF.
if [ ! -x "$build/bin/${targets[-1]}" ] || [ ! -f "$GGUF.done" ]; then
[ -d "$src" ] || tar -xJf "$LLAMA_SRC" -C "$WORK"
# The tarball carries no .git; prepare_llamacpp.sh's LILY_SOURCE names the commit for build info.
commit=$(sed -n 's/^commit \([0-9a-f]\{7\}\).*/\1/p' "$src/LILY_SOURCE" 2>/dev/null)
[ -n "$commit" ] && configure+=("-DLLAMA_BUILD_COMMIT=$commit")
echo "simd: ${simd[*]}" >>"$OUT/${tag}_build.log"
(
  t=$(date +%s)
  echo "+ ${configure[*]}"
  if ! "${configure[@]}"; then
    # A CUDA toolkit put together from pip wheels may lack cuBLAS and the driver stub: give CMake
    # the nvidia-cublas wheel (PyTorch's) and the driver's libcuda.so.1, then configure again.
    extra=()
    [ -n "$GPU" ] && mapfile -t extra < <(cuda_fallback)
    [ ${#extra[@]} -gt 0 ] || exit 1
    echo "+ configure again with ${extra[*]}"
    "${configure[@]}" "${extra[@]}" || exit 1
  fi
  timeout "$(limit)" "${compile[@]}"
  rc=$?
  echo "build_s=$(( $(date +%s) - t )) rc=$rc"
  exit $rc
) >>"$OUT/${tag}_build.log" 2>&1 &
build_pid=$!

if [ ! -f "$GGUF.done" ]; then
  if [ "$template" != "$TEMPLATE" ]; then
    xz -dc "$TEMPLATE" >"$template" 2>/dev/null ||
      "$PY" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$TEMPLATE" "$template"
  fi
  PYTHONPATH="$src/gguf-py" "${make_gguf[@]}" >"$OUT/${tag}_make_gguf.log" 2>&1 ||
    { tail -20 "$OUT/${tag}_make_gguf.log"; exit 1; }
  touch "$GGUF.done"
  tail -1 "$OUT/${tag}_make_gguf.log"
fi
if ! wait "$build_pid"; then tail -30 "$OUT/${tag}_build.log"; exit 1; fi
# What the build got: the CUDA options as configured (llama.cpp's defaults), the compiler.
grep -E "^(GGML_CUDA[A-Z_0-9]*|CMAKE_CUDA_ARCHITECTURES|CMAKE_CUDA_COMPILER|GGML_NATIVE):" "$build/CMakeCache.txt" \
  >"$OUT/${tag}_cmake_cache.txt" 2>/dev/null
grep -E "CUDA Toolkit found|CUDA_ARCHITECTURES|FlashAttention K-V|NCCL" "$OUT/${tag}_build.log"
tail -1 "$OUT/${tag}_build.log"
fi
fi

run() {  # name, seconds needed, llama-bench args...: $OUT/<tag>_bench_<name>.{md,json,log}
  local name=$1 need=$2; shift 2
  local cmd=("$bench" -m "$GGUF" -t "$THREADS" "${ngl[@]}" "$@" -o json -oe md)
  if [ "$DRY_RUN" = 1 ]; then show "${cmd[@]}"; return; fi
  if [ "$(left)" -lt "$need" ]; then echo "skipped $name: $(left) s left, needs ~$need" | tee -a "$OUT/${tag}_skipped.txt"; return; fi
  local f="$OUT/${tag}_bench_$name"
  timeout "$(limit)" "${cmd[@]}" >"$f.json" 2>"$f.log"
  echo "[$name rc=$?]"
  grep -E '^\|' "$f.log" >"$f.md"; cat "$f.md"
  # With -v: what flash attention "auto" became, and where the layers went.
  grep -E "Flash Attention|flash_attn +=|offloaded [0-9]+/[0-9]+ layers" "$f.log" | sort -u | head -4
}

batched_run() {  # context: prompt of that many tokens, then 16 decode steps at that depth
  local ctx=$1 log="$OUT/${tag}_batched_$1.txt"
  local cmd=("$batched" -m "$GGUF" -t "$THREADS" "${ngl[@]}" -c $(( ctx + 64 )) -b 2048 -ub 512
             -npp "$ctx" -ntg 16 -npl 1)
  if [ "$DRY_RUN" = 1 ]; then show "${cmd[@]}"; return; fi
  # Estimated from llama.cpp's last measured rate on this shape (~90 tok/s at 16 threads).
  local need=$(( ctx / 60 + 30 ))
  if [ "$(left)" -lt "$need" ]; then echo "skipped batched $ctx: $(left) s left, needs ~$need" | tee -a "$OUT/${tag}_skipped.txt"; return; fi
  "$PY" - "$(left)" "${cmd[@]}" >"$log" 2>&1 <<'PYEOF'
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

if [ "$MODE" = setup ]; then
  :
elif [ "$MODE" = batched ]; then
  for ctx in ${CONTEXTS//,/ }; do batched_run "$ctx"; done
elif [ -n "$GPU" ]; then
  # Seconds needed: loading the 19.6 GB GGUF into GPU memory plus the runs, with margin. The
  # first run is verbose (-v: setup logs only, nothing per step) so its log says what flash
  # attention "auto" resolved to and how many layers were offloaded.
  run pp512 60 -p 512 -n 0 -r 5 -v
  run tg32_at4096 60 -p 0 -n 32 -d 4096 -r 2
  run tg32_at32768 120 -p 0 -n 32 -d 32768 -r 2
  run pp4096_pp32768 120 -p 4096,32768 -n 0 -r 1
else
  run pp512_tg16 30 -p 512 -n 16 -r 2
  run pp4096 60 -p 4096 -n 0 -r 1 --no-warmup
  run tg16_at4096 60 -p 0 -n 16 -d 4096 -r 1 --no-warmup
fi
[ "$DRY_RUN" = 1 ] || echo "total_s=$(( $(date +%s) - start ))"
