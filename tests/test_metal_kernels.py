"""The Metal backend's kernels (metal/*.metal) run on the MSL-on-CPU runtime, one family at a
time, against references nobody here wrote: mlx (quantize / dequantize), NumPy, PyTorch
(scaled_dot_product_attention with GQA) and transformers' own Qwen3-Next pieces (rotate_half,
the recurrent gated delta rule, the gated RMSNorm).

Shapes: the real Qwen3.6-35B-A3B dims where the fiber runtime affords them (hidden 2048, expert
intermediate 512, attention 16 x 256 over 2 KV heads with 64 rotary dims, DeltaNet 16 key /
32 value heads of 128, 256 experts top-8, vocab 248320), plus odd sizes that straddle the
simdgroup width. Odd-size cases also run under randomized thread interleavings
(msl_cpu.device(interleavings=2)), which fails on a missing threadgroup barrier.

Buffers are bound by the kernels' parameter names and argument structs filled by field name
(lily._core.kernel_args, the host's own structs), so a reordered binding cannot go unnoticed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from msl_cpu_harness import Table, dispatch, kernels, msl_cpu, read
from msl_cpu_harness import kernel_args as A

RNG = np.random.default_rng(0)


def qm(in_, out, bits, group):  # struct QuantMatrix
    return A.QuantMatrix(in_=in_, out=out, bits=bits, group=group)


def quantize(w: np.ndarray, bits: int, group: int, scale_dtype: str):
    """mlx's affine quantization; returns packed, scales, biases (NumPy) and mlx's dequantized
    f32 matrix, the reference weights."""
    wq, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits)
    if scale_dtype != "float32":
        s, b = s.astype(getattr(mx, scale_dtype)), b.astype(getattr(mx, scale_dtype))
    deq = np.array(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits))

    def raw(a):
        if a.dtype == mx.bfloat16:
            return np.array(a.view(mx.uint16))
        return np.array(a)

    return np.array(wq), raw(s), raw(b), deq


MSL_TYPE = {"float32": "float", "float16": "half", "bfloat16": "bfloat"}

#: MLX's microscaled modes: (bits, group size) each fixes; the kernels read them as S = uchar.
#: "nvfp4-global-scale": nvfp4 with a global scale (mx.quantize(..., global_scale=max|w|), as
#: mlx-lm's switch layers quantize each expert).
MICROSCALED = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16), "nvfp4-global-scale": (4, 16)}


def quantize_microscaled(w: np.ndarray, variant: str):
    """mlx's mxfp4 / mxfp8 / nvfp4 quantization (a MICROSCALED key); returns packed, uint8
    scales, the float32 [1] the kernels read in the biases slot (the group scales' multiplier:
    global_scale / (448 * 6) as mlx.core.dequantize computes it, else 1) (NumPy) and mlx's
    dequantized f32 matrix, the reference weights."""
    mode = variant.removesuffix("-global-scale")
    gs = mx.max(mx.abs(mx.array(w))).astype(mx.float32) if variant != mode else None
    wq, s = mx.quantize(mx.array(w), mode=mode, global_scale=gs)[:2]
    mult = np.array([1.0 if gs is None else np.float32(gs.item()) / np.float32(448 * 6)], np.float32)
    return np.array(wq), np.array(s), mult, np.array(mx.dequantize(wq, s, mode=mode, global_scale=gs, dtype=mx.float32))


def dense(w: np.ndarray, dtype: str):
    """Raw bytes of w in dtype and the f32 values they hold."""
    if dtype == "bfloat16":
        t = torch.from_numpy(w).to(torch.bfloat16)
        return t.view(torch.uint16).numpy(), t.float().numpy()
    a = w.astype(dtype)
    return a, a.astype(np.float32)


# ---- quant.metal: GEMV and embedding ------------------------------------------------------------

GEMV_AFFINE = [
    # (out, in, bits, group, scale dtype, T)
    (512, 2048, 4, 64, "bfloat16", 1),    # expert gate/up at the real shape, released scale dtype
    (2048, 512, 4, 64, "float32", 1),     # expert down
    (8192, 2048, 4, 64, "bfloat16", 1),   # attention q_proj (query | gate) of the 35B
    (256, 2048, 8, 64, "bfloat16", 1),    # router (8-bit in the release)
    (37, 192, 4, 64, "float32", 3),       # odd rows, T > 1 (the simple prefill path)
    (33, 320, 8, 32, "float16", 2),
    (31, 256, 2, 64, "float32", 1),
]


def qm_vec(in_, out, bits, group, vec):
    """A QuantMatrix read with 16-byte loads (vec=1) or 32-bit words (vec=0); vec=1 only where the
    host would set it (buffers of these tests start 16-byte aligned)."""
    m = qm(in_, out, bits, group)
    assert not vec or A.vector_rows(m, [0]), "the host never sets vec for this shape"
    m.vec = vec
    return m


def run_gemv(dev, kernel, m, w, scales, biases, x):
    """y = x . W^T through gemv_<S> (x [T, in]); returns y [T, out]."""
    T, out = x.shape[0], m.out
    y = dev.buffer_empty(4 * T * out)
    dispatch(dev, kernels(dev, "quant.metal").pipeline(kernel), (-(-out // A.GEMV_ROWS), T), (A.GEMV_THREADS,),
             {"w": dev.buffer(w), "scales": dev.buffer(scales), "biases": dev.buffer(biases), "x": dev.buffer(x),
              "y": y, "args": A.GemvArgs(w=m, ldx=m.in_, ldy=out)})
    return read(y, np.float32, (T, out))


@pytest.mark.parametrize("vec", [1, 0], ids=["uint4", "word"])
@pytest.mark.parametrize("out,in_,bits,group,sdt,T", GEMV_AFFINE)
def test_gemv_affine(out, in_, bits, group, sdt, T, vec):
    dev = msl_cpu.device(interleavings=2 if out < 64 else 0)
    w = RNG.standard_normal((out, in_), dtype=np.float32)
    wq, s, b, deq = quantize(w, bits, group, sdt)
    x = RNG.standard_normal((T, in_), dtype=np.float32)
    m = qm_vec(in_, out, bits, group, vec)
    got = run_gemv(dev, f"gemv_{MSL_TYPE[sdt]}", m, wq, s, b, x)
    want = x.astype(np.float64) @ deq.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if T > 1:  # a row of a batch sums in the same order as the row alone: bit for bit
        for t in range(T):
            np.testing.assert_array_equal(run_gemv(dev, f"gemv_{MSL_TYPE[sdt]}", m, wq, s, b, x[t:t + 1])[0], got[t])


@pytest.mark.parametrize("vec", [1, 0], ids=["uint4", "word"])
@pytest.mark.parametrize("mode", list(MICROSCALED))
@pytest.mark.parametrize("out,in_,T", [(512, 2048, 1), (37, 192, 3)])
def test_gemv_microscaled(mode, out, in_, T, vec):
    dev = msl_cpu.device(interleavings=2 if out < 64 else 0)
    wq, s, mult, deq = quantize_microscaled(RNG.standard_normal((out, in_), dtype=np.float32), mode)
    x = RNG.standard_normal((T, in_), dtype=np.float32)
    got = run_gemv(dev, "gemv_uchar", qm_vec(in_, out, *MICROSCALED[mode], vec), wq, s, mult, x)
    want = x.astype(np.float64) @ deq.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_vector_rows_rule():
    """The host's rule for QuantMatrix.vec: packed rows of whole 16-byte runs, every start (one
    per expert) 16-byte aligned; dense matrices never."""
    assert A.vector_rows(qm(2048, 512, 4, 64), [0, 16 * 4096])
    assert not A.vector_rows(qm(2048, 512, 4, 64), [0, 4])       # a misaligned expert
    assert not A.vector_rows(qm(2048, 512, 4, 64), [8])
    assert not A.vector_rows(qm(96, 8, 2, 32), [0])              # a row of 24 bytes
    assert not A.vector_rows(qm(160, 8, 2, 32), [0])             # 40 bytes
    assert A.vector_rows(qm(64, 8, 2, 32), [0])                  # 16 bytes
    assert not A.vector_rows(qm(2048, 512, 0, 0), [0])


@pytest.mark.parametrize("in_,sdt", [(96, "float32"), (160, "bfloat16")])
def test_gemv_odd_stride_reads_words(in_, sdt):
    """Rows that are not whole 16-byte runs (2-bit, group 32: 24 and 40 bytes; every other width
    mlx quantizes has whole 16-byte rows): the host keeps them on the 32-bit word path, which
    matches the reference."""
    out, T = 37, 2
    dev = msl_cpu.device(interleavings=2)
    wq, s, b, deq = quantize(RNG.standard_normal((out, in_), dtype=np.float32), 2, 32, sdt)
    m = qm(in_, out, 2, 32)
    assert wq.nbytes // out % 16 != 0 and not A.vector_rows(m, [0])
    x = RNG.standard_normal((T, in_), dtype=np.float32)
    want = x.astype(np.float64) @ deq.T.astype(np.float64)
    got = run_gemv(dev, f"gemv_{MSL_TYPE[sdt]}", m, wq, s, b, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("mode", list(MICROSCALED))
def test_embed_gather_microscaled(mode):
    # the gather dequantizes each element exactly as mlx.core.dequantize: bit for bit
    vocab, hidden = 503, 192
    dev = msl_cpu.device()
    wq, s, mult, deq = quantize_microscaled(RNG.standard_normal((vocab, hidden), dtype=np.float32), mode)
    tokens = np.array([0, 502, 17, 17, 250], dtype=np.int32)
    x = dev.buffer_empty(4 * len(tokens) * hidden)
    dispatch(dev, kernels(dev, "quant.metal").pipeline("embed_uchar"), ((hidden + 255) // 256, len(tokens)), (256,),
             {"w": dev.buffer(wq), "scales": dev.buffer(s), "biases": dev.buffer(mult),
              "tokens": dev.buffer(tokens), "x": x,
              "args": A.EmbedArgs(w=qm(hidden, vocab, *MICROSCALED[mode]), vocab=vocab)})
    np.testing.assert_array_equal(read(x, np.float32, (len(tokens), hidden)), deq[tokens])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gemv_dense(dtype):
    out, in_, T = 45, 100, 2  # in not a multiple of 32
    dev = msl_cpu.device(interleavings=2)
    raw, w = dense(RNG.standard_normal((out, in_), dtype=np.float32), dtype)
    x = RNG.standard_normal((T, in_), dtype=np.float32)
    y = dev.buffer_empty(4 * T * out)
    lib = kernels(dev, "quant.metal")
    dummy = dev.buffer_empty(16)
    dispatch(dev, lib.pipeline(f"gemv_{MSL_TYPE[dtype]}"), (-(-out // A.GEMV_ROWS), T), (A.GEMV_THREADS,),
             {"w": dev.buffer(raw), "scales": dummy, "biases": dummy, "x": dev.buffer(x), "y": y,
              "args": A.GemvArgs(w=qm(in_, out, 0, 0), ldx=in_, ldy=out)})
    np.testing.assert_allclose(read(y, np.float32, (T, out)), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits,sdt", [(4, "bfloat16"), (8, "float32")])
def test_embed_gather(bits, sdt):
    vocab, hidden = 503, 192
    dev = msl_cpu.device()
    wq, s, b, deq = quantize(RNG.standard_normal((vocab, hidden), dtype=np.float32), bits, 64, sdt)
    tokens = np.array([0, 502, 17, 17, 250], dtype=np.int32)
    x = dev.buffer_empty(4 * len(tokens) * hidden)
    lib = kernels(dev, "quant.metal")
    dispatch(dev, lib.pipeline(f"embed_{MSL_TYPE[sdt]}"), ((hidden + 255) // 256, len(tokens)), (256,),
             {"w": dev.buffer(wq), "scales": dev.buffer(s), "biases": dev.buffer(b), "tokens": dev.buffer(tokens),
              "x": x, "args": A.EmbedArgs(w=qm(hidden, vocab, bits, 64), vocab=vocab)})
    np.testing.assert_allclose(read(x, np.float32, (len(tokens), hidden)), deq[tokens], rtol=1e-6, atol=1e-6)


# ---- norm.metal ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,T,add", [(2048, 2, True), (192, 3, False), (33, 1, True)])
def test_add_rms_norm(n, T, add):
    dev = msl_cpu.device(interleavings=2 if n < 100 else 0)
    x = RNG.standard_normal((T, n), dtype=np.float32)
    y = RNG.standard_normal((T, n), dtype=np.float32)
    w = RNG.standard_normal(n, dtype=np.float32)
    xb, hb = dev.buffer(x), dev.buffer_empty(4 * T * n)
    eps = 1e-6
    dispatch(dev, kernels(dev, "norm.metal").pipeline("add_rms_norm"), (T,), (256,),
             {"x": xb, "y": dev.buffer(y), "w": dev.buffer(w), "h": hb, "args": A.NormArgs(n=n, add=int(add), eps=eps)})
    xs = (x + y if add else x).astype(np.float64)
    want = xs / np.sqrt((xs * xs).mean(-1, keepdims=True) + eps) * w
    np.testing.assert_allclose(read(xb, np.float32, (T, n)), xs, rtol=1e-6)
    np.testing.assert_allclose(read(hb, np.float32, (T, n)), want, rtol=1e-5, atol=1e-5)


# ---- attention.metal --------------------------------------------------------------------------------

def _torch_attention(q, k_cache, v_cache, gate, pos0, scale):
    """q [T, Hq, D] (normed, rotated), caches [Hkv, P, D]: causal GQA attention by PyTorch's
    scaled_dot_product_attention, then the sigmoid gate."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    T, P = q.shape[0], pos0 + q.shape[0]
    qt = torch.from_numpy(q).double().transpose(0, 1)[None]            # [1, Hq, T, D]
    kt = torch.from_numpy(k_cache[:, :P]).double()[None]               # [1, Hkv, P, D]
    vt = torch.from_numpy(v_cache[:, :P]).double()[None]
    mask = torch.arange(P)[None, :] <= (pos0 + torch.arange(T))[:, None]
    o = sdpa(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return (o * torch.sigmoid(torch.from_numpy(gate).double())).numpy()


def _torch_norm_rope(x, w, eps, pos, inv_freq, rot):
    """x [..., D] -> RMSNorm(x) * w, then transformers' rotate_half RoPE on the first rot dims."""
    from transformers.models.qwen3_next.modeling_qwen3_next import rotate_half

    t = torch.from_numpy(x).double()
    t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * torch.from_numpy(w).double()
    freqs = torch.from_numpy(pos).double()[:, None] * torch.from_numpy(inv_freq).double()[None]
    emb = torch.cat([freqs, freqs], -1)                                 # [T, rot]
    shape = (len(pos),) + (1,) * (t.dim() - 2) + (rot,)
    cos, sin = emb.cos().reshape(shape), emb.sin().reshape(shape)
    r = t[..., :rot]
    return torch.cat([r * cos + rotate_half(r) * sin, t[..., rot:]], -1).numpy()


ATTN_CASES = [
    # (D, Hq, Hkv, rot, KV cache type, sequences of the dispatch: (pos0, T, n_splits, split_len) each)
    (256, 16, 2, 64, "float", [(40, 1, 1, 41)]),   # 35B decode, single pass
    (256, 16, 2, 64, "float", [(90, 1, 4, 24)]),   # 35B decode, split-K (last split partial) + combine
    (256, 16, 2, 64, "half", [(90, 1, 4, 24)]),    # the same with a half-precision cache
    (96, 6, 2, 24, "float", [(5, 3, 1, 8)]),       # odd: GQA 3, prefill of 3 tokens (causal)
    (64, 3, 3, 64, "half", [(70, 1, 5, 16)]),      # no GQA, whole head rotated, split-K
    # Several sequences in one dispatch, each with its own cache, position, rows and splits:
    # split and single-pass decode rows, a 2-token row run, a sequence past the others' splits.
    (96, 6, 2, 24, "float", [(30, 1, 3, 12), (5, 2, 1, 8), (61, 1, 1, 62), (17, 1, 2, 9)]),
    (256, 16, 2, 64, "half", [(90, 1, 4, 24), (12, 1, 1, 13), (47, 1, 2, 24)]),
]


@pytest.mark.parametrize("D,Hq,Hkv,rot,kv,seqs", ATTN_CASES)
def test_attention(D, Hq, Hkv, rot, kv, seqs):
    """attn_prepare, attn_decode and attn_combine, each one dispatch over a table of sequences
    (rows in table order, each against its own cache and position), against PyTorch per sequence."""
    dev = msl_cpu.device(interleavings=2 if D < 256 else 0)
    lib = kernels(dev, "attention.metal")
    eps, theta = 1e-6, 10_000_000.0
    R = sum(T for _, T, _, _ in seqs)
    firsts = np.cumsum([0] + [T for _, T, _, _ in seqs])[:-1]
    qg = RNG.standard_normal((R, Hq, 2 * D), dtype=np.float32)
    k = RNG.standard_normal((R, Hkv, D), dtype=np.float32)
    v = RNG.standard_normal((R, Hkv, D), dtype=np.float32)
    qn, kn = (1 + 0.3 * RNG.standard_normal(D)).astype(np.float32), (1 + 0.3 * RNG.standard_normal(D)).astype(np.float32)
    inv_freq = (1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float32) / rot)).astype(np.float32)
    kv_np = np.float32 if kv == "float" else np.float16
    caches, entries = [], []
    for i, ((pos0, T, n_splits, split_len), first) in enumerate(zip(seqs, firsts, strict=True)):
        cap = pos0 + T + 3 + i  # each sequence its own capacity
        kc = RNG.standard_normal((Hkv, cap, D), dtype=np.float32).astype(kv_np)  # earlier positions: any values
        vc = RNG.standard_normal((Hkv, cap, D), dtype=np.float32).astype(kv_np)
        kcb, vcb = dev.buffer(kc), dev.buffer(vc)
        caches.append((kc, kcb, vcb, cap))
        entries.append(A.AttnSeq(k=[kcb.gpu_address], v=[vcb.gpu_address], first=int(first), n=T, pos0=pos0, cap=cap,
                                 n_splits=n_splits, split_len=split_len, part=i))

    def table(written):
        return Table(entries, [(b, written) for _, kcb, vcb, _ in caches for b in (kcb, vcb)])

    qgb = dev.buffer(qg)
    dispatch(dev, lib.pipeline(f"attn_prepare_{kv}"), (Hq + Hkv, R), (128,),
             {"qg": qgb, "k": dev.buffer(k), "v": dev.buffer(v), "q_norm": dev.buffer(qn), "k_norm": dev.buffer(kn),
              "inv_freq": dev.buffer(inv_freq), "seqs": table(True),
              "args": A.AttnPrepareArgs(D=D, rot=rot, Hq=Hq, Hkv=Hkv, n_seqs=len(seqs), eps=eps)})

    pos = np.concatenate([np.arange(pos0, pos0 + T) for pos0, T, _, _ in seqs])
    q_want = _torch_norm_rope(qg[..., :D], qn, eps, pos, inv_freq, rot)
    k_want = _torch_norm_rope(k, kn, eps, pos, inv_freq, rot)
    got_qg = read(qgb, np.float32, (R, Hq, 2 * D))
    np.testing.assert_allclose(got_qg[..., :D], q_want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_qg[..., D:], qg[..., D:])  # the gate half is untouched
    k_tol = 1e-4 if kv == "float" else 1e-3  # f16 rounding of the stored key
    stored = []
    for (pos0, T, _, _), first, (kc, kcb, vcb, cap) in zip(seqs, firsts, caches, strict=True):
        rows = slice(first, first + T)
        kc_got, vc_got = read(kcb, kv_np, (Hkv, cap, D)), read(vcb, kv_np, (Hkv, cap, D))
        np.testing.assert_allclose(kc_got[:, pos0:pos0 + T], k_want[rows].transpose(1, 0, 2), rtol=k_tol, atol=k_tol)
        np.testing.assert_array_equal(vc_got[:, pos0:pos0 + T], v[rows].transpose(1, 0, 2).astype(kv_np))
        np.testing.assert_array_equal(kc_got[:, :pos0], kc[:, :pos0])  # nothing else written
        stored.append((kc_got, vc_got))

    scale, max_splits = 1.0 / np.sqrt(D), max(n for _, _, n, _ in seqs)
    o = dev.buffer_empty(4 * R * Hq * D)
    part_o = dev.buffer_empty(4 * len(seqs) * Hq * max_splits * D)
    part_ml = dev.buffer_empty(4 * len(seqs) * Hq * max_splits * 2)
    args = A.AttnArgs(D=D, Hq=Hq, Hkv=Hkv, n_seqs=len(seqs), max_splits=max_splits, scale=scale)
    dispatch(dev, lib.pipeline(f"attn_decode_{kv}_d{D}"), (Hkv, max_splits, R), (A.ATTN_THREADS,),
             {"qg": qgb, "seqs": table(False), "o": o, "part_o": part_o, "part_ml": part_ml, "args": args})
    if max_splits > 1:
        dispatch(dev, lib.pipeline("attn_combine"), (Hq, D // A.ATTN_COMBINE_COLUMNS, len(seqs)),
                 (A.ATTN_COMBINE_COLUMNS,),
                 {"qg": qgb, "seqs": Table(entries), "part_o": part_o, "part_ml": part_ml, "o": o, "args": args})
    got = read(o, np.float32, (R, Hq, D))
    for (pos0, T, _, _), first, (kc_got, vc_got) in zip(seqs, firsts, stored, strict=True):
        rows = slice(first, first + T)
        # Attention over the sequence's cache as stored (f16 values are exact in f64).
        want = _torch_attention(got_qg[rows, :, :D], kc_got.astype(np.float32), vc_got.astype(np.float32),
                                qg[rows, :, D:], pos0, scale)
        np.testing.assert_allclose(got[rows], want, rtol=1e-4, atol=1e-5)


# ---- gdn.metal ----------------------------------------------------------------------------------

def gdn_reference(Hk, Hv, Dk, Dv, taps, window, S0, a_neg, dt_bias, norm_w, eps, qkv, z, b, a):
    """transformers' recurrent gated delta rule and gated RMSNorm after PyTorch's depthwise conv1d
    over [window ; qkv] + SiLU: (o [T, Hv*Dv], S [Hv, Dk, Dv], new window [K-1, C], conv output
    [T, C] after SiLU)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextRMSNormGated,
        torch_recurrent_gated_delta_rule,
    )

    T, C = qkv.shape
    K = taps.shape[1]
    full = np.concatenate([window, qkv])
    conv = torch.nn.functional.conv1d(torch.from_numpy(full).double().T[None],
                                      torch.from_numpy(taps).double()[:, None], groups=C)[0].T
    conv = torch.nn.functional.silu(conv)
    kd = Hk * Dk
    # Each q/k head serves Hv // Hk consecutive value heads. transformers repeats them inside
    # the rule since 5.2x and in the model before it in 5.17 (the H200 image's): repeated here,
    # the call holds for both.
    q = conv[:, :kd].reshape(1, T, Hk, Dk).repeat_interleave(Hv // Hk, dim=2)
    k = conv[:, kd:2 * kd].reshape(1, T, Hk, Dk).repeat_interleave(Hv // Hk, dim=2)
    v = conv[:, 2 * kd:].reshape(1, T, Hv, Dv)
    beta = torch.sigmoid(torch.from_numpy(b).double())[None]
    g = torch.from_numpy(a_neg).double() * torch.nn.functional.softplus(
        torch.from_numpy(a).double() + torch.from_numpy(dt_bias).double())
    out, S = torch_recurrent_gated_delta_rule(q, k, v, g[None], beta, initial_state=torch.from_numpy(S0).double()[None],
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    norm = Qwen3NextRMSNormGated(Dv, eps=eps).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(norm_w))
        o = norm(out[0], torch.from_numpy(z).double().reshape(T, Hv, Dv)).reshape(T, Hv * Dv)
    return o.numpy(), S[0].numpy(), full[-(K - 1):], conv.numpy()


GDN_CASES = [
    # (Hk, Hv, Dk, Dv, K, rows of each sequence of the dispatch)
    (16, 32, 128, 128, 4, [1]),  # 35B decode
    (3, 6, 48, 96, 4, [4]),      # odd dims, a chunk longer than the conv window
    (2, 2, 32, 40, 4, [2]),      # T < K-1: the window keeps part of the old one; Dv not a multiple of 32
    (3, 6, 48, 96, 4, [1, 3, 1, 2]),  # several sequences in one dispatch, each its own window and state
]


@pytest.mark.parametrize("Hk,Hv,Dk,Dv,K,Ts", GDN_CASES)
def test_gated_deltanet_step(Hk, Hv, Dk, Dv, K, Ts):
    """gdn_conv and gdn_recurrence, each one dispatch over a table of sequences (their rows in
    order, each with its own conv window and state), then the gated norm over all rows, against
    PyTorch's conv1d and transformers' recurrence and norm per sequence."""
    dev = msl_cpu.device(interleavings=2 if Hv < 32 else 0)
    lib = kernels(dev, "gdn.metal")
    C, vdim, eps, R = 2 * Hk * Dk + Hv * Dv, Hv * Dv, 1e-6, sum(Ts)
    firsts = np.cumsum([0] + Ts)[:-1]
    qkv = RNG.standard_normal((R, C), dtype=np.float32)
    taps = (0.5 * RNG.standard_normal((C, K))).astype(np.float32)
    z = RNG.standard_normal((R, vdim), dtype=np.float32)
    b = RNG.standard_normal((R, Hv), dtype=np.float32)
    a = RNG.standard_normal((R, Hv), dtype=np.float32)
    A_log = RNG.uniform(-1, 1, Hv).astype(np.float32)
    a_neg = -np.exp(A_log).astype(np.float32)
    dt_bias = RNG.standard_normal(Hv, dtype=np.float32)
    norm_w = RNG.uniform(0.5, 1.5, Dv).astype(np.float32)
    args = A.GdnArgs(T=R, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, K=K, C=C, eps=eps, q_scale=1.0 / np.sqrt(Dk))

    # Per sequence: the conv window updated in place, S ping-ponged (a separate out buffer).
    windows = [RNG.standard_normal((K - 1, C), dtype=np.float32) for _ in Ts]
    S0s = [(0.1 * RNG.standard_normal((Hv, Dk, Dv))).astype(np.float32) for _ in Ts]
    winb = [dev.buffer(w) for w in windows]
    S_in = [dev.buffer(S0) for S0 in S0s]
    S_out = [dev.buffer_empty(S0.nbytes) for S0 in S0s]
    entries = [A.GdnSeq(window=w.gpu_address, window_out=w.gpu_address, S=si.gpu_address, S_out=so.gpu_address,
                        first=int(f), n=T) for w, si, so, f, T in zip(winb, S_in, S_out, firsts, Ts, strict=True)]
    conv_out = dev.buffer_empty(4 * R * C)
    dispatch(dev, lib.pipeline("gdn_conv"), ((C + 255) // 256, len(Ts)), (256,),
             {"qkv": dev.buffer(qkv), "taps": dev.buffer(taps), "out": conv_out, "args": args,
              "seqs": Table(entries, [(w, True) for w in winb])})
    o = dev.buffer_empty(4 * R * vdim)
    # One threadgroup per (value head, slice of value columns, sequence), then the gated norm per head.
    slices = -(-Dv // A.GDN_COLUMNS)
    dispatch(dev, lib.pipeline(f"gdn_recurrence_dk{Dk}"), (Hv, slices, len(Ts)), (A.GDN_COLUMNS,),
             {"conv_out": conv_out, "b": dev.buffer(b), "a": dev.buffer(a), "a_neg": dev.buffer(a_neg),
              "dt_bias": dev.buffer(dt_bias), "o": o, "args": args,
              "seqs": Table(entries, [(si, False) for si in S_in] + [(so, True) for so in S_out])})
    dispatch(dev, lib.pipeline("gdn_gated_norm"), (Hv, R), (32 * ((Dv + 31) // 32),),
             {"z": dev.buffer(z), "norm_w": dev.buffer(norm_w), "o": o, "args": args})

    # Reference per sequence: PyTorch's depthwise conv1d over [window ; rows], transformers'
    # recurrence and norm.
    got_conv, got_o = read(conv_out, np.float32, (R, C)), read(o, np.float32, (R, vdim))
    for i, (first, T) in enumerate(zip(firsts, Ts, strict=True)):
        rows = slice(first, first + T)
        want_o, want_S, want_window, want_conv = gdn_reference(Hk, Hv, Dk, Dv, taps, windows[i], S0s[i], a_neg,
                                                               dt_bias, norm_w, eps, qkv[rows], z[rows], b[rows],
                                                               a[rows])
        np.testing.assert_array_equal(read(S_in[i], np.float32, S0s[i].shape), S0s[i])  # the input state survives
        np.testing.assert_allclose(got_conv[rows], want_conv, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(read(winb[i], np.float32, (K - 1, C)), want_window)
        np.testing.assert_allclose(read(S_out[i], np.float32, (Hv, Dk, Dv)), want_S, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got_o[rows], want_o, rtol=1e-4, atol=1e-4)


def test_gdn_ungroup():
    """Qwen3-Next's grouped in_proj_qkvz / in_proj_ba, scattered as transformers'
    fix_query_key_value_ordering does (reimplemented by its reshape/split recipe with NumPy)."""
    Hk, Hv, Dk, Dv, T = 3, 6, 48, 96, 2
    r, C, vdim = Hv // Hk, 2 * Hk * Dk + Hv * Dv, Hv * Dv
    dev = msl_cpu.device(interleavings=2)
    qkvz = RNG.standard_normal((T, C + vdim), dtype=np.float32)
    ba = RNG.standard_normal((T, 2 * Hv), dtype=np.float32)
    outs = [dev.buffer_empty(4 * T * n) for n in (C, vdim, Hv, Hv)]
    dispatch(dev, kernels(dev, "gdn.metal").pipeline("gdn_ungroup"), ((C + vdim + 2 * Hv + 255) // 256, T), (256,),
             {"qkvz": dev.buffer(qkvz), "ba": dev.buffer(ba), "qkv": outs[0], "z": outs[1], "b": outs[2],
              "a": outs[3], "args": A.GdnArgs(T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, K=4, C=C, eps=1e-6, q_scale=1.0)})
    g = qkvz.reshape(T, Hk, 2 * Dk + 2 * r * Dv)
    q, k, v, z = np.split(g, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=-1)
    bag = ba.reshape(T, Hk, 2 * r)
    want = [np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1), z.reshape(T, -1),
            bag[..., :r].reshape(T, -1), bag[..., r:].reshape(T, -1)]
    for buf, w in zip(outs, want, strict=True):
        np.testing.assert_array_equal(read(buf, np.float32, w.shape), w)


# ---- moe.metal ----------------------------------------------------------------------------------

@pytest.mark.parametrize("E,k,T,ties", [(256, 8, 2, True), (7, 3, 1, False), (512, 10, 1, False)])
def test_moe_route(E, k, T, ties):
    dev = msl_cpu.device()
    logits = RNG.standard_normal((T, E), dtype=np.float32)
    if ties:  # equal logits inside the top-k and across its boundary: the lowest id wins
        top = np.argsort(-logits[0], kind="stable")
        logits[0, top[1:4]] = logits[0, top[1]]
        logits[0, top[k - 1:k + 2]] = logits[0, top[k - 1]]
    ids, wts = dev.buffer_empty(4 * T * k), dev.buffer_empty(4 * T * k)
    dispatch(dev, kernels(dev, "moe.metal").pipeline("moe_route"), (T,), (32 * ((E + 31) // 32),),
             {"logits": dev.buffer(logits), "ids": ids, "weights": wts, "args": A.MoeRouteArgs(E=E, k=k, renormalize=1)})
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # ties: lower id first
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, order, -1)
    np.testing.assert_array_equal(read(ids, np.uint32, (T, k)), order)
    np.testing.assert_allclose(read(wts, np.float32, (T, k)), w / w.sum(-1, keepdims=True), rtol=1e-5)


def _silu(x):
    return x / (1 + np.exp(-x))


MOE_EXPERTS = [
    # (E, k, H, I, Is, T, bits, lanes, pad): lanes None = the host's choice (moe_down_lanes); pad:
    # bytes between stacked experts' weights (4: every expert but the first misaligned for uint4)
    (12, 8, 2048, 512, 512, 1, 4, None, 0),  # the 35B's shape: 16 lanes per expert, two at once
    (5, 2, 192, 64, 128, 3, 8, None, 0),
    (5, 3, 192, 64, 128, 2, 4, 8, 0),
    (5, 3, 192, 64, 128, 2, 4, 4, 0),
    (5, 2, 192, 64, 128, 2, 4, 32, 4),
    (5, 2, 192, 96, 96, 2, 2, None, 0),  # 2-bit, group 32: 24-byte rows of down (word path)
]


@pytest.mark.parametrize("E,k,H,I,Is,T,bits,lanes,pad", MOE_EXPERTS)
def test_moe_experts(E, k, H, I, Is, T, bits, lanes, pad):
    """Gather-GEMV gate+up with SwiGLU, then down + weighted combine + sigmoid-gated shared
    expert, against NumPy on mlx-dequantized weights. Experts live in one stacked tensor per
    matrix (MLX switch_mlp), addressed through offset tables as the host builds them; 16-byte
    loads where the host's rule allows them (A.vector_rows), moe_down's jobs on teams of `lanes`
    lanes. A batch's rows equal the rows run alone, bit for bit."""
    dev = msl_cpu.device(interleavings=2 if H < 1000 else 0)
    lib = kernels(dev, "moe.metal")
    sdt, group = "bfloat16", 64 if I % 64 == Is % 64 == 0 else 32

    def stacked(n, rows, cols):
        parts = [quantize(RNG.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols), bits, group, sdt)
                 for _ in range(n)]
        w = b"".join(p[0].tobytes() + bytes(pad) for p in parts)
        s, b = (np.stack([p[i] for p in parts]) for i in (1, 2))
        step = parts[0][0].nbytes + pad
        table = np.array([[e * step, e * s[0].nbytes, e * b[0].nbytes] for e in range(n)], np.uint64)
        m = qm(cols, rows, bits, group)
        m.vec = int(A.vector_rows(m, [int(o) for o in table[:, 0]]))
        buffers = [dev.buffer(np.frombuffer(w, np.uint8).copy()), dev.buffer(s), dev.buffer(b), dev.buffer(table)]
        return buffers, [p[3] for p in parts], m

    def matrix(prefix, m):  # an expert matrix bound as its four parameters (weights, scales, biases, table)
        return dict(zip((f"{prefix}_w", f"{prefix}_s", f"{prefix}_b", f"{prefix}_table"), m, strict=True))

    gate, gate_f, gate_m = stacked(E, I, H)
    up, up_f, up_m = stacked(E, I, H)
    down, down_f, down_m = stacked(E, H, I)
    sgate, sgate_f, sgate_m = stacked(1, Is, H)
    sup, sup_f, sup_m = stacked(1, Is, H)
    sdown, sdown_f, sdown_m = stacked(1, H, Is)
    assert down_m.vec == (pad == 0 and I * bits % 128 == 0) and sdown_m.vec == (Is * bits % 128 == 0)
    if lanes is None:
        lanes = A.moe_down_lanes(down_m, sdown_m, k)
        if (k, I, bits) == (8, 512, 4):
            assert lanes == 16
    h = RNG.standard_normal((T, H), dtype=np.float32)
    ids = np.stack([RNG.choice(E, k, replace=False) for _ in range(T)]).astype(np.uint32)
    wts = RNG.uniform(0.05, 1, (T, k)).astype(np.float32)
    sg = RNG.standard_normal(T, dtype=np.float32)
    hb, act, act_s = dev.buffer(h), dev.buffer_empty(4 * T * k * I), dev.buffer_empty(4 * T * Is)
    zeros = dev.buffer(np.zeros(T, np.uint32))

    def gate_up(g, u, gm, um, idb, kk, inter, out):
        dispatch(dev, lib.pipeline("moe_gate_up_bfloat"), (-(-inter // A.GEMV_ROWS), kk, T), (A.GEMV_THREADS,),
                 {**matrix("gate", g), **matrix("up", u), "ids": idb, "h": hb, "act": out,
                  "args": A.MoeGateUpArgs(gate=gm, up=um, k=kk)})

    def run_down(rows):  # y [len(rows), H] of those token rows
        n, a, a_s = len(rows), read(act, np.float32, (T, k, I))[rows], read(act_s, np.float32, (T, Is))[rows]
        y = dev.buffer_empty(4 * n * H)
        dispatch(dev, lib.pipeline("moe_down_bfloat"), (-(-H // A.GEMV_ROWS), n), (A.GEMV_THREADS,),
                 {**matrix("down", down), "ids": dev.buffer(ids[rows]), "weights": dev.buffer(wts[rows]),
                  "act": dev.buffer(a), **matrix("shared", sdown), "shared_act": dev.buffer(a_s),
                  "shared_gate": dev.buffer(sg[rows]), "y": y,
                  "args": A.MoeDownArgs(down=down_m, shared_down=sdown_m, k=k, weighted=1, has_shared=1,
                                        lanes=lanes)})
        return read(y, np.float32, (n, H))

    gate_up(gate, up, gate_m, up_m, dev.buffer(ids), k, I, act)
    gate_up(sgate, sup, sgate_m, sup_m, zeros, 1, Is, act_s)
    y = run_down(list(range(T)))

    h64 = h.astype(np.float64)
    want_act = np.stack([np.stack([_silu(h64[t] @ gate_f[e].T) * (h64[t] @ up_f[e].T) for e in ids[t]])
                         for t in range(T)])
    np.testing.assert_allclose(read(act, np.float32, (T, k, I)), want_act, rtol=1e-4, atol=1e-5)
    want_s = _silu(h64 @ sgate_f[0].T) * (h64 @ sup_f[0].T)
    want = np.stack([sum(wts[t, j] * (want_act[t, j] @ down_f[e].T) for j, e in enumerate(ids[t]))
                     + (want_s[t] @ sdown_f[0].T) / (1 + np.exp(-sg[t])) for t in range(T)])
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for t in range(T if T > 1 else 0):
        np.testing.assert_array_equal(run_down([t])[0], y[t])


def test_moe_down_lanes():
    """The host's team width for moe_down: the busiest team's loads, fewest first, ties wide."""
    m = qm(512, 2048, 4, 64)
    m.vec = 1
    assert A.moe_down_lanes(m, m, 8) == 16   # 9 jobs of 16 uint4 loads: 2 teams x 5 jobs
    assert A.moe_down_lanes(m, None, 1) == 32  # one job of 16 loads: a step on 16 or 32, ties wide
    m.vec = 0
    assert A.moe_down_lanes(m, m, 8) == 32   # 64 words a row: 9 x 2 steps on 32 lanes
    assert A.moe_down_lanes(qm(64, 32, 4, 64), None, 8) == 8  # 8 words: 8 jobs on 4 teams of 8


# sampling.metal: tests/test_metal_sampling.py
