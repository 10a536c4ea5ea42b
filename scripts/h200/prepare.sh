#!/usr/bin/env bash
# Issue 17, phase B preparation. Run HERE, on a machine with clang-19 (not on the GPU machine).
# Fills .carry/ (ignored by git; the device tool carries it with carry=[".carry"]) with what the
# H200 machine needs and cannot make itself (it has no clang, no network and no mlx):
#   .carry/ptx/  PTX of every backend kernel (python -m lily.msl_cuda compile), and of every
#                library and function-constant specialization the kernel tests make: the tests
#                of selection.sh run here on the MSL-on-CPU runtime with
#                LILY_TEST_MSL_RUNTIME=cuda-compile, which compiles each one for CUDA as they go
#                (so they are also checked to pass here first)
#   .carry/whl/  the mlx wheels for Python 3.12 (tests/test_metal_kernels.py imports mlx)
# Needs: the extension built (bash scripts/dev_build.sh) and the test dependencies
# (pip install ".[test]", which brings nvidia-cuda-nvcc's ptxas and libdevice). About 5 minutes
# on 2 cores. Then on the GPU machine: bash scripts/h200/kernel_tests.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source scripts/h200/selection.sh
rm -rf .carry/ptx .carry/ptx.build .carry/whl
mkdir -p .carry/ptx .carry/whl
export PYTHONPATH="$root/src:$root/tests" LILY_SOURCE_DIR="$root" LILY_MSL_CUDA_CACHE="$root/.carry/ptx.build"
python -m lily.msl_cuda compile
LILY_TEST_MSL_RUNTIME=cuda-compile python -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" -k "$KERNEL_TESTS_K"
cp .carry/ptx.build/*.ptx .carry/ptx/  # only the PTX travels (the generated units stay here)
rm -rf .carry/ptx.build
mlx=$(python -c "import importlib.metadata as m; print(m.version('mlx'))")
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d .carry/whl "mlx==$mlx" "mlx-cpu==$mlx"
python -m lily.msl_cuda ptxas --cache .carry/ptx --json .carry/ptxas_sm90.json > .carry/ptxas_sm90.txt
du -sh .carry/ptx .carry/whl
