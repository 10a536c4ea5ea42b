#!/usr/bin/env bash
# Issue 17, phase B run 1. Run ON THE H200 MACHINE (at most 10 minutes), after
# scripts/h200/prepare.sh here filled .carry/: builds lily's extension from this tree (the
# image's g++, cmake, ninja, nanobind), then runs the kernel tests of the MSL-on-CPU suite
# (selection.sh) on msl-cuda, loading the carried PTX (there is no clang there). Tests that ask
# for randomized interleavings run with threadgroups launched in a permuted order.
# Device call, from the checkout holding this tree:
#   run(command="bash scripts/h200/kernel_tests.sh", carry=[".carry"], timeout_s=600)
# Results in $OUT: env.txt (GPU, driver), build.log, kernel_tests.log, kernel_tests.xml.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
OUT=${OUT:-$root/.carry/out}
mkdir -p "$OUT"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 --version
  python3 -c "import sysconfig, os; h = sysconfig.get_paths()['include']; print('Python.h:', os.path.exists(h + '/Python.h'), h)"
} > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl >> "$OUT/env.txt" 2>&1
# The image's g++ links libstdc++ into lily._core statically; torch (imported first by the tests)
# brings the shared one, and std::regex in the kernel scanner then crashed inside the static copy
# (seen 2026-12-01). One libstdc++ for the process: the shared one, loaded before everything.
export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}
start=$(date +%s)
if ! bash scripts/dev_build.sh > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
export PYTHONPATH="$root/src:$root/tests:/tmp/site" LILY_SOURCE_DIR="$root" \
  LILY_MSL_CUDA_CACHE="$root/.carry/ptx" LILY_TEST_MSL_RUNTIME=cuda PYTHONUNBUFFERED=1
python3 -c "from lily._core import msl_cuda; print(msl_cuda.device().name)" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
source scripts/h200/selection.sh
timeout 420 python3 -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" -k "$KERNEL_TESTS_K" \
  --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log" | tail -60
