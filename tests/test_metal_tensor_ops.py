"""The Metal 4 tensor-op path on the MSL-on-CPU runtime (issue 6).

- The runtime's emulation of Metal 4 tensors and MetalPerformancePrimitives' matmul2d
  (csrc/msl_cpu/prelude/metal_tensor, .../MetalPerformancePrimitives.h) against NumPy: every
  transpose combination, multiply and multiply_accumulate, strided views, half operands,
  slices over edge tiles, a K loop staged through threadgroup memory; and its errors for
  misuse (shape mismatch, slices past the tensor, a scope that does not match the threadgroup,
  a missing barrier before run()).
- The prefill GEMM kernels' tensor-op variants (gemm_tensor_*, moe_gemm_*_tensor_*) against
  NumPy at the real Qwen3.6-35B-A3B dims and odd sizes (via the same checks as the
  simdgroup_matrix kernels in test_metal_prefill_moe.py).
- A whole prefill of a tiny 4-bit checkpoint on a device that claims Metal 4: the tensor-op
  kernels are the ones encoded, logits within tolerance of the CPU backend, same greedy tokens;
  the host's choice at load time (auto: only on a GPU family that accelerates tensor ops, Apple10
  / M5, and only after the tensor libraries compiled; simdgroup; tensor).

What none of this can tell: whether Apple's compiler accepts these kernels, and their speed.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import lily
from fixtures import cases
from msl_cpu_harness import kernel_args as A
from msl_cpu_harness import kernels, library, msl_cpu, read, run
from test_metal_kernels import MICROSCALED, qm
from test_metal_prefill_moe import (
    _close,
    _logits_for,
    _routing,
    check_gemm_affine,
    moe_block,
)

RNG = np.random.default_rng(46)


@pytest.fixture(scope="module")
def dev4():
    return msl_cpu.device(metal4=True)


@pytest.fixture(scope="module")
def ops(dev4):
    return library(dev4, "tensor_ops.metal", language="4.0")


def _args(M, N, K, lda, ldb, ldc):
    return struct.pack("6i", M, N, K, lda, ldb, ldc)


# ---- the emulated matmul2d ----------------------------------------------------------------------

@pytest.mark.parametrize("name,ta,tb,acc", [
    ("mm_n_n_set", False, False, False),
    ("mm_n_t_set", False, True, False),
    ("mm_t_n_set", True, False, False),
    ("mm_t_t_acc", True, True, True),
    ("mm_n_t_acc", False, True, True),
])
def test_matmul2d_against_numpy(dev4, ops, name, ta, tb, acc):
    """C (=|+=) A.B for one 32 x 16 tile, K = 13 (dynamic), every operand a strided view."""
    M, N, K = 32, 16, 13
    A = RNG.standard_normal((M, K), dtype=np.float32)
    B = RNG.standard_normal((K, N), dtype=np.float32)
    a_st = A.T if ta else A  # as stored: [K, M] when transposed
    b_st = B.T if tb else B
    lda, ldb, ldc = a_st.shape[1] + 3, b_st.shape[1] + 2, N + 5
    a = np.zeros((a_st.shape[0], lda), np.float32)
    a[:, :a_st.shape[1]] = a_st
    b = np.zeros((b_st.shape[0], ldb), np.float32)
    b[:, :b_st.shape[1]] = b_st
    c0 = RNG.standard_normal((M, ldc), dtype=np.float32)
    c = dev4.buffer(c0)
    run(dev4, [(ops.pipeline(name), (1,), (128,),
                {0: dev4.buffer(a), 1: dev4.buffer(b), 2: c, 3: _args(M, N, K, lda, ldb, ldc)})])
    got = read(c, np.float32, (M, ldc))
    want = A.astype(np.float64) @ B.astype(np.float64) + (c0[:, :N] if acc else 0)
    np.testing.assert_allclose(got[:, :N], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, N:], c0[:, N:])  # past the view: untouched


def test_matmul2d_half_operands(dev4, ops):
    M, N, K = 32, 16, 40
    A = RNG.standard_normal((M, K)).astype(np.float16)
    B = RNG.standard_normal((K, N)).astype(np.float16)  # packed views: A [M, K], B [K, N]
    c = dev4.buffer_empty(4 * M * N)
    run(dev4, [(ops.pipeline("mm_half"), (1,), (128,),
                {0: dev4.buffer(A), 1: dev4.buffer(B), 2: c, 3: _args(M, N, K, K, N, N)})])
    want = A.astype(np.float64) @ B.astype(np.float64)
    np.testing.assert_allclose(read(c, np.float32, (M, N)), want, rtol=1e-5, atol=1e-4)


def test_matmul2d_slices_edge_tiles(dev4, ops):
    """C [45, 37] = A [45, 19] . W[37, 19]^T over 2 x 3 tiles of 32 x 16: the edge tiles are
    clipped to the tensors' extents (C past them is never written)."""
    M, N, K = 45, 37, 19
    A = RNG.standard_normal((M, K), dtype=np.float32)
    W = RNG.standard_normal((N, K), dtype=np.float32)
    c = dev4.buffer(np.full((M + 1, N), 9.0, np.float32))  # one spare row past the tensor
    run(dev4, [(ops.pipeline("mm_slice"), (3, 2), (128,),
                {0: dev4.buffer(A), 1: dev4.buffer(W), 2: c, 3: _args(M, N, K, K, K, N)})])
    got = read(c, np.float32, (M + 1, N))
    np.testing.assert_allclose(got[:M], A.astype(np.float64) @ W.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[M], 9.0)


def test_matmul2d_k_loop_in_threadgroup_memory(dev4, ops):
    """Static k = 8 over K = 48 staged through padded threadgroup tiles, multiply_accumulate
    into a threadgroup accumulator, under randomized thread interleavings."""
    M, N, K = 32, 16, 48
    A = RNG.standard_normal((M, K), dtype=np.float32)
    W = RNG.standard_normal((N, K), dtype=np.float32)
    dev = msl_cpu.device(metal4=True, interleavings=3)
    c = dev.buffer_empty(4 * M * N)
    run(dev, [(library(dev, "tensor_ops.metal", language="4.0").pipeline("mm_tg_klooped"), (1,), (128,),
               {0: dev.buffer(A), 1: dev.buffer(W), 2: c, 3: _args(M, N, K, K, K, N)})])
    np.testing.assert_allclose(read(c, np.float32, (M, N)), A.astype(np.float64) @ W.T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)


def _fails(dev, lib, name, threads, match, M=32, N=16, K=8):
    a, b, c = dev.buffer_empty(4 * 64 * 64), dev.buffer_empty(4 * 64 * 64), dev.buffer_empty(4 * 64 * 64)
    with pytest.raises(lily.LilyError, match=match):
        run(dev, [(lib.pipeline(name), (1,), (threads,), {0: a, 1: b, 2: c, 3: _args(M, N, K, K, N, N)})])


def test_matmul2d_misuse_is_reported(dev4, ops):
    _fails(dev4, ops, "bad_shape", 128, r"shape mismatch: A has K = 8, B has K = 9.*tensor_ops.metal:\d+")
    _fails(dev4, ops, "bad_slice", 32, r"tensor slice: origin 33 in dimension 1 is outside the extent 32")
    _fails(dev4, ops, "bad_static_slice", 32, r"static_slice: extent 32 in dimension 1 runs past the tensor \(24 remain")
    _fails(dev4, ops, "bad_scope", 64, r"execution_simdgroups<4> but the threadgroup has 2 simdgroups")


def test_matmul2d_missing_barrier_found_by_interleavings():
    dev = msl_cpu.device(metal4=True, interleavings=4, seed=3)
    A = RNG.standard_normal((32, 8), dtype=np.float32)
    W = RNG.standard_normal((16, 8), dtype=np.float32)
    with pytest.raises(lily.LilyError, match="mm_tg_missing_barrier"):
        run(dev, [(library(dev, "tensor_ops.metal", language="4.0").pipeline("mm_tg_missing_barrier"), (1,), (128,),
                   {0: dev.buffer(A), 1: dev.buffer(W), 2: dev.buffer_empty(4 * 32 * 16), 3: _args(32, 16, 8, 8, 8, 16)})])


def test_tensor_headers_need_msl4_on_a_metal4_device():
    """Tensors exist only in a library compiled as MSL 4.0 (which defines __HAVE_TENSOR__) on a
    device with Metal 4: MSL 3.1 anywhere, or MSL 4.0 on an M1-M4-like device, does not build;
    the tensor kernels are their own libraries, so the others build without them."""
    dev, dev4 = msl_cpu.device(), msl_cpu.device(metal4=True)
    assert not dev.supports_tensor_ops and dev4.supports_tensor_ops
    with pytest.raises(lily.LilyError, match="needs Metal 4 tensors"):
        library(dev4, "tensor_ops.metal")  # MSL 3.1
    with pytest.raises(lily.LilyError, match="MSL 4.0 needs a Metal 4 device"):
        library(dev, "tensor_ops.metal", language="4.0")
    with pytest.raises(lily.LilyError, match="MSL 4.0 needs a Metal 4 device"):
        kernels(dev, "quant_tensor.metal")
    with pytest.raises(lily.LilyError, match="'gemm_tensor_float_bm8' is not in metal/quant.metal"):
        kernels(dev4, "quant.metal").pipeline("gemm_tensor_float_bm8")


# ---- the prefill GEMM kernels' tensor-op variants -------------------------------------------------

@pytest.mark.parametrize("out,in_,bits,group,sdt,T,bm", [
    (512, 2048, 4, 64, "bfloat16", 9, 8),   # expert-sized rows at the real hidden size
    (70, 256, 8, 32, "bfloat16", 33, 32),   # two row tiles of 32, the second one short
    (37, 192, 4, 64, "float32", 5, 8),      # odd rows and columns
    (33, 128, 2, 128, "float16", 9, 8),
])
def test_gemm_tensor_affine(dev4, out, in_, bits, group, sdt, T, bm):
    dev = dev4 if out * in_ > 50000 else msl_cpu.device(metal4=True, interleavings=2)
    check_gemm_affine(dev, "gemm_tensor", out, in_, bits, group, sdt, T, bm)


@pytest.mark.parametrize("mode", list(MICROSCALED))
def test_gemm_tensor_microscaled(mode):
    check_gemm_affine(msl_cpu.device(metal4=True, interleavings=2), "gemm_tensor", 37, 192, *MICROSCALED[mode], mode, 5, 8)


def test_gemm_tensor_dense_odd_k():
    out, in_, T = 45, 100, 11  # K not a multiple of the K step: the tile's tail is zero-padded
    dev = msl_cpu.device(metal4=True, interleavings=2)
    w = RNG.standard_normal((out, in_)).astype(np.float16)
    x = RNG.standard_normal((T, in_), dtype=np.float32)
    y = dev.buffer_empty(4 * T * out)
    dummy = dev.buffer_empty(16)
    run(dev, [(kernels(dev, "quant_tensor.metal").pipeline("gemm_tensor_half_bm8"), (-(-out // A.GEMM_BN), 2),
               (A.GEMM_THREADS,),
               {"w": dev.buffer(w), "scales": dummy, "biases": dummy, "x": dev.buffer(x), "y": y,
                "args": A.GemmArgs(w=qm(in_, out, 0, 0), rows=T, ldx=in_, ldy=out)})])
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(read(y, np.float32, (T, out)), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_moe_block_tensor_real_dims(dev4):
    """The whole routed block (router GEMM, routing, plan, shared expert, grouped gate_up and
    down, combine) with the tensor-op GEMMs at hidden 2048, 256 experts top-8, intermediate 512."""
    ids = moe_block(dev4, T=3, H=2048, E=256, k=8, I=512, Is=512, bits=4, group=64, sdt="bfloat16",
                    repeat=1, path="_tensor")
    np.testing.assert_array_equal(ids[0], ids[1])


@pytest.mark.parametrize("kind,T,E,k,bm", [
    ("one_expert", 40, 6, 1, 32),
    ("singletons", 6, 48, 4, 8),
    ("random", 5, 7, 3, 8),
])
def test_moe_block_tensor_adversarial(kind, T, E, k, bm):
    dev = msl_cpu.device(metal4=True, interleavings=2 if kind == "random" else 0)
    ids = _routing(kind, T, E, k)
    got = moe_block(dev, T=T, H=160, E=E, k=k, I=64, Is=96, bits=8, group=32, sdt="float16",
                    logits=_logits_for(ids, E), bm=bm, path="_tensor")
    np.testing.assert_array_equal(got, ids)


# ---- whole prefill, and the host's choice --------------------------------------------------------

def test_prefill_on_tensor_ops_matches_cpu(store, lily):
    """qwen3_5_moe 4-bit (bf16 scales): 40 tokens in one chunk (BM = 32 projection tiles, BM = 8
    routed blocks) then decode, on a device that claims Metal 4: only tensor-op GEMMs encoded,
    logits within TOL_MLX of the CPU backend with the same top-1, same greedy tokens."""
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    gpu = lily.Model.load(path, backend="msl-cpu", prefill_chunk=40,
                          backend_options=dict(metal4=True, apple_gpu_family=10, **cases.F32_KV))
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32", prefill_chunk=40)
    prompt = cases.LONG_PROMPT[:40]
    eng = gpu._engine
    eng.gpu_records(True)
    s, c = gpu.session(), cpu.session()
    got = s.prefill(prompt, all_logits=True)
    used = {r[0] for r in eng.gpu_records(False)}  # (kernel, stage, bytes...)
    gemms = {k for k in used if "gemm" in k}
    assert gemms and all("_tensor_" in k for k in gemms), gemms
    assert any(k.startswith("moe_gemm_gate_up_tensor_") for k in gemms) and any(k.startswith("gemm_tensor_") for k in gemms)
    _close(got, c.prefill(prompt, all_logits=True), "prefill on tensor ops vs cpu backend")
    for i, tok in enumerate(cases.LONG_PROMPT[40:42]):
        _close(s.decode(tok), c.decode(tok), f"decode step {i} after a tensor-op prefill")
    gen = cases.LONG_PROMPT[:16]  # 16 tokens: a GEMM chunk, then greedy decoding
    assert gpu.generate(gen, max_tokens=3).tokens == cpu.generate(gen, max_tokens=3).tokens


def test_gemm_path_chosen_at_load(store, lily):
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    prompt = cases.PROMPT[:10]

    def gemms(**opts):
        m = lily.Model.load(path, backend="msl-cpu", backend_options=opts)
        m._engine.gpu_records(True)
        m.session().prefill(prompt)
        return {r[0] for r in m._engine.gpu_records(False) if "gemm" in r[0]}

    def tensor(names):  # every GEMM on tensor ops, or none (each set must be non-empty: the
        assert names, "the 10-token prefill took no GEMMs"  # 10-token prefill has to take GEMMs)
        assert all("_tensor_" in k for k in names) or not any("_tensor_" in k for k in names), names
        return all("_tensor_" in k for k in names)

    m5 = dict(metal4=True, apple_gpu_family=10)  # Metal 4 on a GPU whose hardware runs tensor ops
    assert tensor(gemms(**m5))                                               # auto: M5
    assert not tensor(gemms(metal4=True, apple_gpu_family=9))                # auto: Metal 4 on M3/M4
    assert not tensor(gemms())                                               # auto: no Metal 4
    assert not tensor(gemms(**m5, gemm="simdgroup"))
    assert tensor(gemms(metal4=True, apple_gpu_family=9, gemm="tensor"))     # asked for: taken
    # auto after a failed probe compile of a tensor library: the simdgroup GEMMs, and the reason.
    assert not tensor(gemms(**m5, fail_library="quant_tensor"))
    m = lily.Model.load(path, backend="msl-cpu", backend_options=dict(**m5, fail_library="moe_tensor"))
    assert "moe_tensor.metal" in m._engine.gpu_gemm_path and "injected failure" in m._engine.gpu_gemm_path
    with pytest.raises(lily.LilyError, match="compiling metal/quant_tensor.metal failed"):
        lily.Model.load(path, backend="msl-cpu", backend_options=dict(**m5, fail_library="quant_tensor", gemm="tensor"))
    with pytest.raises(lily.ConfigError, match="gemm='tensor' needs Metal 4 tensor ops"):
        lily.Model.load(path, backend="msl-cpu", backend_options=dict(gemm="tensor"))
    with pytest.raises(lily.ConfigError, match="gemm must be 'auto', 'simdgroup' or 'tensor'"):
        lily.Model.load(path, backend="msl-cpu", backend_options=dict(gemm="mpp"))
