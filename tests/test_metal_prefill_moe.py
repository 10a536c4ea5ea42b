"""Prefill kernels of the Metal backend's MoE and quant families, run on the MSL-on-CPU runtime
against NumPy (references computed in float64 on mlx-dequantized weights):

- gemm_<S>_bm<BM>: the tiled GEMM with fused dequantization (dense projections of a chunk).
- moe_plan: routing turned into grouped-GEMM work on the GPU (histogram, prefix scans, stable
  scatter, block map), against NumPy's stable argsort, under adversarial routing.
- The whole routed block as the host encodes it, in ONE command buffer: router GEMM, moe_route,
  moe_plan, shared expert (gate_up + down, routed = 0), grouped gate_up (SwiGLU) and down
  (weighted, scattered to slots), moe_combine; at the real Qwen3.6-35B-A3B dims (hidden 2048,
  256 experts top-8, expert and shared intermediate 512) and odd sizes, with all tokens on one
  expert, many experts with one token, and experts with none.

Odd sizes also run under randomized thread interleavings (a missing threadgroup barrier shows
as a result that depends on the thread order). The fiber runtime runs every lane of every
simdgroup matrix product on the CPU, so the real-dims cases keep T at 2.
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures import cases
from fixtures.references import rel_err
from msl_cpu_harness import kernel_args as A
from msl_cpu_harness import kernels, msl_cpu, read, run
from test_metal_kernels import MICROSCALED, MSL_TYPE, dense, qm, quantize, quantize_microscaled

RNG = np.random.default_rng(6)


def _silu(x):
    return x / (1 + np.exp(-x))


# ---- gemm (quant.metal) ------------------------------------------------------------------------

GEMM_AFFINE = [
    # (out, in, bits, group, scale dtype, T, BM)
    (512, 2048, 4, 64, "bfloat16", 9, 8),    # expert-sized rows at the real hidden size
    (256, 2048, 8, 64, "bfloat16", 3, 8),    # the router (8-bit in the release)
    (70, 256, 8, 32, "bfloat16", 33, 32),    # two row tiles of 32, the second one short
    (37, 192, 4, 64, "float32", 5, 8),       # odd rows and columns
    (33, 128, 2, 64, "float16", 9, 8),
    (40, 384, 4, 128, "float16", 2, 8),      # group 128: three K steps per group
]


@pytest.mark.parametrize("out,in_,bits,group,sdt,T,bm", GEMM_AFFINE)
def test_gemm_affine(out, in_, bits, group, sdt, T, bm):
    dev = msl_cpu.device(interleavings=2 if out * in_ < 50000 else 0)
    check_gemm_affine(dev, "gemm", out, in_, bits, group, sdt, T, bm)


@pytest.mark.parametrize("mode", list(MICROSCALED))
@pytest.mark.parametrize("out,in_,T,bm", [(70, 256, 33, 32), (37, 192, 5, 8)])
def test_gemm_microscaled(mode, out, in_, T, bm):
    check_gemm_affine(msl_cpu.device(interleavings=2), "gemm", out, in_, *MICROSCALED[mode], mode, T, bm)


def check_gemm_affine(dev, family, out, in_, bits, group, sdt, T, bm):
    """Kernel `<family>_<scale type>_bm<bm>` (of quant.metal; family gemm_tensor: of
    quant_tensor.metal) on random affine weights against NumPy in float64; sdt an MLX
    microscaled mode: the `_uchar` kernel on that mode's weights."""
    w = RNG.standard_normal((out, in_), dtype=np.float32)
    if sdt in MICROSCALED:
        wq, s, b, deq = quantize_microscaled(w, sdt)  # b: the scale multiplier, in the biases slot
    else:
        wq, s, b, deq = quantize(w, bits, group, sdt)
    ldx = in_ + 3  # rows of x strided, as the host passes views of wider activations
    x = RNG.standard_normal((T, ldx), dtype=np.float32)
    y = dev.buffer(np.full((T, out + 1), 7.0, np.float32))  # ldy = out + 1: the pad stays 7
    lib = kernels(dev, "quant_tensor.metal" if "tensor" in family else "quant.metal")
    run(dev, [(lib.pipeline(f"{family}_{MSL_TYPE.get(sdt, 'uchar')}_bm{bm}"),
               (-(-out // A.GEMM_BN), (T + bm - 1) // bm), (A.GEMM_THREADS,),
               {"w": dev.buffer(wq), "scales": dev.buffer(s), "biases": dev.buffer(b), "x": dev.buffer(x), "y": y,
                "args": A.GemmArgs(w=qm(in_, out, bits, group), rows=T, ldx=ldx, ldy=out + 1)})])
    got = read(y, np.float32, (T, out + 1))
    want = x[:, :in_].astype(np.float64) @ deq.T.astype(np.float64)
    np.testing.assert_allclose(got[:, :out], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got[:, out], 7.0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gemm_dense(dtype):
    out, in_, T = 45, 100, 11  # in not a multiple of the K step
    dev = msl_cpu.device(interleavings=2)
    raw, w = dense(RNG.standard_normal((out, in_), dtype=np.float32), dtype)
    x = RNG.standard_normal((T, in_), dtype=np.float32)
    y = dev.buffer_empty(4 * T * out)
    dummy = dev.buffer_empty(16)
    run(dev, [(kernels(dev, "quant.metal").pipeline(f"gemm_{MSL_TYPE[dtype]}_bm8"), (-(-out // A.GEMM_BN), 2),
               (A.GEMM_THREADS,),
               {"w": dev.buffer(raw), "scales": dummy, "biases": dummy, "x": dev.buffer(x), "y": y,
                "args": A.GemmArgs(w=qm(in_, out, 0, 0), rows=T, ldx=in_, ldy=out)})])
    np.testing.assert_allclose(read(y, np.float32, (T, out)), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)


# ---- moe_plan -----------------------------------------------------------------------------------

def _routing(kind, T, E, k):
    """ids [T, k], distinct experts per token, for the adversarial cases."""
    if kind == "one_expert":      # every token's first choice is expert E-2 (k = 1: all rows)
        others = np.stack([RNG.permutation(np.arange(E - 2))[: k - 1] for _ in range(T)]) if k > 1 else None
        first = np.full((T, 1), E - 2)
        return (first if others is None else np.concatenate([first, others], 1)).astype(np.uint32)
    if kind == "singletons":      # T*k distinct experts: each has exactly one row
        return RNG.permutation(E)[: T * k].reshape(T, k).astype(np.uint32)
    # random: a few hot experts, most experts with none
    hot = RNG.choice(E, size=max(k + 1, 3), replace=False)
    return np.stack([RNG.choice(hot, k, replace=False) for _ in range(T)]).astype(np.uint32)


def _plan_reference(ids, E, bm):
    flat = ids.reshape(-1)
    rows = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    blocks, start = [], 0
    for e in range(E):
        for b in range(0, counts[e], bm):
            blocks.append((e, start + b, min(bm, counts[e] - b)))
        start += counts[e]
    return rows, blocks


def _max_blocks(n, E, bm):
    return min(E, n) + n // bm


@pytest.mark.parametrize("kind,T,E,k,bm", [
    ("one_expert", 40, 16, 1, 32),   # all 40 rows on one expert: two blocks, the second short
    ("one_expert", 9, 256, 8, 8),
    ("singletons", 8, 256, 8, 8),    # 64 experts with one row each, 192 with none
    ("random", 7, 512, 10, 32),      # Qwen3-Next's 512 experts top-10
    ("random", 520, 256, 8, 32),     # 4160 rows: ids staged in two tiles of 4096
])
def test_moe_plan(kind, T, E, k, bm):
    dev = msl_cpu.device(interleavings=2 if T * k < 100 else 0)
    ids = _routing(kind, T, E, k)
    n = T * k
    mb = _max_blocks(n, E, bm)
    rows, blocks, header = dev.buffer_empty(4 * n), dev.buffer_empty(16 * mb), dev.buffer_empty(16)
    run(dev, [(kernels(dev, "moe.metal").pipeline("moe_plan"), (1,), (A.MOE_PLAN_THREADS,),
               {"ids": dev.buffer(ids), "rows": rows, "blocks": blocks, "header": header,
                "args": A.MoePlanArgs(n=n, E=E, block_rows=bm)})])
    want_rows, want_blocks = _plan_reference(ids, E, bm)
    hdr = read(header, np.uint32)
    assert hdr[0] == len(want_blocks) <= mb and hdr[1] == n
    np.testing.assert_array_equal(read(rows, np.uint32), want_rows)
    np.testing.assert_array_equal(read(blocks, np.uint32, (mb, 4))[: hdr[0], :3], np.array(want_blocks))


# ---- the routed block, as encoded for one chunk -------------------------------------------------

class Experts:
    """E experts of one matrix kind stacked in one tensor (MLX switch_mlp), addressed through
    the [E, 3] offset table the host builds. Only the experts in `live` get their own weights;
    every other expert shares one of two decoy matrices (offset tables may alias), which keeps
    the 35B-sized cases small while a wrong expert index still reads different weights.
    f32[e]: mlx's dequantized weights of expert e (the reference)."""

    def __init__(self, dev, E, rows, cols, bits, group, sdt, live=None):
        live = list(range(E)) if live is None else sorted(live)
        phys = {e: i for i, e in enumerate(live)}
        n = len(live) + (2 if len(live) < E else 0)
        parts = [quantize(RNG.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols), bits, group, sdt)
                 for _ in range(n)]
        w, s, b = (np.stack([p[i] for p in parts]) for i in range(3))
        self.phys = np.array([phys.get(e, len(live) + e % 2) for e in range(E)])
        table = np.array([[p * w[0].nbytes, p * s[0].nbytes, p * b[0].nbytes] for p in self.phys], np.uint64)
        self.bufs = [dev.buffer(w), dev.buffer(s), dev.buffer(b), dev.buffer(table)]
        self.deq = np.stack([p[3] for p in parts]).astype(np.float64)
        self.qm = qm(cols, rows, bits, group)
        self.out = rows

    def bind(self, prefix):
        """Bound as a kernel's four parameters <prefix>_w, _s, _b, _table."""
        return dict(zip((f"{prefix}_w", f"{prefix}_s", f"{prefix}_b", f"{prefix}_table"), self.bufs, strict=True))

    def f32(self, e):
        return self.deq[self.phys[e]]


def moe_block(dev, *, T, H, E, k, I, Is, bits, group, sdt, logits=None, bm=8, repeat=0, path=""):
    """Encodes the chunk's MoE block and checks y, the routing and the activations.
    logits None: the router GEMM (8-bit, as released) computes them from h. repeat: that many
    tokens copy token 0, so its k experts get several rows each. path: "" (simdgroup_matrix
    GEMMs) or "_tensor" (Metal 4 matmul2d, the *_tensor.metal libraries; dev must have metal4=True)."""
    moe = kernels(dev, "moe.metal")
    moe_gemm, quant = kernels(dev, f"moe{path}.metal"), kernels(dev, f"quant{path}.metal")
    S = MSL_TYPE[sdt]
    h = RNG.standard_normal((T, H), dtype=np.float32)
    h[1:1 + repeat] = h[0]
    sg = RNG.standard_normal(T, dtype=np.float32)
    h64 = h.astype(np.float64)
    if logits is None:
        rq, rs, rb, rdeq = quantize(RNG.standard_normal((E, H), dtype=np.float32) / 8, 8, 64, sdt)
        lg = h64 @ rdeq.T.astype(np.float64)
    else:
        lg = logits.astype(np.float64)
    live = set(np.argsort(-lg, axis=-1, kind="stable")[:, :k].reshape(-1).tolist())
    gate, up, down = (Experts(dev, E, I, H, bits, group, sdt, live), Experts(dev, E, I, H, bits, group, sdt, live),
                      Experts(dev, E, H, I, bits, group, sdt, live))
    sgate, sup, sdown = (Experts(dev, 1, Is, H, bits, group, sdt), Experts(dev, 1, Is, H, bits, group, sdt),
                         Experts(dev, 1, H, Is, bits, group, sdt))
    n, mb = T * k, _max_blocks(T * k, E, bm)
    buf = dev.buffer_empty
    hb, sgb = dev.buffer(h), dev.buffer(sg)
    router_b = buf(4 * T * E) if logits is None else dev.buffer(logits)
    ids, wts, rows, blocks, header = buf(4 * n), buf(4 * n), buf(4 * n), buf(16 * mb), buf(16)
    act, act_s, yr, ys, y = buf(4 * n * I), buf(4 * T * Is), buf(4 * n * H), buf(4 * T * H), buf(4 * T * H)
    dummy = buf(16)
    steps = []
    if logits is None:
        steps.append((quant.pipeline(f"gemm{path}_{S}_bm8"), (-(-E // A.GEMM_BN), (T + 7) // 8), (A.GEMM_THREADS,),
                      {"w": dev.buffer(rq), "scales": dev.buffer(rs), "biases": dev.buffer(rb), "x": hb,
                       "y": router_b, "args": A.GemmArgs(w=qm(H, E, 8, 64), rows=T, ldx=H, ldy=E)}))
    steps += [
        (moe.pipeline("moe_route"), (T,), (32 * ((E + 31) // 32),),
         {"logits": router_b, "ids": ids, "weights": wts, "args": A.MoeRouteArgs(E=E, k=k, renormalize=1)}),
        (moe.pipeline("moe_plan"), (1,), (A.MOE_PLAN_THREADS,),
         {"ids": ids, "rows": rows, "blocks": blocks, "header": header, "args": A.MoePlanArgs(n=n, E=E, block_rows=bm)}),
    ]

    def plan(routed):  # the block map, or (not routed) dummies the kernel does not read
        return {"blocks": blocks if routed else dummy, "header": header if routed else dummy,
                "rows": rows if routed else dummy}

    def gate_up(g, u, routed, rows_n, out, grid_y):
        return (moe_gemm.pipeline(f"moe_gemm_gate_up{path}_{S}_bm{bm}"), (-(-g.out // A.GEMM_BN), grid_y),
                (A.GEMM_THREADS,),
                {**g.bind("gate"), **u.bind("up"), **plan(routed), "h": hb, "act": out,
                 "args": A.MoeGemmArgs(a=g.qm, b=u.qm, k=k if routed else 1, routed=routed, n=rows_n)})

    def down_(d, routed, rows_n, a, out, grid_y):
        return (moe_gemm.pipeline(f"moe_gemm_down{path}_{S}_bm{bm}"), (-(-H // A.GEMM_BN), grid_y), (A.GEMM_THREADS,),
                {**d.bind("down"), **plan(routed), "weights": wts if routed else dummy, "act": a, "out": out,
                 "args": A.MoeGemmArgs(a=d.qm, b=d.qm, k=k if routed else 1, routed=routed, n=rows_n)})

    tiles_T = (T + bm - 1) // bm
    steps += [gate_up(sgate, sup, 0, T, act_s, tiles_T), down_(sdown, 0, T, act_s, ys, tiles_T),
              gate_up(gate, up, 1, n, act, mb), down_(down, 1, n, act, yr, mb),
              (moe.pipeline("moe_combine"), ((H + 255) // 256, T), (256,),
               {"yr": yr, "ys": ys, "sg": sgb, "y": y, "args": A.MoeCombineArgs(H=H, k=k, has_shared=1)})]
    run(dev, steps)

    # Reference: routing from the (reference) router logits, experts in float64.
    got_ids = read(ids, np.uint32, (T, k))
    if logits is not None:  # exact logits: the routing itself is checked
        np.testing.assert_array_equal(got_ids, np.argsort(-lg, axis=-1, kind="stable")[:, :k])
    else:  # GEMM logits within rounding of the reference: the chosen experts' logits must be top-k
        kth = -np.sort(-lg, axis=-1)[:, k - 1:k]
        assert (np.take_along_axis(lg, got_ids.astype(np.int64), -1) >= kth - 1e-4).all()
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.take_along_axis(p, got_ids.astype(np.int64), -1)
    w /= w.sum(-1, keepdims=True)
    want_act = np.stack([np.stack([_silu(h64[t] @ gate.f32(e).T) * (h64[t] @ up.f32(e).T) for e in got_ids[t]])
                         for t in range(T)])
    order = np.argsort(got_ids.reshape(-1), kind="stable")
    np.testing.assert_allclose(read(act, np.float32, (n, I)), want_act.reshape(n, I)[order], rtol=1e-4,
                               atol=1e-5 * np.abs(want_act).max())
    want_s = _silu(h64 @ sgate.f32(0).T) * (h64 @ sup.f32(0).T)
    want = np.stack([sum(w[t, j] * (want_act[t, j] @ down.f32(e).T) for j, e in enumerate(got_ids[t]))
                     + (want_s[t] @ sdown.f32(0).T) / (1 + np.exp(-sg[t])) for t in range(T)])
    np.testing.assert_allclose(read(y, np.float32, (T, H)), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    return got_ids


def test_moe_block_real_dims():
    """Qwen3.6-35B-A3B: hidden 2048, 256 experts top-8, expert and shared intermediate 512,
    4-bit group 64 with bf16 scales, 8-bit router; three tokens through the router GEMM, two of
    them equal: 8 experts with two rows, up to 8 with one, 240 or more with none."""
    ids = moe_block(msl_cpu.device(), T=3, H=2048, E=256, k=8, I=512, Is=512, bits=4, group=64, sdt="bfloat16",
                    repeat=1)
    np.testing.assert_array_equal(ids[0], ids[1])


def _logits_for(ids, E):
    """Router logits whose stable top-k is exactly ids (descending preference)."""
    T, k = ids.shape
    lg = RNG.standard_normal((T, E), dtype=np.float32) - 10
    for t in range(T):
        lg[t, ids[t]] = 10 - np.arange(k, dtype=np.float32)
    return lg


@pytest.mark.parametrize("kind,T,E,k,bm", [
    ("one_expert", 40, 6, 1, 32),   # every row on one expert: two BM = 32 blocks, 5 experts idle
    ("singletons", 6, 48, 4, 8),    # 24 experts with one row each, 24 with none
    ("random", 5, 7, 3, 8),         # hot experts with several rows, idle ones
])
def test_moe_block_adversarial(kind, T, E, k, bm):
    dev = msl_cpu.device(interleavings=2 if kind == "random" else 0)
    ids = _routing(kind, T, E, k)
    got = moe_block(dev, T=T, H=160, E=E, k=k, I=64, Is=96, bits=8, group=32, sdt="float16",
                    logits=_logits_for(ids, E), bm=bm)
    np.testing.assert_array_equal(got, ids)


# ---- whole prefill on tiny 4-bit checkpoints -----------------------------------------------------

def _close(got, want, what, tol=cases.TOL_MLX):
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.0e}"
    rows = got.reshape(-1, got.shape[-1]).argmax(-1) != want.reshape(-1, want.shape[-1]).argmax(-1)
    assert not rows.any(), f"{what}: top-1 differs at rows {np.nonzero(rows)[0].tolist()}"


PREFILL_CASES = [
    # (model, bits, group, scale dtype, prefill_chunk, gemm_min_rows, prompt parts)
    # 40 tokens in one chunk: BM = 32 tiles for projections and the shared expert, BM = 8 for
    # the routed experts (7 experts top-3: ~17 rows each); then 5 tokens on the skinny route.
    (("qwen3_5_moe", 4, 64, "bfloat16"), 40, 8, [cases.LONG_PROMPT[:40], cases.LONG_PROMPT[40:45]]),
    # grouped projections, a dense MLP layer and MoE layers; 20 tokens in chunks of 8, 8, 4.
    (("qwen3_next", 4, 64, None), 8, 2, [cases.PROMPT[:20]]),
]


@pytest.mark.parametrize("ckpt,chunk,min_rows,parts", PREFILL_CASES,
                         ids=lambda v: cases.case_id(v) if isinstance(v, tuple) else None)
def test_prefill_then_decode_matches_cpu(store, lily, ckpt, chunk, min_rows, parts):
    """Chunked prefill through the prefill kernels (and the skinny route for a short chunk),
    then decode: logits of every prompt position and of each decode step within TOL_MLX of
    the CPU backend (same top-1), and the same greedy continuation. Each chunk is one command
    buffer and one CPU wait (at its end): the routing never goes back to the CPU."""
    path = store.mlx(*ckpt)
    gpu = lily.Model.load(path, backend="msl-cpu", prefill_chunk=chunk,
                          backend_options=dict(gemm_min_rows=min_rows, **cases.F32_KV))
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32", prefill_chunk=chunk)
    eng = gpu._engine
    s, c = gpu.session(), cpu.session()
    got = []
    eng.gpu_records(True)
    for part in parts:
        _, _, cb0, w0, _ = eng.gpu_stats
        got.append(s.prefill(part, all_logits=True))
        _, _, cb1, w1, _ = eng.gpu_stats
        used = {r[0] for r in eng.gpu_records(True)}
        n_chunks = -(-len(part) // chunk)
        assert (cb1 - cb0, w1 - w0) == (n_chunks, n_chunks), "a prefill chunk is one command buffer and one CPU wait"
        if len(part) - (n_chunks - 1) * chunk >= min_rows:  # every chunk long enough: GEMMs only
            assert {"moe_plan", "moe_combine"} <= used
            assert any(k.startswith("moe_gemm_gate_up_") for k in used) and any(k.startswith("gemm_") for k in used)
            assert not any(k.startswith(("gemv_", "moe_gate_up_", "moe_down_")) for k in used), used
        else:  # the skinny route
            assert any(k.startswith("gemv_") for k in used) and not any("gemm" in k for k in used), used
    eng.gpu_records(False)
    prompt = [t for part in parts for t in part]
    _close(np.concatenate(got), c.prefill(prompt, all_logits=True), "prefill vs cpu backend")
    for i, tok in enumerate(cases.LONG_PROMPT[-cases.LONG_DECODE:]):
        _close(s.decode(tok), c.decode(tok), f"decode step {i} after prefill vs cpu backend")
    gen = cases.PROMPT[:12]
    assert gpu.generate(gen, max_tokens=4).tokens == cpu.generate(gen, max_tokens=4).tokens


def test_prefill_chunk_has_no_missing_dependency(store, lily):
    """A prefill chunk (routing, plan, grouped GEMMs, combine, projections as GEMMs) under the
    dependency-checking mode (every barrier-free group of dispatches also runs in reverse) and
    randomized thread interleavings: no undeclared data edge, no missing threadgroup barrier."""
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    gpu = lily.Model.load(path, backend="msl-cpu",
                          backend_options=dict(check_dependencies=True, interleavings=1, gemm_min_rows=4,
                                               **cases.F32_KV))
    prompt = cases.PROMPT[:9]
    got = gpu.session().prefill(prompt, all_logits=True)
    _close(got, lily.Model.load(path, backend="cpu", cpu_matmul="f32").session().prefill(prompt, all_logits=True),
           "checked prefill chunk vs cpu backend")


def test_prefill_chunk_plan_matches_execution(store, lily):
    """gpu_plan(tokens=T) (benchmarks/metal_prefill_plan.py) encodes exactly the dispatches and
    barriers an executed prefill chunk does, in one command buffer with one CPU wait."""
    from lily import _core

    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    gpu = lily.Model.load(path, backend="msl-cpu")
    d0, b0 = gpu._engine.gpu_stats[:2]
    gpu.session().prefill(cases.PROMPT[:9])
    d1, b1 = gpu._engine.gpu_stats[:2]
    rows, (dispatches, barriers, cbs, waits), scratch = _core.gpu_plan(gpu.config.to_native(), 9, 4, 64, 8, tokens=9)
    assert (dispatches, barriers) == (d1 - d0, b1 - b0)
    assert (cbs, waits) == (1, 1)
    assert "moe_plan" in {r[0] for r in rows} and scratch > 0
