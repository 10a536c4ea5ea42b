#!/usr/bin/env bash
# Everything the test suite needs on a fresh Debian/Ubuntu machine, then the suite itself.
# This is the README's test command; .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

# clang runs the Metal kernels on the CPU (MSL-on-CPU runtime); GNUstep headers type-check the
# Objective-C++ Metal host; the aarch64 cross compiler and qemu-user build and run the arm64
# (NEON) kernels (tests/test_cpu_kernel_builds.py).
if command -v apt-get >/dev/null; then
  if ! command -v clang-19 >/dev/null || ! command -v llvm-symbolizer-19 >/dev/null || ! [ -d /usr/include/GNUstep ] \
      || ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-19 libclang-rt-19-dev llvm-19 libgnustep-base-dev \
      g++-aarch64-linux-gnu qemu-user >/dev/null
  fi
fi

# torch first: the pinned version is a local CPU wheel on these machines (a plain `torch`
# would pull a multi-GB CUDA build).
python -m pip install -q "torch==2.13.0"
# Every other package at the version CI last passed with (scripts/constraints.txt), so a fresh
# machine installs what CI tested. UPDATE_PINS=1: the newest allowed versions instead, and the
# pins rewritten once the suite has passed with them (README: "how to update the pins").
if [ "${UPDATE_PINS:-0}" = 1 ]; then
  python -m pip install -q --upgrade --upgrade-strategy eager ".[test,server,structured]"
else
  python -m pip install -q -c scripts/constraints.txt ".[test,server,structured]"
fi
python -m ruff check src tests scripts benchmarks examples
python -m pytest -q tests "$@"
# The GPU backend's host side as msl-cuda drives it: the same Metal decode and prefill tests on
# msl-cpu buffers without host storage (opaque_buffers; tests/conftest.py), so a direct use of
# Buffer::contents() in csrc/gpu, which silently skips a copy on device memory, fails here.
LILY_TEST_OPAQUE_BUFFERS=1 python -m pytest -q tests/test_metal_decode.py tests/test_metal_prefill.py \
  tests/test_metal_prefill_moe.py -k "(test_metal_decode and (prefill_then_decode or device_greedy_pipelined \
  or sampled_device_loop or block_kv_layout or fork_and_snapshot)) or chunked_prefill_then_decode \
  or generate_greedy_from_prompt or prefill_then_decode_matches_cpu"
# The sanitizer job: lily._core rebuilt with ASan + UBSan into build/asan (the installed lily is
# not touched) and a subset of the native-facing tests run against it. A sanitizer report aborts
# the process that hit it, so the step, and CI, fail. Full job: scripts/sanitize.sh.
bash scripts/sanitize.sh --ci
if [ "${UPDATE_PINS:-0}" = 1 ]; then
  python scripts/update_constraints.py
fi
