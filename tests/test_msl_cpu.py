"""The MSL-on-CPU runtime runs idiomatic Metal kernels with the GPU's semantics: each kernel
in tests/msl/kernels/ is compared with NumPy (and torch for bfloat16) on sizes around the SIMD
width (31, 32, 33, 1000) and threadgroup sizes from 32 to 1024."""

import numpy as np
import pytest
import torch

from msl_cpu_harness import RUNTIME, dispatch, library, msl_cpu, read, u32

SIZES = [31, 32, 33, 1000]
THREADGROUPS = [32, 64, 256, 1024]


@pytest.fixture(scope="module")
def dev():
    return msl_cpu.device()


@pytest.fixture(scope="module")
def libs(dev):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = library(dev, name)
        return cache[name]

    return get


# ---- threadgroup reduction ---------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("tg", THREADGROUPS)
@pytest.mark.parametrize("kernel", ["reduce_tree", "reduce_simd_float", "reduce_simd_half"])
def test_reduction(dev, libs, kernel, n, tg):
    rng = np.random.default_rng(n * 7 + tg)
    dtype = np.float16 if kernel.endswith("half") else np.float32
    x = rng.standard_normal(n).astype(dtype)
    per_group = 300
    groups = -(-n // per_group)
    out = dev.buffer_empty(4 * groups)
    tg_mem = {0: 4 * tg} if kernel == "reduce_tree" else None
    dispatch(
        dev,
        libs("reduce.metal").pipeline(kernel),
        (groups,),
        (tg,),
        {0: dev.buffer(x), 1: out, 2: u32(n, per_group)},
        tg_mem,
    )
    ref = np.add.reduceat(x.astype(np.float64), np.arange(0, n, per_group))
    np.testing.assert_allclose(read(out, np.float32), ref, rtol=1e-5, atol=1e-4)


def test_reduction_short_last_simdgroup(dev, libs):
    # 66 threads: simdgroups of 32, 32 and 2 lanes.
    x = np.arange(1000, dtype=np.float32)
    out = dev.buffer_empty(4 * 4)
    dispatch(
        dev,
        libs("reduce.metal").pipeline("reduce_simd_float"),
        (4,),
        (66,),
        {0: dev.buffer(x), 1: out, 2: u32(1000, 250)},
    )
    np.testing.assert_array_equal(read(out, np.float32), x.reshape(4, 250).sum(1))


# ---- prefix scan (three dispatches, memory barriers between them) --------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("tg", THREADGROUPS)
def test_prefix_scan(dev, libs, n, tg):
    rng = np.random.default_rng(n + tg)
    x = rng.integers(0, 1000, n, dtype=np.uint32)
    blocks = -(-n // tg)
    lib = libs("scan.metal")
    scan, add = lib.pipeline("scan_blocks"), lib.pipeline("add_offsets")
    inb, out = dev.buffer(x), dev.buffer_empty(4 * n)
    totals, offsets, grand = (
        dev.buffer_empty(4 * blocks),
        dev.buffer_empty(4 * blocks),
        dev.buffer_empty(4),
    )

    cb = dev.command_buffer()
    enc = cb.compute_encoder(concurrent=True)
    enc.set_pipeline(scan)
    for i, b in enumerate([inb, out, totals]):
        enc.set_buffer(i, b, 0)
    enc.set_bytes(3, u32(n))
    enc.dispatch_threadgroups((blocks,), (tg,))
    enc.memory_barrier()
    for i, b in enumerate([totals, offsets, grand]):  # bindings persist; rebind what changes
        enc.set_buffer(i, b, 0)
    enc.set_bytes(3, u32(blocks))
    enc.dispatch_threadgroups((1,), (max(32, blocks),))
    enc.memory_barrier()
    enc.set_pipeline(add)
    enc.set_buffer(0, out, 0)
    enc.set_buffer(1, offsets, 0)
    enc.set_bytes(2, u32(n))
    enc.dispatch_threadgroups((blocks,), (tg,))
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()

    ref = np.concatenate([[0], np.cumsum(x, dtype=np.uint64)[:-1]]).astype(np.uint32)
    np.testing.assert_array_equal(read(out, np.uint32), ref)
    assert read(grand, np.uint32)[0] == x.sum()


# ---- atomic histogram --------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("tg", [32, 128, 1024])
@pytest.mark.parametrize("bins", [7, 64])
def test_atomic_histogram(dev, libs, n, tg, bins):
    rng = np.random.default_rng(n * bins + tg)
    values = rng.integers(0, 10_000, n, dtype=np.uint32)
    hist = dev.buffer(np.zeros(bins, np.uint32))
    tg_bytes = -(-4 * bins // 16) * 16
    dispatch(
        dev,
        libs("histogram.metal").pipeline("histogram"),
        (-(-n // tg),),
        (tg,),
        {0: dev.buffer(values), 1: hist, 2: u32(n, bins)},
        {0: tg_bytes},
    )
    np.testing.assert_array_equal(read(hist, np.uint32), np.bincount(values % bins, minlength=bins))


# ---- tiled matmul through threadgroup memory, with a function constant ---------------------

SHAPES = [(31, 33, 32), (32, 32, 32), (33, 31, 1000), (1, 1000, 33)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_tiled_matmul(dev, libs, M, N, K, has_bias):
    rng = np.random.default_rng(M * N + K)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    pso = libs("matmul.metal").pipeline(
        "matmul_tiled", constants={0: ("bool", has_bias), 1: ("bool", False)}
    )
    C = dev.buffer_empty(4 * M * N)
    buffers = {0: dev.buffer(A), 1: dev.buffer(B), 2: C, 3: u32(M, N, K)}
    if has_bias:
        buffers[4] = dev.buffer(bias)
    dispatch(dev, pso, (-(-N // 16), -(-M // 16)), (16, 16), buffers)
    ref = A.astype(np.float64) @ B + (bias if has_bias else 0)
    np.testing.assert_allclose(read(C, np.float32, (M, N)), ref, rtol=1e-4, atol=1e-4)


# ---- simdgroup_matrix matmul -------------------------------------------------------------


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", ["float", "half", "bfloat"])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_simdgroup_matmul(dev, libs, M, N, K, dtype, transpose_b):
    rng = np.random.default_rng(M + N * K)
    A = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
    B = torch.from_numpy(rng.standard_normal((N, K) if transpose_b else (K, N)).astype(np.float32))
    tdt = {"float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16}[dtype]
    A, B = A.to(tdt), B.to(tdt)
    raw = lambda t: t.view(torch.int16).numpy() if tdt != torch.float32 else t.numpy()  # noqa: E731
    pso = libs("matmul.metal").pipeline(
        f"matmul_simdgroup_{dtype}", constants={0: ("bool", False), 1: ("bool", transpose_b)}
    )
    C = dev.buffer_empty(4 * M * N)
    dispatch(
        dev,
        pso,
        (-(-N // 8), -(-M // 8)),
        (32,),
        {0: dev.buffer(raw(A)), 1: dev.buffer(raw(B)), 2: C, 3: u32(M, N, K)},
    )
    Bm = B.double().T if transpose_b else B.double()
    ref = (A.double() @ Bm).numpy()
    np.testing.assert_allclose(read(C, np.float32, (M, N)), ref, rtol=1e-4, atol=1e-3)


# ---- half / bfloat arithmetic: rounded after every operation ------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["half", "bfloat", "float"])
def test_half_bfloat_arithmetic(dev, libs, n, dtype):
    tdt = {"float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(n)
    a, b, c = (torch.randn(n, generator=g).mul(3).to(tdt) for _ in range(3))
    as_np = lambda t: t.view(torch.int16).numpy() if tdt != torch.float32 else t.numpy()  # noqa: E731
    out = dev.buffer_empty(4 * n * a.element_size())
    dispatch(
        dev,
        libs("arithmetic.metal").pipeline(f"arith_{dtype}"),
        (-(-n // 64),),
        (64,),
        {
            0: dev.buffer(as_np(a)),
            1: dev.buffer(as_np(b)),
            2: dev.buffer(as_np(c)),
            3: out,
            4: u32(n),
        },
    )
    raw = torch.from_numpy(read(out, np.int16 if tdt != torch.float32 else np.float32))
    got = (raw.view(tdt) if tdt != torch.float32 else raw).reshape(n, 4)
    # torch evaluates each operation in its dtype, rounding every result: the GPU's semantics.
    s = a * b + c
    mixed = s * s - a
    # Metal's default fast math may contract a*b+c into one FMA (one rounding), as msl-cuda does
    # (nvptx has half and float FMAs; x86 without -mfma has none): float64 holds a*b+c of half,
    # bfloat and float inputs exactly enough that rounding it once is the FMA's result.
    def fused(x, y, z):
        return (x.double() * y.double() + z.double()).to(tdt)

    # Each column is the rounded-per-operation result or the fused one, entirely; a wider
    # intermediate (an unrounded half sum, say) is neither.
    for col, (plain, fma) in enumerate([(s, fused(a, b, c)), (mixed, fused(s, s, -a))]):
        assert torch.equal(got[:, col], plain) or torch.equal(got[:, col], fma), col
    if RUNTIME == "cpu":  # x86 builds have no FMA to contract into: every operation rounds
        assert torch.equal(got[:, 0], s) and torch.equal(got[:, 1], mixed)
    # Math functions: within one unit in the last place of the type.
    exp_ref = torch.exp(a.float()).to(tdt)
    sqrt_ref = torch.sqrt(b.abs()) / (c.abs() + 1)
    ulp = {"float": 1e-6, "half": 1e-3, "bfloat": 8e-3}[dtype]
    torch.testing.assert_close(got[:, 2].float(), exp_ref.float(), rtol=ulp, atol=0)
    torch.testing.assert_close(got[:, 3].float(), sqrt_ref.float(), rtol=2 * ulp, atol=0)


def test_half_rounds_every_operation(dev, libs):
    # (1 + 2^-10)^2 - (1 + 2^-9) is 2^-20 exactly but 0 when each operation rounds to half.
    one_ulp = np.float16(1 + 2**-10)
    a = np.full(32, one_ulp, np.float16)
    c = np.full(32, -np.float16(1 + 2**-9), np.float16)
    out = dev.buffer_empty(4 * 32 * 2)
    dispatch(
        dev,
        libs("arithmetic.metal").pipeline("arith_half"),
        (1,),
        (32,),
        {0: dev.buffer(a), 1: dev.buffer(a), 2: dev.buffer(c), 3: out, 4: u32(32)},
    )
    got = read(out, np.float16, (32, 4))
    assert np.all(got[:, 0] == (a * a) + c)  # NumPy float16 rounds every operation too
    assert np.all(got[:, 0] == 0)


# ---- vector semantics and simdgroup functions --------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_vector_semantics(dev, libs, n):
    rng = np.random.default_rng(n)
    v = (rng.standard_normal((n, 4)) * 100).astype(np.float32)
    conv, bits = dev.buffer_empty(16 * n), dev.buffer_empty(16 * n)
    halves, shuf = dev.buffer_empty(8 * n), dev.buffer_empty(16 * n)
    dispatch(
        dev,
        libs("arithmetic.metal").pipeline("vector_semantics"),
        (-(-n // 32),),
        (32,),
        {0: dev.buffer(v), 1: conv, 2: bits, 3: halves, 4: shuf, 5: u32(n)},
    )
    np.testing.assert_array_equal(read(conv, np.int32, (n, 4)), np.trunc(v).astype(np.int32))
    np.testing.assert_array_equal(read(bits, np.uint32, (n, 4)), v.view(np.uint32))
    np.testing.assert_array_equal(read(halves, np.float16, (n, 4)), v.astype(np.float16))
    ref = np.stack([v[:, 2], v[:, 3], v[:, 0], np.ones(n, np.float32)], 1) + v[
        :, ::-1
    ] * np.float32(2)
    np.testing.assert_array_equal(read(shuf, np.float32, (n, 4)), ref)


@pytest.mark.parametrize("tg", [31, 32, 33, 64, 1000])
def test_simd_functions(dev, libs, tg):
    rng = np.random.default_rng(tg)
    x = rng.random(tg).astype(np.float32)
    out = dev.buffer_empty(4 * 8 * tg)
    dispatch(
        dev, libs("arithmetic.metal").pipeline("simd_ops"), (1,), (tg,), {0: dev.buffer(x), 1: out}
    )
    got = read(out, np.float32, (tg, 8))
    for start in range(0, tg, 32):  # each simdgroup; the last may be short
        lanes = x[start : start + 32].astype(np.float64)
        k = len(lanes)
        g = got[start : start + k]
        np.testing.assert_allclose(g[:, 0], lanes.sum(), rtol=1e-6)
        np.testing.assert_array_equal(g[:, 1], lanes.max().astype(np.float32))
        np.testing.assert_allclose(g[:, 2], np.cumsum(lanes), rtol=1e-6)
        np.testing.assert_allclose(g[:, 3], np.cumsum(lanes) - lanes, rtol=1e-6, atol=1e-7)
        # shuffle_down by 1: the last lane keeps its own value (no wrap-around).
        np.testing.assert_array_equal(g[:, 4], np.append(lanes[1:], lanes[-1]).astype(np.float32))
        np.testing.assert_array_equal(
            g[:, 5], np.float32(lanes[3]) if k > 3 else lanes.astype(np.float32)
        )
        xor = [lanes[i ^ 1] if (i ^ 1) < k else lanes[i] for i in range(k)]
        np.testing.assert_array_equal(g[:, 6], np.array(xor, np.float32))
        np.testing.assert_array_equal(g[:, 7], np.float32((lanes > 0.5).sum()))


# ---- the Device interface's own checks ------------------------------------------------------


def test_unbound_buffer_is_named(dev, libs):
    cb = dev.command_buffer()
    enc = cb.compute_encoder()
    enc.set_pipeline(libs("scan.metal").pipeline("add_offsets"))
    enc.set_buffer(0, dev.buffer_empty(16), 0)
    with pytest.raises(
        ValueError, match=r"kernel 'add_offsets': buffer\(1\) \(block_offsets\) is not bound"
    ):
        enc.dispatch_threadgroups((1,), (4,))


def test_small_constant_buffer_and_thread_limits(dev, libs):
    lib = libs("histogram.metal")
    cb = dev.command_buffer()
    enc = cb.compute_encoder()
    enc.set_pipeline(lib.pipeline("histogram"))
    enc.set_buffer(0, dev.buffer_empty(16), 0)
    enc.set_buffer(1, dev.buffer_empty(16), 0)
    enc.set_bytes(2, u32(4))  # HistogramArgs is 8 bytes
    enc.set_threadgroup_memory_length(0, 16)
    with pytest.raises(
        ValueError, match=r"buffer\(2\) \(args\) has 4 bytes but the kernel reads 8"
    ):
        enc.dispatch_threadgroups((1,), (32,))
    enc.set_bytes(2, u32(4, 4))
    with pytest.raises(ValueError, match="1025 threads per threadgroup exceed"):
        enc.dispatch_threadgroups((1,), (1025,))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        enc.set_threadgroup_memory_length(0, 20)


def test_compile_error_points_into_the_metal_file(dev):
    src = "#include <metal_stdlib>\nusing namespace metal;\n\nkernel void broken(device float* x [[buffer(0)]]) {\n  x[0] = undefined_name;\n}\n"
    with pytest.raises(
        ValueError,
        match=r"broken\.metal:5:10: error: use of undeclared identifier 'undefined_name'",
    ):
        dev.library(src, "tests/msl/kernels/broken.metal")


def test_unknown_function_lists_the_library(dev, libs):
    with pytest.raises(
        ValueError, match=r"'nope' is not in .*scan\.metal \(it has: scan_blocks, add_offsets\)"
    ):
        libs("scan.metal").pipeline("nope")


@pytest.mark.parametrize("tg", [31, 33, 64])
def test_more_simd_functions(dev, libs, tg):
    rng = np.random.default_rng(tg + 1)
    x = rng.uniform(0.9, 1.1, tg).astype(np.float32)
    bits = rng.integers(0, 2**32, tg, dtype=np.uint32)
    out, out_bits = dev.buffer_empty(4 * 6 * tg), dev.buffer_empty(4 * 2 * tg)
    dispatch(
        dev,
        libs("arithmetic.metal").pipeline("simd_ops_more"),
        (1,),
        (tg,),
        {0: dev.buffer(x), 1: dev.buffer(bits), 2: out, 3: out_bits},
    )
    got, got_bits = read(out, np.float32, (tg, 6)), read(out_bits, np.uint32, (tg, 2))
    for start in range(0, tg, 32):
        lanes = x[start : start + 32]
        k = len(lanes)
        g, gb = got[start : start + k], got_bits[start : start + k]
        # shuffle_up by 2: the first two lanes keep their own value.
        np.testing.assert_array_equal(g[:, 0], np.concatenate([lanes[:2], lanes[:-2]])[:k])
        np.testing.assert_array_equal(g[:, 1], lanes.min())
        np.testing.assert_allclose(g[:, 2], np.prod(lanes.astype(np.float64)), rtol=1e-5)
        quads = [lanes[i & ~3 : (i & ~3) + 4].astype(np.float64).sum() for i in range(k)]
        np.testing.assert_allclose(g[:, 3], quads, rtol=1e-6)
        np.testing.assert_array_equal(g[:, 4], lanes[0])
        np.testing.assert_allclose(g[:, 5], np.cumprod(lanes.astype(np.float64)), rtol=1e-5)
        group_bits = bits[start : start + k]
        np.testing.assert_array_equal(gb[:, 0], np.bitwise_or.reduce(group_bits))
        np.testing.assert_array_equal(gb[:, 1], np.bitwise_and.reduce(group_bits))


@pytest.mark.parametrize(
    "constants,expect",
    [
        ({}, lambda x: x),
        ({0: ("float", 2.5)}, lambda x: x * np.float32(2.5)),
        (
            {0: ("float", 0.5), 1: ("uint", 7), 2: ("half", 0.25)},
            lambda x: x * np.float32(0.5) + 7.25,
        ),
        ({3: ("int", -1), 1: ("uint", 3)}, lambda x: -(x + 3)),
    ],
)
def test_function_constants_of_each_type(dev, libs, constants, expect):
    x = np.linspace(-4, 4, 40, dtype=np.float32)
    out = dev.buffer_empty(4 * 40)
    pso = libs("constants.metal").pipeline("apply_constants", constants=constants)
    dispatch(dev, pso, (2,), (20,), {0: dev.buffer(x), 1: out})
    np.testing.assert_allclose(read(out, np.float32), expect(x).astype(np.float32), rtol=1e-6)


def test_function_constant_of_the_wrong_type(dev, libs):
    with pytest.raises(ValueError, match="function constant 1 'offset' is declared uint"):
        libs("constants.metal").pipeline("apply_constants", constants={1: ("float", 1.0)})


def test_ucontext_fibers(tmp_path):
    # The portable fiber switch (swapcontext: used under ASan and on CPUs other than x86-64)
    # runs the same barrier-heavy kernel to the same result, and still reports divergence.
    import os
    import subprocess
    import sys
    from pathlib import Path

    import lily

    script = """
import numpy as np
from msl_cpu_harness import RUNTIME, dispatch, library, msl_cpu, read, u32
dev = msl_cpu.device()
x = np.arange(1000, dtype=np.float32)
out = dev.buffer_empty(16)
lib = library(dev, "reduce.metal")
dispatch(dev, lib.pipeline("reduce_tree"), (4,), (256,), {0: dev.buffer(x), 1: out,
         2: u32(1000, 250)}, {0: 1024})
assert (read(out, np.float32) == x.reshape(4, 250).sum(1)).all()
bugs = library(dev, "bugs.metal")
try:
    dispatch(dev, bugs.pipeline("divergent_barrier"), (1,), (64,), {0: out, 1: u32(40)})
except ValueError as e:
    assert "threads 40-63 returned" in str(e)
    print("ok")
"""
    tests = Path(__file__).resolve().parent
    env = dict(
        os.environ,
        LILY_MSL_CPU_UCONTEXT="1",
        PYTHONPATH=os.pathsep.join([str(Path(lily.__file__).parent.parent), str(tests)]),
    )
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.stdout.strip() == "ok", r.stderr[-2000:]
