"""The CPU backend's int8-activation mode (`Model.load(..., cpu_matmul="int8")`).

What int8 mode computes (csrc/cpu/linear_int8.cpp): each row of x is rounded per block of 32
values to int8, q = rint(x / d) with d = max|x| / 127, and multiplied by the integer weight
codes u (w = s * u + b per group) with integer dot products:
    y = sum_groups s * sum_blocks d * (q . u)  +  b * sum(x)      (sum(x) exact, f32)

Tests, each against a reference nobody here wrote:
- Kernel, exactly: `lily._core.quantized_matmul(mode="int8")` equals a NumPy float64 evaluation
  of that formula on weights made by `mlx.core.quantize` (relative error <= 1e-5: only the f32
  summation order differs; a wrong nibble order, block scale or group bias is >= 1e-2), for 4-bit
  (groups 64/128) and 8-bit (groups 32/64) weights, rows of 192 (a 64-value tail after 128-value
  steps), 256 and 2048 values, 1/3/8 tokens (the row kernels, 1-8 tokens per weight pass)
  and 13/32/33/70 tokens (the token-vector GEMM, from 12 tokens, with partial vectors of 8 or 16).
- Kernel, error bound: int8 vs the exact product with `mx.dequantize`d weights. Rounding x to
  q moves each x_j by at most d / 2, so |error| <= sum_j |w_j| d_j / 2, asserted elementwise.
  The errors are unbiased and independent, so typically the relative error is ~0.5-1% of
  max|y| (random N(0,1) x, 2048 values: 0.6%); we also assert rel_err <= 5%.
- Model: on the tiny fixtures (4-bit, as the mlx-community releases) int8 must not move lily
  measurably farther from the unquantized fp32 model (transformers) than the 4-bit weights
  themselves already are: rel_err(int8, fp32) <= 1.15 x rel_err(mlx-lm 4-bit, fp32). These
  random tiny models amplify any perturbation (4-bit weights alone move their logits by ~60%
  of max|logits|), so an absolute bound there says little; the relative one says that the
  activation rounding is small next to the weight quantization the user already chose.
- Hosts without int8 kernels for a format (`lily._core.cpu_int8_supported`, e.g. 8-bit on AVX2
  without VNNI) run f32 in int8 mode: asserted bit-equal there.
- Modes agree where they must: f32 mode stays within TOL_MLX of mlx-lm (covered by
  test_forward_mlx.py, which loads with cpu_matmul="f32"), and dense (unquantized) checkpoints
  give identical logits in both modes.
- int8 mode is the default where the CPU has the kernels, and its results do not depend on
  chunking, caching or threads: tests/test_invariance.py (whole model) and
  tests/test_cpu_kernel_builds.py (every kernel, bit for bit against NumPy).
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures import cases
from fixtures.references import int8_error_bound, int8_matmul_reference, rel_err


def _mlx_weights(rows, cols, bits, group_size, seed):
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    deq = np.array(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits), dtype=np.float64)
    return np.array(packed), np.array(scales), np.array(biases), deq


CASES = [(4, 64, 192), (4, 64, 2048), (4, 128, 256), (8, 32, 192), (8, 64, 2048),
         (4, 32, 192)]  # 4-bit g32: no int8 kernel on x86 (the f32 fallback; NEON has one)


@pytest.mark.parametrize("bits,group_size,cols", CASES)
@pytest.mark.parametrize("T", [1, 3, 8, 13, 32, 33, 70])
def test_int8_kernel_matches_numpy(bits, group_size, cols, T, lily):
    rows = 37
    packed, scales, biases, deq = _mlx_weights(rows, cols, bits, group_size, seed=bits * 1000 + cols + T)
    x = np.random.default_rng(T).standard_normal((T, cols)).astype(np.float32)
    x[0, :32] *= 40.0  # one block with a large max, one all-zero block
    x[-1, 32:64] = 0.0
    got = lily._core.quantized_matmul(x, packed, scales, biases, bits, group_size, mode="int8", threads=2)
    f32 = lily._core.quantized_matmul(x, packed, scales, biases, bits, group_size, mode="f32", threads=2)
    exact = x.astype(np.float64) @ deq.T
    assert rel_err(f32, exact) <= 1e-5
    assert got.shape == (T, rows) and got.dtype == np.float32
    if not lily._core.cpu_int8_supported(bits, group_size, cols):
        # e.g. 8-bit codes on AVX2 without VNNI (VPMADDUBSW would saturate): the f32 kernels.
        assert np.array_equal(got, f32)
        return
    want = int8_matmul_reference(x, deq, scales, biases, group_size)
    assert rel_err(got, want) <= 1e-5, f"rel err {rel_err(got, want):.2e}"
    assert np.all(np.abs(got - exact) <= int8_error_bound(x, deq)), "int8 error above the rounding bound"
    assert rel_err(got, exact) <= 5e-2, f"int8 vs exact: rel err {rel_err(got, exact):.2e}"


def test_quantized_matmul_rejects_bad_shapes(lily):
    packed, scales, biases, _ = _mlx_weights(4, 128, 4, 64, seed=0)
    with pytest.raises(lily.LilyError, match="quantized_matmul"):
        lily._core.quantized_matmul(np.zeros((2, 64), np.float32), packed, scales, biases, 4, 64)
    with pytest.raises(lily.LilyError, match="mode"):
        lily._core.quantized_matmul(np.zeros((2, 128), np.float32), packed, scales, biases, 4, 64, mode="int4")


@pytest.mark.parametrize("model_type,scale_dtype", [("qwen3_5_moe", "bfloat16"), ("qwen3_next", None),
                                                    ("qwen3_5", None)])
def test_int8_model_error_small_next_to_4bit_weights(model_type, scale_dtype, store, lily):
    path = store.mlx(model_type, 4, 64, scale_dtype)
    q4 = store.mlx_reference(path).prompt
    fp32 = store.hf_reference(store.hf(model_type)).prompt
    m = lily.Model.load(path, cpu_matmul="int8")
    assert m._engine.cpu_matmul == "int8"
    got = m.logits(cases.PROMPT)
    assert np.isfinite(got).all()
    weights_err, int8_err = rel_err(q4, fp32), rel_err(got, fp32)
    assert int8_err <= 1.15 * weights_err, f"int8 {int8_err:.3f} vs 4-bit weights alone {weights_err:.3f}"
    # Prefill + decode gives the very same logits (one order of operations per token; before
    # that, a 1e-7 difference between the decode and prefill paths could move an x across an
    # int8 rounding boundary, a step of 1/254 of its block's max).
    s = m.session()
    n = cases.DECODE_SPLIT
    part = s.prefill(cases.PROMPT[:n], all_logits=True)
    dec = np.stack([s.decode(t) for t in cases.PROMPT[n:]])
    assert np.array_equal(np.concatenate([part, dec]).view(np.uint32), got.view(np.uint32))


def test_int8_mode_leaves_dense_checkpoints_exact(store, lily):
    path = store.hf("qwen3_5_moe")
    a = lily.Model.load(path, cpu_matmul="f32").logits(cases.PROMPT)
    b = lily.Model.load(path, cpu_matmul="int8").logits(cases.PROMPT)
    assert np.array_equal(a, b)


def test_cpu_matmul_rejects_unknown_mode(lily):
    with pytest.raises(lily.ConfigError, match="cpu_matmul"):
        lily.Model.load(cpu_matmul="int4")
