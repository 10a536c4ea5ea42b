"""A token's logits do not depend on how its prompt was processed: bit for bit, in both CPU
matmul modes (the default "int8" where the CPU has the integer kernels, and "f32").

Reference: the teacher-forced logits of the whole prompt in one prefill chunk, one process. Each
test reaches the same tokens another way and asserts the very same float32 bits:
- prefill in chunks of 1, 5, 12 and 37 tokens (Model.load's prefill_chunk), and in random
  chunkings through Session.prefill (seeded);
- prefill part of the prompt, then decode the rest one token at a time (the single-token MoE
  path, split-K attention over the cache);
- 1 and 3 worker threads (how rows, tiles and attention spans are shared out);
- a prefix-cache hit (lily.prefix_cache, as the server uses it): a longer prompt continuing a
  cached sequence, and a branch rewound to a snapshot;
- a restored DeltaNet snapshot (State.snapshot / restore) followed by other tokens;
- a Chat's second turn (state reused from the first) generates greedily the same tokens as a
  fresh model given the whole conversation.
The prompt is 300 tokens, so attention crosses its fixed 256-position spans (csrc/cpu/attention.cpp)
and the one-chunk reference is a single prefill of 300 rows.

Why bit-identity: int8 mode rounds activations to int8 per block, so any one-ulp difference
upstream can move a value across a rounding boundary and change the logits by ~1% (before this
was fixed, chunk 1 vs 512 moved the demo model's int8 logits by up to 1.9); a prefix-cache hit
would then continue a conversation differently from a fresh prefill. Every kernel computes each
output with one fixed order of operations (csrc/cpu/linear.h, linear_int8.h, attention.cpp),
which these tests pin end to end; tests/test_cpu_kernel_builds.py pins the kernels themselves.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

import lily
from fixtures.host import x86_flags
from fixtures.references import assert_same_bits as _assert_same
from lily.prefix_cache import PrefixCache

MODES = ["int8", "f32"]
PROMPT = [int(t) for t in np.random.default_rng(18).integers(0, 4000, size=300)]


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def reference(mode):
    """(model with prefill_chunk 512 and 2 threads, logits of PROMPT in one chunk)."""
    model = lily.Model.load(cpu_matmul=mode, threads=2)
    assert model._engine.cpu_matmul == mode
    return model, model.logits(PROMPT)


def test_default_mode_is_int8_where_the_cpu_has_the_kernels():
    model = lily.Model.load()
    if {"avx2", "fma"} <= x86_flags() or platform.machine() in ("aarch64", "arm64"):
        assert model._engine.cpu_matmul == "int8"
    assert model._engine.cpu_matmul == ("int8" if lily._core.cpu_int8_supported(4, 64, 256) else "f32")
    assert f"cpu_matmul={model._engine.cpu_matmul}" in repr(model)


def test_interleaved_layout_changes_no_bit():
    """Model.load lets the int8 engine rearrange its weights (the interleaved rows of
    csrc/cpu/linear_int8.h, on AVX-512 VNNI CPUs, where the demo model's 640-wide matrices take
    it): prefill (the GEMM, reading the layout a block at a time) and decode (the interleaved
    row kernel) give the row-major layout's logits bit for bit, and the rearranged weights are
    refused, by name, to any engine that cannot read them."""
    model = lily.Model.load(cpu_matmul="int8", threads=2)
    plain = lily.Model.load(cpu_matmul="int8", threads=2, backend_options={"exclusive_weights": False})
    assert model._weights.arranged_for_cpu_int8 == ({"avx512_vnni", "avx512bw", "avx512vl"} <= x86_flags())
    assert not plain._weights.arranged_for_cpu_int8
    logits = []
    for m in (model, plain):
        s = m.session()
        out = [s.prefill(PROMPT[:200], all_logits=True)]
        out += [s.decode(t)[None] for t in PROMPT[200:216]]
        out.append(s.prefill(PROMPT[216:229], all_logits=True))  # 13 tokens: the GEMM and its tail
        logits.append(np.concatenate(out))
    _assert_same(logits[0], logits[1], "interleaved vs row-major layout")
    if model._weights.arranged_for_cpu_int8:
        with pytest.raises(lily.ConfigError, match="rearranged for an int8 CPU engine"):
            lily._core.Engine(model._weights, "cpu", 2, 512, cpu_matmul="f32")
        with pytest.raises(lily.ConfigError, match="rearranged for an int8 CPU engine"):
            lily._core.Engine(model._weights, "msl-cpu", 2, 512)
        # Another int8 CPU engine reads the arranged weights as they are.
        assert lily._core.Engine(model._weights, "cpu", 2, 512, cpu_matmul="int8").cpu_matmul == "int8"


_RSS_AFTER_LOAD = """
import sys
import lily

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024

import lily._core  # the extension's own pages, before the baseline
before = rss()
m = lily.Model.load(cpu_matmul="int8", threads=1, backend_options={"exclusive_weights": sys.argv[1] == "1"})
print(rss() - before, int(m._weights.arranged_for_cpu_int8), int(m._weights.resident), m._weights.nbytes)
"""


def test_rearranged_weights_take_no_second_copy():
    """The int8 engine rearranges its matrices into a copy of its own (cpu::arrange_for_int8) and
    hands back the pages of the loader's copy under them: a load that rearranges holds about the
    memory of one that does not, not the checkpoint twice. (Each load in a fresh process; RSS from
    /proc, so Linux only.)"""
    import subprocess
    import sys

    if not Path("/proc/self/status").exists():
        pytest.skip("RSS is read from /proc (Linux)")
    runs = {}
    for exclusive in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", _RSS_AFTER_LOAD, exclusive], capture_output=True, text=True,
                             check=True).stdout.split()
        runs[exclusive] = [int(v) for v in out]
    grown, arranged, resident, nbytes = runs["1"]
    plain_grown, plain_arranged, _, _ = runs["0"]
    assert resident and not plain_arranged
    assert arranged == ({"avx512_vnni", "avx512bw", "avx512vl"} <= x86_flags())
    assert plain_grown > 0.8 * nbytes, "the loader's copy of the file is resident"
    assert grown < plain_grown + 0.25 * nbytes, (grown, plain_grown, nbytes)


@pytest.mark.parametrize("chunk", [1, 5, 12, 37])
def test_prefill_chunk_length(reference, mode, chunk):
    _, want = reference
    got = lily.Model.load(cpu_matmul=mode, threads=2, prefill_chunk=chunk).logits(PROMPT)
    _assert_same(got, want, f"{mode}: prefill_chunk={chunk} vs one chunk")


@pytest.mark.parametrize("seed", [0, 1])
def test_random_chunkings(reference, mode, seed):
    model, want = reference
    rng = np.random.default_rng(seed)
    s, parts, done = model.session(), [], 0
    while done < len(PROMPT):
        n = int(rng.choice([1, 2, 3, 7, 11, 16, 23, 64, 129]))
        parts.append(s.prefill(PROMPT[done:done + n], all_logits=True))
        done += len(parts[-1])
    _assert_same(np.concatenate(parts), want, f"{mode}: random chunking (seed {seed})")


def test_decode_equals_prefill(reference, mode):
    model, want = reference
    s = model.session()
    first = s.prefill(PROMPT[:200], all_logits=True)
    steps = np.stack([s.decode(t) for t in PROMPT[200:]])
    _assert_same(np.concatenate([first, steps]), want, f"{mode}: prefill 200 then decode 100")


def test_kv_cache_across_the_huge_page_threshold():
    """KV caches of 2 MiB and more live on huge pages (HugePageAllocator, csrc/model/pages.h):
    the demo model's K of a layer is 1 KiB a position, so a 2,100-token prompt grown in chunks of
    300 moves its caches from the small-page allocator (capacity 512, 1024) onto huge pages
    (2048, 4096), each growth copying the cache; its last tokens' logits and the decode step
    after them are, bit for bit, those of the same prompt in one chunk."""
    rng = np.random.default_rng(2100)
    prompt = [int(t) for t in rng.integers(0, 4000, size=2100)]
    model = lily.Model.load(threads=2, prefill_chunk=4096)
    assert model._engine.kv_bytes(1) == 4096  # K and V of the demo model's 2 attention layers
    s = model.session()
    want = s.prefill(prompt, all_logits=True)[-50:]
    want_next = s.decode(7)
    chunked = lily.Model.load(threads=2, prefill_chunk=300).session()
    got = chunked.prefill(prompt, all_logits=True)[-50:]
    _assert_same(got, want, "2,100 tokens in chunks of 300 vs one chunk")
    _assert_same(chunked.decode(7), want_next, "the decode step after them")


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count(reference, mode, threads):
    _, want = reference
    model = lily.Model.load(cpu_matmul=mode, threads=threads, prefill_chunk=37)
    _assert_same(model.logits(PROMPT), want, f"{mode}: {threads} threads, chunks of 37")
    s = model.session()
    s.prefill(PROMPT[:280])
    steps = np.stack([s.decode(t) for t in PROMPT[280:]])
    _assert_same(steps, want[280:], f"{mode}: {threads} threads, decode after 280")


def test_prefix_cache_hit_and_rewind(reference, mode):
    model, want = reference
    cache = PrefixCache(model, 1 << 30)
    a = PROMPT[:180]
    seq, reused = cache.acquire(a)
    assert reused == 0
    seq.prefill(np.asarray(a, dtype=np.int32))
    seq.take_snapshot()
    seq.prefill(np.asarray(PROMPT[180:190], dtype=np.int32))  # state moves past the snapshot
    cache.release(seq)

    seq, reused = cache.acquire(PROMPT)  # continues everything cached
    assert reused == 190
    got = seq.prefill(np.asarray(PROMPT[190:], dtype=np.int32), all_logits=True)
    _assert_same(got, want[190:], f"{mode}: prefix-cache hit after 190 tokens")
    cache.release(seq)

    branch = a + [7, 8, 9] + PROMPT[183:]  # differs right after the snapshot: rewound to it
    seq, reused = cache.acquire(branch)
    assert reused == 180 and seq.position == 180
    got = seq.prefill(np.asarray(branch[180:], dtype=np.int32), all_logits=True)
    fresh = model.logits(branch)
    _assert_same(got, fresh[180:], f"{mode}: branch rewound to the snapshot at 180")


def test_restored_snapshot(reference, mode):
    model, want = reference
    s = model.session()
    s.prefill(PROMPT[:150])
    snap = s._state.snapshot()
    s.prefill(PROMPT[150:260])  # other work on the state, then back
    s._state.restore(snap)
    assert s.position == 150
    got = s.prefill(PROMPT[150:], all_logits=True)
    _assert_same(got, want[150:], f"{mode}: restored snapshot at 150")


def test_chat_turn_reuses_state_and_matches_a_fresh_prompt(mode):
    model = lily.Model.load(cpu_matmul=mode, threads=2, prefill_chunk=16)
    chat = model.chat("You are terse.", enable_thinking=False)
    chat.send("Name three colours.", temperature=0, max_tokens=12)
    second = chat.send("And three animals?", temperature=0, max_tokens=12)
    assert second.cached_tokens > 0, "the second turn reused nothing"
    fresh = lily.Model.load(cpu_matmul=mode, threads=1, prefill_chunk=512).generate(
        chat.messages[:-1], temperature=0, max_tokens=12, enable_thinking=False)
    assert fresh.prompt_tokens == second.prompt_tokens
    assert fresh.tokens == second.tokens, f"{mode}: chat turn {second.tokens} vs fresh {fresh.tokens}"
