"""The Metal backend's prefill path on the MSL-on-CPU runtime (backend "msl-cpu"):

- the prefill kernels (metal/attention_prefill.metal, metal/gdn_prefill.metal) one dispatch at a
  time against PyTorch's scaled_dot_product_attention (GQA, causal over cache + chunk) and
  transformers' own recurrent gated delta rule and gated RMSNorm, at the real Qwen3.6-35B-A3B
  dims (attention 16 x 256 over 2 KV heads; DeltaNet 16 key / 32 value heads of 128, conv 4)
  with few tokens, and at odd sizes (T = 1, T not a multiple of the query tile, T < K-1, a
  DeltaNet state and conv window carried from one chunk to the next);
- whole prefill of tiny 4-bit checkpoints of each model type through backend="msl-cpu" with
  small prefill chunks, so prompts are shorter than one chunk and span several, then decode:
  logits against the CPU backend, the same greedy tokens;
- Engine.generate_greedy from a prompt: the last chunk's argmax stays on the device (no CPU
  wait inside a chunk, one per generated token), under the dependency-checking mode too.

Odd-size kernel cases also run under randomized thread interleavings (a missing threadgroup
barrier fails). The fiber runtime is slow: small T keeps this file under a minute.
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures import cases
from msl_cpu_harness import Table, dispatch, kernels, msl_cpu, read
from msl_cpu_harness import kernel_args as A
from test_metal_decode import MODELS
from test_metal_kernels import _torch_attention, gdn_reference
from test_metal_prefill_moe import _close as _check

RNG = np.random.default_rng(6)


# ---- attention_prefill.metal ------------------------------------------------------------------

ATTN_CASES = [
    # (D, Hq, Hkv, pos0, T, KV cache type)
    (256, 16, 2, 0, 10, "float"),  # 35B, first chunk: tiles of 8 tokens, the second partial
    (256, 16, 2, 9, 5, "half"),    # 35B, a later chunk over cached positions, half cache
    (64, 6, 2, 3, 50, "float"),    # odd: GQA 3 (tiles of 21 tokens, 1 padding row), cache spans KV tiles
    (96, 4, 4, 5, 1, "float"),     # T = 1, no GQA (tile of 64 tokens, one used)
]


@pytest.mark.parametrize("D,Hq,Hkv,pos0,T,kv", ATTN_CASES)
def test_attention_prefill_kernel(D, Hq, Hkv, pos0, T, kv):
    dev = msl_cpu.device(interleavings=2 if D < 256 else 0)
    kv_np = np.float32 if kv == "float" else np.float16
    cap = pos0 + T + 5  # positions past the chunk hold garbage the kernel must not read
    qg = RNG.standard_normal((T, Hq, 2 * D), dtype=np.float32)
    kc = RNG.standard_normal((Hkv, cap, D), dtype=np.float32).astype(kv_np)
    vc = RNG.standard_normal((Hkv, cap, D), dtype=np.float32).astype(kv_np)
    kc[:, pos0 + T:] = np.nan
    vc[:, pos0 + T:] = np.nan
    tile = max(1, A.ATTN_PF_ROWS // (Hq // Hkv))
    scale = 1.0 / np.sqrt(D)
    o = dev.buffer_empty(4 * T * Hq * D)
    kcb, vcb = dev.buffer(kc), dev.buffer(vc)
    seq = A.AttnSeq(k=[kcb.gpu_address], v=[vcb.gpu_address], first=0, n=T, pos0=pos0, cap=cap)
    dispatch(dev, kernels(dev, "attention_prefill.metal").pipeline(f"attn_prefill_{kv}_d{D}"),
             (Hkv, -(-T // tile)), (A.ATTN_PF_THREADS,),
             {"qg": dev.buffer(qg), "seq": Table([seq], [(kcb, False), (vcb, False)]), "o": o,
              "args": A.AttnPrefillArgs(D=D, Hq=Hq, Hkv=Hkv, tile_tokens=tile, scale=scale)})
    want = _torch_attention(qg[..., :D], kc, vc, qg[..., D:], pos0, scale)
    np.testing.assert_allclose(read(o, np.float32, (T, Hq, D)), want, rtol=1e-4, atol=1e-5)


# ---- gdn_prefill.metal --------------------------------------------------------------------------

def _gdn_inputs(Hk, Hv, Dk, Dv, K, T):
    C, vdim = 2 * Hk * Dk + Hv * Dv, Hv * Dv
    return dict(
        qkv=RNG.standard_normal((T, C), dtype=np.float32),
        z=RNG.standard_normal((T, vdim), dtype=np.float32),
        b=RNG.standard_normal((T, Hv), dtype=np.float32),
        a=RNG.standard_normal((T, Hv), dtype=np.float32),
    )


GDN_CASES = [
    # (Hk, Hv, Dk, Dv, K, chunk lengths)
    (16, 32, 128, 128, 4, (2,)),     # 35B, one chunk
    (3, 6, 48, 40, 4, (2, 5, 1)),    # odd: T < K-1, T > K-1, T = 1, state carried across chunks
]


@pytest.mark.parametrize("Hk,Hv,Dk,Dv,K,chunks", GDN_CASES)
def test_gdn_prefill_kernels(Hk, Hv, Dk, Dv, K, chunks):
    dev = msl_cpu.device(interleavings=2 if Hv < 32 else 0)
    lib = kernels(dev, "gdn_prefill.metal")
    prepare, scan = lib.pipeline("gdn_prepare"), lib.pipeline(f"gdn_scan_dk{Dk}")
    C, vdim, eps = 2 * Hk * Dk + Hv * Dv, Hv * Dv, 1e-6
    taps = (0.5 * RNG.standard_normal((C, K))).astype(np.float32)
    a_neg = -np.exp(RNG.uniform(-1, 1, Hv)).astype(np.float32)
    dt_bias = RNG.standard_normal(Hv, dtype=np.float32)
    norm_w = RNG.uniform(0.5, 1.5, Dv).astype(np.float32)
    window = RNG.standard_normal((K - 1, C), dtype=np.float32)
    S0 = (0.1 * RNG.standard_normal((Hv, Dk, Dv))).astype(np.float32)
    # Two copies of window and state, ping-ponged chunk to chunk as GpuState does.
    wins = [dev.buffer(window), dev.buffer_empty(window.nbytes)]
    Ss = [dev.buffer(S0), dev.buffer_empty(S0.nbytes)]
    ref_win, ref_S = window, S0
    for i, T in enumerate(chunks):
        x = _gdn_inputs(Hk, Hv, Dk, Dv, K, T)
        args = A.GdnArgs(T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, K=K, C=C, eps=eps, q_scale=1.0 / np.sqrt(Dk))
        xb, gates, o = dev.buffer_empty(4 * T * C), dev.buffer_empty(8 * T * Hv), dev.buffer_empty(4 * T * vdim)
        src, dst = i % 2, (i + 1) % 2
        dispatch(dev, prepare, (2 * Hk + Hv, T), (A.GDN_PREP_THREADS,),
                 {"qkv": dev.buffer(x["qkv"]), "taps": dev.buffer(taps), "window": wins[src], "b": dev.buffer(x["b"]),
                  "a": dev.buffer(x["a"]), "a_neg": dev.buffer(a_neg), "dt_bias": dev.buffer(dt_bias), "x": xb,
                  "gates": gates, "window_out": wins[dst], "args": args})
        dispatch(dev, scan, (Hv,), (32 * -(-A.GDN_SCAN_SPLIT * Dv // 32),),
                 {"x": xb, "gates": gates, "z": dev.buffer(x["z"]), "norm_w": dev.buffer(norm_w), "S": Ss[src],
                  "S_out": Ss[dst], "o": o, "args": args})
        want_o, ref_S, ref_win, _ = gdn_reference(Hk, Hv, Dk, Dv, taps, ref_win, ref_S, a_neg, dt_bias, norm_w, eps,
                                                **x)
        ref_S = ref_S.astype(np.float32)
        what = f"chunk {i} (T={T})"
        np.testing.assert_allclose(read(o, np.float32, (T, vdim)), want_o, rtol=1e-4, atol=1e-4, err_msg=what)
        np.testing.assert_allclose(read(Ss[dst], np.float32, S0.shape), ref_S, rtol=1e-4, atol=1e-5, err_msg=what)
        np.testing.assert_array_equal(read(wins[dst], np.float32, window.shape), ref_win, err_msg=what)


# ---- whole model ----------------------------------------------------------------------------------

CHUNK = 5  # prompts of 3 (one partial chunk), 9 and 11 tokens (several chunks, the last partial)


@pytest.fixture(scope="module", params=[pytest.param(m, id=cases.case_id(m)) for m in MODELS])
def models(request, store, lily):
    path = store.mlx(*request.param)
    gpu = lily.Model.load(path, backend="msl-cpu", prefill_chunk=CHUNK, backend_options=cases.F32_KV)
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32", prefill_chunk=CHUNK)
    return gpu, cpu, store.mlx_reference(path)


@pytest.mark.parametrize("n", [3, 11])  # one partial chunk; chunks of 5, 5 and 1 (decode kernels)
def test_chunked_prefill_then_decode(models, n):
    gpu, cpu, _ = models
    s, c = gpu.session(), cpu.session()
    _check(s.prefill(cases.PROMPT[:n], all_logits=True), c.prefill(cases.PROMPT[:n], all_logits=True),
           f"prefill of {n} tokens in chunks of {CHUNK} vs cpu backend")
    for i in range(n, min(n + 3, len(cases.PROMPT))):
        _check(s.decode(cases.PROMPT[i]), c.decode(cases.PROMPT[i]), f"decode at position {i} vs cpu backend")


def test_generate_greedy_from_prompt(models, lily):
    """The prompt's last chunk is device greedy step 0: its argmax is fed to step 1 on the
    device. Same tokens as the CPU backend; the only CPU waits are one between prefill chunks
    and one per generated token (none inside a chunk)."""
    gpu, cpu, ref = models
    prompt = list(cases.GEN_PROMPT)
    n_tok = cases.GEN_TOKENS
    want = cpu._engine.generate_greedy(cpu.session()._state, prompt, n_tok)
    assert want == ref.gen_tokens, "host greedy from a prompt differs from mlx-lm's tokens"
    with pytest.raises(lily.RequestError, match="at least one prompt token"):
        gpu._engine.generate_greedy(gpu.session()._state, [], n_tok)
    eng = gpu._engine
    s = gpu.session()
    _, _, cb0, w0, _ = eng.gpu_stats
    got = eng.generate_greedy(s._state, prompt, n_tok)
    _, _, cb1, w1, _ = eng.gpu_stats
    assert got == want, "greedy tokens differ from the cpu backend's"
    assert s.position == len(prompt) + n_tok - 1
    chunks = -(-len(prompt) // CHUNK)
    assert w1 - w0 == (chunks - 1) + n_tok, f"{w1 - w0} CPU waits for {chunks} chunks and {n_tok} tokens"
    assert cb1 - cb0 == (chunks - 1) + n_tok
    # The state continues as a host prefill + decode would leave it.
    c = cpu.session()
    c.prefill(prompt + want[:-1])
    _check(s.decode(want[-1]), c.decode(want[-1]), "decode after generate_greedy vs cpu backend")


def test_prefill_chunk_dependency_check(store, lily):
    """A two-chunk prefill under check_dependencies (every barrier-free group of dispatches
    rerun in reverse) and a randomized thread interleaving: no undeclared data edge, no missing
    barrier in the prefill kernels; logits still the CPU backend's."""
    path = store.mlx("qwen3_next", 4)
    gpu = lily.Model.load(path, backend="msl-cpu", prefill_chunk=4,
                          backend_options=dict(check_dependencies=True, interleavings=1, **cases.F32_KV))
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32", prefill_chunk=4)
    _check(gpu.session().prefill(cases.PROMPT[:7], all_logits=True),
           cpu.session().prefill(cases.PROMPT[:7], all_logits=True), "checked chunked prefill vs cpu backend")
