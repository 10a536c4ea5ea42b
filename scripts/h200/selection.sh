# The kernel tests of the MSL-on-CPU suite that run on msl-cuda (sourced by prepare.sh and
# kernel_tests.sh, so the PTX prepared here is the PTX the GPU run needs). Left out: whole-model
# tests (they load backend="msl-cpu" by name, so they would run on the CPU; whole models on the
# GPU are scripts/h200/fullsize.py's), the fiber runtime's own behaviour (ucontext fibers, compile errors, which need clang) and
# tests/test_msl_cpu_bugs.py (msl_cpu's bug detectors).
KERNEL_TESTS=(
  tests/test_msl_cpu.py
  tests/test_metal_kernels.py
  tests/test_metal_sampling.py
  tests/test_metal_prefill.py
  tests/test_metal_prefill_moe.py
)
KERNEL_TESTS_K="not (ucontext_fibers or compile_error_points_into or chunked_prefill_then_decode or generate_greedy_from_prompt or prefill_chunk or prefill_then_decode_matches_cpu)"
