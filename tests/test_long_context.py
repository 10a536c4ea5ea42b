"""Long contexts on the CPU backend against transformers (fp32): the attention routes that only
a long cache reaches.

The CPU attention (csrc/cpu/attention.cpp) works in tiles of 16 chunk tokens x the query heads
of one KV head, over blocks of 32 cache positions folded into fixed spans of 256 positions from
position 0, whose partial softmax states are merged in order; when a chunk has too few (head,
tile) items for the thread pool (decode, short chunks) the spans become work items of their own
(split-K). A 70-token prompt (test_forward_transformers) reaches none of the multi-block,
multi-span merges; these prompts of ~1,000 tokens do (4 spans), with 1 and 4 threads.

Tolerance: TOL_FP32 as everywhere against transformers (fixtures/cases.py); the summation order
differs (online softmax by blocks, split merge), which moves fp32 logits by ~1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures import cases
from fixtures import references as ref

N_PROMPT = 1_000  # 62 tiles of 16, 31 blocks of 32, 4 spans of 256
N_DECODE = 4
CHUNK = 256  # several multi-tile chunks; the last one continues over a 768-position cache

_rng = np.random.default_rng(7_32_768)
TOKENS = [int(x) for x in _rng.integers(0, cases.VOCAB, size=N_PROMPT + N_DECODE)]


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def long_case(request, store):
    path = store.hf(request.param, "fused")
    want = ref.hf_logits(ref.hf_load(path), TOKENS)
    return path, want


def test_long_prompt_logits(long_case, lily):
    path, want = long_case
    model = lily.Model.load(path, prefill_chunk=CHUNK, threads=4, cpu_matmul="f32")
    got = model.logits(TOKENS)
    err = ref.rel_err(got, want)
    assert err <= cases.TOL_FP32, f"{len(TOKENS)} tokens in chunks of {CHUNK}: rel err {err:.3e}"


def test_decode_over_long_cache(long_case, lily):
    path, want = long_case
    model = lily.Model.load(path, prefill_chunk=CHUNK, threads=4, cpu_matmul="f32")
    s = model.session()
    last = s.prefill(TOKENS[:N_PROMPT])
    err = ref.rel_err(last, want[N_PROMPT - 1])
    assert err <= cases.TOL_FP32, f"prefill of {N_PROMPT}: rel err {err:.3e}"
    for i in range(N_PROMPT, N_PROMPT + N_DECODE):
        got = s.decode(TOKENS[i])
        err = ref.rel_err(got, want[i])
        assert err <= cases.TOL_FP32, f"decode at position {i}: rel err {err:.3e}"


def test_decode_threads_do_not_change_result(long_case, lily):
    """1 thread (each tile walks its spans) and 4 threads (spans split over threads, merged in a
    second pass) give the same bits: one order of operations per row."""
    path, _ = long_case
    outs = []
    for threads in (1, 4):
        s = lily.Model.load(path, prefill_chunk=CHUNK, threads=threads, cpu_matmul="f32").session()
        s.prefill(TOKENS[:N_PROMPT])
        outs.append(np.asarray(s.decode(TOKENS[N_PROMPT])))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), \
        f"1 vs 4 threads: max |diff| {np.max(np.abs(outs[1] - outs[0])):.3e}"
