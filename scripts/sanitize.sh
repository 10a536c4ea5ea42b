#!/usr/bin/env bash
# Sanitizer job: builds lily._core with AddressSanitizer + UndefinedBehaviorSanitizer
# (-DLILY_SANITIZE=ON, clang-19) into build/asan and runs the native-facing tests against it:
# the engine (a subset of the transformers comparison, the bad-checkpoint and failure tests)
# and the MSL-on-CPU runtime. Any ASan report or UBSan diagnostic fails the run.
#   scripts/sanitize.sh [--ci] [extra pytest args]
# --ci: the subset scripts/test.sh (CI) runs, chosen to take well under 12 minutes with the build
# on a fresh 2-core machine: every native-facing area once (loader bad inputs, fuzz findings and
# hostile model folders, sampler and its token mask on both samplers, failure tests, MSL-on-CPU
# runtime, the CPU engine against transformers on one model type, a Metal decode on the
# MSL-on-CPU runtime, the int8 and f32 matmul kernels of both modes through a prefill and a
# decode). Without --ci: every file below, in full.
#
# The extension is a shared object loaded by an uninstrumented python, so the ASan runtime must
# be the first library in the process: it is LD_PRELOADed (clang's shared runtime, which carries
# the UBSan handlers too). Leak checking is off: CPython's interned objects and arenas are never
# freed at exit and would bury real reports. The normal build (build/dev, src/lily/_core*.so) is
# not touched: the tests import lily from a copy of src/lily with the sanitized extension.
set -euo pipefail
mode=full
if [ "${1:-}" = --ci ]; then mode=ci; shift; fi
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build/asan"
pkg="$build/py"
cc=${CC_SANITIZE:-clang-19} cxx=${CXX_SANITIZE:-clang++-19}
# The build runs outside pip's isolated build environment (the `test` extra installs these).
command -v cmake >/dev/null && python -m nanobind --cmake_dir >/dev/null 2>&1 ||
  { echo "sanitize.sh needs cmake and nanobind: pip install '.[test]'" >&2; exit 1; }
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLILY_SANITIZE=ON \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
# Only the extension: the type-stub step imports the module, which needs the preload below.
cmake --build "$build" --target _core -j "${SANITIZE_JOBS:-2}"

rm -rf "$pkg" && mkdir -p "$pkg"
cp -r "$root/src/lily" "$pkg/lily"
rm -f "$pkg"/lily/_core*.so
cp "$build"/_core*.so "$pkg/lily/"

runtime=$("$cxx" -print-file-name=libclang_rt.asan-x86_64.so)
[ -f "$runtime" ] || { echo "ASan runtime not found ($runtime): apt-get install libclang-rt-19-dev" >&2; exit 1; }
export LD_PRELOAD="$runtime"
# allocator_may_return_null: an allocation ASan cannot satisfy throws std::bad_alloc as in a
# normal build (tests/test_failures.py runs the KV cache out of memory on purpose).
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:symbolize=1:detect_stack_use_after_return=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export PYTHONPATH="$pkg"
cd "$root"
python -c "import lily, lily._core as c; assert c.__file__.startswith('$pkg'), c.__file__; print('sanitized extension:', c.__file__)"
# Two tests cannot run in a preloaded process, by their nature:
# - test_asan_needs_its_runtime checks the error raised when the ASan runtime is NOT loaded;
# - the KV out-of-memory test sets an address-space limit (ulimit -v), under which ASan's own
#   allocator cannot map its regions and aborts (ASan reserves terabytes of shadow memory).
never=(--deselect tests/test_msl_cpu_bugs.py::test_asan_needs_its_runtime
       --deselect tests/test_failures.py::test_kv_cache_out_of_memory_is_a_request_error)
if [ "$mode" = ci ]; then
  tests=(tests/test_bad_checkpoints.py tests/test_fuzz_regressions.py tests/test_sampler.py
         tests/test_failures.py tests/test_msl_cpu.py tests/test_msl_cpu_bugs.py
         tests/test_loader_hardening.py tests/test_padded_vocab.py
         "tests/test_metal_sampling.py::test_token_limit_same_token_as_cpu_sampler"
         "tests/test_forward_transformers.py::test_prefill_then_decode"
         "tests/test_forward_transformers.py::test_long_prompt_chunked"
         "tests/test_metal_decode.py::test_prefill_then_decode"
         "tests/test_cpu_int8.py::test_int8_kernel_matches_numpy"
         "tests/test_invariance.py::test_decode_equals_prefill")
  # One model type of the parametrized engine tests (the dense-FFN hybrid; the MoE types share
  # the attention / DeltaNet code and are covered by the full job).
  select=(-k "not ((test_forward_transformers or test_metal_decode) and (qwen3_5_moe or qwen3_next))")
else
  tests=(tests/test_bad_checkpoints.py tests/test_failures.py tests/test_fuzz_regressions.py
         tests/test_sampler.py tests/test_msl_cpu.py tests/test_msl_cpu_bugs.py
         tests/test_loader_hardening.py tests/test_padded_vocab.py tests/test_metal_sampling.py
         tests/test_forward_transformers.py tests/test_metal_decode.py tests/test_cpu_int8.py
         tests/test_invariance.py)
  select=()
fi
start=$SECONDS
status=0
python -m pytest -q -p no:cacheprovider "${tests[@]}" "${never[@]}" "${select[@]}" "$@" || status=$?
if [ "$status" != 0 ]; then
  echo "SANITIZER JOB FAILED (pytest exit $status): an ASan/UBSan report aborts the process that hit" \
       "it; see the report above" >&2
  exit "$status"
fi
echo "sanitizer job ($mode): clean, tests $((SECONDS - start)) s"
