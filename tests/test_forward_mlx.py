"""lily on MLX-format checkpoints against mlx / mlx-lm, on identical bytes.

- Quantized (affine 4 and 8 bit, groups 64 and 32, fp32 and bf16 scales, the router and
  shared-expert gate 8-bit through config `quantization` overrides), converted by mlx_lm's own
  code from the tiny fp32 checkpoints: lily's logits vs mlx-lm's on the same files, 100% top-1
  agreement at every prompt position, rel_err <= TOL_MLX (1e-4; see fixtures/cases.py), also
  through prefill + decode and chunked prefill; greedy generation equals mlx_lm's.
- MLX-converted but unquantized fp32 (MLX names, conv1d [C,K,1], zero-centred norms stored as
  1+w): lily vs transformers on the HF source of the same weights, rel_err <= TOL_FP32.
- `lily._core.dequantize` vs `mlx.core.dequantize`, bit for bit, for every bit width and group
  size lily supports, on odd row counts, from quantized real data and from random bit patterns
  with random-sign scales.
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures import cases
from fixtures.references import rel_err

TOL = cases.TOL_MLX


def _check(got, want, what, tol=TOL):
    got = np.asarray(got)
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}, expected float32"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.0e}"
    top_got, top_want = got.reshape(-1, got.shape[-1]).argmax(-1), want.reshape(
        -1, want.shape[-1]).argmax(-1)
    bad = np.nonzero(top_got != top_want)[0]
    assert bad.size == 0, f"{what}: top-1 differs at rows {bad.tolist()}"


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints vs mlx-lm
# ---------------------------------------------------------------------------------------------

@pytest.fixture(params=[pytest.param(c, id=cases.case_id(c)) for c in cases.MLX_QUANT_CASES])
def qcase(request, store):
    path = store.mlx(*request.param)
    return path, store.mlx_reference(path)


def test_quantized_prefill_logits(qcase, lily):
    path, ref = qcase
    _check(lily.Model.load(path, cpu_matmul="f32").logits(cases.PROMPT), ref.prompt, "logits(prompt)")


def test_quantized_prefill_then_decode(qcase, lily):
    path, ref = qcase
    s = lily.Model.load(path, cpu_matmul="f32").session()
    n = cases.DECODE_SPLIT
    _check(s.prefill(cases.PROMPT[:n], all_logits=True), ref.prompt[:n], "prefill(all_logits)")
    for i in range(n, len(cases.PROMPT)):
        _check(s.decode(cases.PROMPT[i]), ref.prompt[i], f"decode at position {i}")


def test_quantized_long_prompt_chunked(qcase, lily):
    path, ref = qcase
    model = lily.Model.load(path, prefill_chunk=cases.PREFILL_CHUNK, cpu_matmul="f32")
    _check(model.logits(cases.LONG_PROMPT), ref.long, "chunked logits(long prompt)")
    s = model.session()
    k = len(cases.LONG_PROMPT) - cases.LONG_DECODE
    _check(s.prefill(cases.LONG_PROMPT[:k]), ref.long[k - 1], "chunked prefill")
    for i in range(k, len(cases.LONG_PROMPT)):
        _check(s.decode(cases.LONG_PROMPT[i]), ref.long[i], f"decode at position {i}")


def test_quantized_generate_greedy(qcase, lily):
    path, ref = qcase
    cases.assert_greedy_matches(lily.Model.load(path, cpu_matmul="f32"), ref.gen_tokens)


# ---------------------------------------------------------------------------------------------
# MLX-converted, unquantized (fp32) vs transformers on the same weights
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", cases.MLX_FP32_CASES)
def test_mlx_layout_fp32_matches_transformers(model_type, store, lily):
    path = store.mlx(model_type, None)
    ref = store.hf_reference(path.with_name(path.name + ".hf"))
    model = lily.Model.load(path, cpu_matmul="f32")
    _check(model.logits(cases.PROMPT), ref.prompt, "logits(prompt)", cases.TOL_FP32)
    s = model.session()
    n = cases.DECODE_SPLIT
    s.prefill(cases.PROMPT[:n])
    for i in range(n, len(cases.PROMPT)):
        _check(s.decode(cases.PROMPT[i]), ref.prompt[i], f"decode at {i}", cases.TOL_FP32)


# ---------------------------------------------------------------------------------------------
# Dequantization, bit for bit
# ---------------------------------------------------------------------------------------------

BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(
        a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_dequantize_matches_mlx(bits, group_size, rows, lily):
    import mlx.core as mx

    rng = np.random.default_rng(1000 * bits + group_size + rows)
    cols = group_size * 3
    w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32) * 0.7)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    want = np.array(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits))
    got = lily._core.dequantize(np.array(packed), np.array(scales), np.array(biases),
                                bits, group_size)
    assert np.asarray(got).shape == (rows, cols)
    assert _bits_equal(got, want), f"max diff {np.max(np.abs(np.asarray(got) - want)):.3e}"


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_random_bits_matches_mlx(bits, group_size, lily):
    """Every bit pattern (not only what mx.quantize produces), scales of both signs."""
    import mlx.core as mx

    rng = np.random.default_rng(7 * bits + group_size)
    rows, cols = 5, group_size * 2
    packed = rng.integers(0, 2**32, size=(rows, cols * bits // 32), dtype=np.uint32)
    scales = (rng.standard_normal((rows, cols // group_size)) * 0.1).astype(np.float32)
    biases = rng.standard_normal((rows, cols // group_size)).astype(np.float32)
    want = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases),
                                  group_size=group_size, bits=bits))
    got = lily._core.dequantize(packed, scales, biases, bits, group_size)
    assert _bits_equal(got, want)


def test_dequantize_rejects_bad_arguments(lily):
    packed = np.zeros((3, 8), dtype=np.uint32)       # 3 rows x 64 4-bit values
    scales = np.ones((3, 1), dtype=np.float32)
    biases = np.zeros((3, 1), dtype=np.float32)
    for bad in [dict(bits=7), dict(group_size=48), dict(scales=np.ones((3, 2), np.float32)),
                dict(biases=np.zeros((2, 1), np.float32))]:
        args = dict(packed=packed, scales=scales, biases=biases, bits=4, group_size=64)
        args.update(bad)
        with pytest.raises(ValueError):
            lily._core.dequantize(args["packed"], args["scales"], args["biases"],
                                  args["bits"], args["group_size"])
