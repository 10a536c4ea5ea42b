"""The MSL rules the kernel compile and the runtime enforce (issue 16, section 1): what clang's
C++ accepts but Apple's Metal compiler or runtime does not. Each rule on a small bad kernel,
rejected with a message naming file:line (the lint's rules: tests/test_lint_metal.py).

- position attributes of a kernel: all scalars or all vectors of one width, and the pairs the
  MSL specification ties together of one type (the binder refuses the kernel);
- constructs newer than the library's language: C++14 for MSL 3.x, C++17 for MSL 4.0;
- a thread-local array that stays in stack memory at -O2 (its index or size depends on a
  run-time value), found in the kernel's LLVM IR;
- set_bytes over 4 KB; static plus dynamic threadgroup memory over 32 KB;
- more than 256 threads per threadgroup without [[max_total_threads_per_threadgroup(N)]].
"""

import re

import numpy as np
import pytest

import lily
from msl_cpu_harness import dispatch, msl_cpu, read

FILE = "tests/msl/kernels/conformance.metal"  # the name the diagnostics carry (never written)


@pytest.fixture(scope="module")
def dev():
    return msl_cpu.device()


def compile_error(dev, source, language="3.1"):
    with pytest.raises(lily.LilyError) as e:
        dev.library(source, FILE, language=language)
    return str(e.value)


HEAD = '#include <metal_stdlib>\n#include "lily_msl.h"\nusing namespace metal;\n'  # 3 lines


# ---- position attributes ------------------------------------------------------------------------

def test_position_attributes_mixing_scalars_and_vectors(dev):
    src = HEAD + (
        "kernel void mixed(device float* out [[buffer(0)]],\n"
        "                  uint2 tg [[threadgroup_position_in_grid]],\n"
        "                  uint threads [[threads_per_threadgroup]]) {\n"  # line 6
        "  out[tg.x] = float(threads);\n}\n")
    msg = compile_error(dev, src)
    assert f"{FILE}:6: kernel 'mixed': 'threads' [[threads_per_threadgroup]] is uint but 'tg' " \
           "[[threadgroup_position_in_grid]] is uint2" in msg
    assert "all scalars or all vectors of one width" in msg


def test_position_attributes_of_two_widths(dev):
    src = HEAD + (
        "kernel void widths(device float* out [[buffer(0)]], uint3 gid [[thread_position_in_grid]],\n"
        "                   uint2 tg [[threadgroup_position_in_grid]]) {\n"  # line 5
        "  out[gid.x] = float(tg.y);\n}\n")
    assert f"{FILE}:5: kernel 'widths': 'tg' [[threadgroup_position_in_grid]] is uint2 but 'gid'" in compile_error(dev, src)


def test_position_attribute_pairs_of_one_type(dev):
    src = HEAD + (
        "kernel void pair(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],\n"
        "                 ushort n [[threads_per_grid]]) {\n"  # line 5
        "  out[gid] = float(n);\n}\n")
    msg = compile_error(dev, src)
    assert f"{FILE}:5: kernel 'pair': 'n' [[threads_per_grid]] is ushort but 'gid' [[thread_position_in_grid]] is " \
           "uint: Metal requires the two of the same type" in msg


def test_position_attributes_of_one_width_pass(dev):
    src = HEAD + (
        "kernel void ok(device float* out [[buffer(0)]], uint2 tg [[threadgroup_position_in_grid]],\n"
        "               uint2 threads [[threads_per_threadgroup]], uint tid [[thread_index_in_threadgroup]]) {\n"
        "  out[tg.x * threads.x + tid] = float(tid);\n}\n")
    out = dev.buffer_empty(4 * 64)
    dispatch(dev, dev.library(src, FILE).pipeline("ok"), (2,), (32,), {0: out})
    np.testing.assert_array_equal(read(out, np.float32), np.tile(np.arange(32), 2))


# ---- language level -------------------------------------------------------------------------------

CXX17 = HEAD + (
    "struct Pair { float a, b; };\n"
    "kernel void k(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
    "  if constexpr (sizeof(float) == 4) out[gid] = 1.0f;\n"  # line 6
    "}\n")


def test_cxx17_in_an_msl3_library(dev):
    msg = compile_error(dev, CXX17)
    assert f"{FILE}:6:" in msg and "constexpr if is incompatible with C++ standards before C++17" in msg


def test_cxx17_allowed_in_msl4_but_not_cxx20():
    dev4 = msl_cpu.device(metal4=True)
    dev4.library(CXX17, FILE, language="4.0")  # MSL 4.0 is C++17-based
    src = HEAD + (
        "struct Pair { float a, b; };\n"
        "kernel void k(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
        "  Pair p{.a = 1.0f, .b = 2.0f};\n"  # line 6: C++20
        "  out[gid] = p.a;\n}\n")
    msg = compile_error(dev4, src, language="4.0")
    assert f"{FILE}:6:" in msg and "designated initializers are incompatible with C++ standards before C++20" in msg


# ---- arrays in stack memory ----------------------------------------------------------------------

def test_runtime_indexed_thread_array_is_refused(dev):
    src = HEAD + (
        "kernel void k(device float* out [[buffer(0)]], constant uint& n [[buffer(1)]],\n"
        "              uint gid [[thread_position_in_grid]]) {\n"
        "  float acc[16];\n"  # line 6
        "  for (uint i = 0; i < n; ++i) acc[i] = out[i];\n"
        "  out[gid] = acc[gid % 16];\n}\n")
    msg = compile_error(dev, src)
    assert "thread-local arrays stay in stack memory after -O2" in msg
    assert re.search(rf"{re.escape(FILE)}:6: 'acc' \[16 x float\] in k\b", msg), msg


def test_compile_time_indexed_thread_array_passes(dev):
    src = HEAD + (
        "template <int N>\n"
        "kernel void sum_n(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
        "  float acc[N];\n"
        "  LILY_UNROLL for (int i = 0; i < N; ++i) acc[i] = out[gid * N + i];\n"
        "  float s = 0.0f;\n"
        "  LILY_UNROLL for (int i = 0; i < N; ++i) s += acc[i];\n"
        "  out[gid * N] = s;\n}\n"
        'LILY_KERNEL_INSTANTIATE("sum_16", sum_n, 16)\n')
    x = np.arange(32, dtype=np.float32)
    buf = dev.buffer(x)
    dispatch(dev, dev.library(src, FILE).pipeline("sum_16"), (1,), (2,), {0: buf})
    got = read(buf, np.float32)
    assert got[0] == x[:16].sum() and got[16] == x[16:].sum()


# ---- resource limits ----------------------------------------------------------------------------

SIMPLE = HEAD + (
    "kernel void copy(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],\n"
    "                 uint gid [[thread_position_in_grid]]) { out[gid] = in[gid]; }\n"
    "[[max_total_threads_per_threadgroup(LILY_WIDE)]]\n"
    "kernel void copy_wide(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],\n"
    "                      uint gid [[thread_position_in_grid]]) { out[gid] = in[gid]; }\n"
    "#define LILY_WIDE 512\n")


def test_set_bytes_over_4kb(dev):
    lib = dev.library(SIMPLE, FILE)
    enc = dev.command_buffer().compute_encoder()
    enc.set_pipeline(lib.pipeline("copy"))
    enc.set_bytes(0, bytes(4096))  # the limit itself is fine
    with pytest.raises(lily.LilyError, match="set_bytes: 4100 bytes at index 0 are more than the 4096 Metal's "
                                             "setBytes takes"):
        enc.set_bytes(0, bytes(4100))


def test_more_than_256_threads_need_the_attribute(dev):
    """Without [[max_total_threads_per_threadgroup(N)]] a pipeline is counted on for 256 threads
    (register pressure may lower a Metal pipeline's limit); N may come from a macro of the file."""
    lib = dev.library(SIMPLE, FILE)
    plain, wide = lib.pipeline("copy"), lib.pipeline("copy_wide")
    assert (plain.max_total_threads_per_threadgroup, wide.max_total_threads_per_threadgroup) == (256, 512)
    x = np.arange(512, dtype=np.float32)
    out = dev.buffer_empty(4 * 512)
    with pytest.raises(lily.LilyError, match=r"kernel 'copy': 512 threads per threadgroup exceed the pipeline's "
                                             r"maximum of 256 \(a kernel dispatched with more than 256 threads "
                                             r"declares \[\[max_total_threads_per_threadgroup\(N\)\]\]"):
        dispatch(dev, plain, (1,), (512,), {0: dev.buffer(x), 1: out})
    dispatch(dev, wide, (1,), (512,), {0: dev.buffer(x), 1: out})
    np.testing.assert_array_equal(read(out, np.float32), x)


def test_static_plus_dynamic_threadgroup_memory_over_32kb(dev):
    src = HEAD + (
        "kernel void big(device float* out [[buffer(0)]], threadgroup float* dyn [[threadgroup(0)]],\n"
        "                uint tid [[thread_index_in_threadgroup]]) {\n"
        "  LILY_THREADGROUP(float, tile, [4096]);\n"  # line 6: 16 KB declared in the kernel
        "  tile[tid] = 1.0f;\n  dyn[tid] = 2.0f;\n"
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  out[tid] = tile[tid] + dyn[tid];\n}\n")
    lib = dev.library(src, FILE)
    out = dev.buffer_empty(4 * 32)
    dispatch(dev, lib.pipeline("big"), (1,), (32,), {0: out}, {0: 16384})  # 16 + 16 KB: fits
    np.testing.assert_array_equal(read(out, np.float32), 3.0)
    with pytest.raises(lily.LilyError) as e:
        dispatch(dev, lib.pipeline("big"), (1,), (32,), {0: out}, {0: 16400})
    msg = str(e.value)
    assert "threadgroup memory: 'tile' (16384 bytes) takes the threadgroup to 32784 bytes (16384 declared in the " \
           "kernel + 16400 set_threadgroup_memory_length), more than the 32768 that Apple GPUs have" in msg
    assert f"at {FILE}:6" in msg


# ---- errors name the encoder ---------------------------------------------------------------------

def test_execution_error_names_the_encoder_and_signpost(dev):
    """As Metal's encoder execution status (MTLCommandBufferErrorOptionEncoderExecutionStatus) does:
    a failed dispatch is reported with its encoder's label and the last debug signpost before it."""
    lib = dev.library(HEAD + (
        "kernel void diverge(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {\n"
        "  if (tid > 3) return;\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n  out[tid] = 1.0f;\n}\n"),
        FILE)
    cb = dev.command_buffer()
    enc = cb.compute_encoder(label="decode step 7")
    enc.set_pipeline(lib.pipeline("diverge"))
    enc.set_buffer(0, dev.buffer_empty(4 * 32), 0)
    enc.insert_debug_signpost("layer 3 attention")
    enc.dispatch_threadgroups((1,), (32,))
    enc.end_encoding()
    cb.commit()
    with pytest.raises(lily.LilyError, match=r"kernel 'diverge'.*\[encoder 'decode step 7' after signpost "
                                             r"'layer 3 attention'\]"):
        cb.wait_until_completed()

