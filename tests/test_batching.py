"""Continuous batching (Engine.decode_batch, Engine.step): one forward pass whose rows belong to
several sequences, each extending its own state.

Reference: the same sequence run alone (Session.prefill / decode on a clone of its state, same
process, same model). On the CPU backend every kernel computes an output row by one fixed order
of operations that depends on that row alone (csrc/cpu/linear.h, linear_int8.h, moe.cpp,
attention.cpp), so a sequence's logits must be the very same float32 bits whichever other
sequences share its pass, in both CPU matmul modes and at any thread count:
- B = 1, 2, 3, 5 sequences at different positions (prompts of 250, 3, 40, 255 and 300 tokens:
  the decode steps cross attention's fixed 256-position spans), greedy for several steps, on the
  demo model (MoE layers) and a tiny dense-MLP checkpoint;
- batch membership changing every step (a sequence joins, one leaves, the order changes);
- a prompt prefilled in chunks inside the decode passes of other sequences (Engine.step);
- refused batches (a state of another engine, a state twice, a full context, a bad token, a
  device decode loop running) raise a RequestError naming the problem and change no state.
GPU backends batch too (msl-cpu: the Metal kernels on the CPU; reference: the same sequence
alone on msl-cpu, bit for bit): 2-4 sequences at different positions (one past the split-K
threshold) decode in ONE command buffer that reads the weights once; a prefill chunk inside
the decode pass of others; a step over GpuBackend's batch_rows (below the GEMM route's 8 rows)
split into passes that still equal solo; the same under msl-cpu's dependency check; a pass
that fails while encoded (msl-cpu's fault injection) leaves every sequence where it was.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import lily
from fixtures.references import assert_same_bits as _assert_same

MODES = ["int8", "f32"]
_rng = np.random.default_rng(19)
PROMPTS = [[int(t) for t in _rng.integers(0, 500, size=n)] for n in (250, 3, 40, 255, 300)]
STEPS = 8


@pytest.fixture(scope="module")
def dense_path(store):
    return store.mlx("qwen3_5", 4, 64, None)  # tiny, dense MLP in every layer


@pytest.fixture(scope="module", params=[(m, t, k) for k in ("moe", "dense") for m in MODES for t in (1, 2)],
                ids=lambda p: f"{p[2]}-{p[0]}-{p[1]}t")
def model(request, dense_path):
    mode, threads, kind = request.param
    m = lily.Model.load(None if kind == "moe" else dense_path, cpu_matmul=mode, threads=threads)
    assert m._engine.cpu_matmul == mode
    return m


def _prefilled(model, prompts):
    """(batch states, solo states): each prompt prefilled once, the solo copy a clone."""
    batch = []
    for p in prompts:
        s = model._engine.new_state(1024)
        model._engine.prefill(s, np.asarray(p, dtype=np.int32), False)
        batch.append(s)
    return batch, [s.clone() for s in batch]


def _solo(model, states, tokens):
    return np.stack([model._engine.decode(s, int(t)) for s, t in zip(states, tokens, strict=True)])


@pytest.mark.parametrize("B", [1, 2, 3, 5])
def test_batched_greedy_decode_is_bit_identical_to_solo(model, B):
    engine = model._engine
    batch, solo = _prefilled(model, PROMPTS[:B])
    tokens = [p[-1] for p in PROMPTS[:B]]  # fed again: any token will do
    for step in range(STEPS):
        got = engine.decode_batch(batch, np.asarray(tokens, dtype=np.int32))
        want = _solo(model, solo, tokens)
        _assert_same(got, want, f"B={B}, step {step}")
        assert [s.position for s in batch] == [s.position for s in solo]
        tokens = [int(t) for t in got.argmax(-1)]  # greedy: the same tokens as solo, since the logits are


@pytest.mark.parametrize("mode", MODES)
def test_split_k_attention_across_sequences(mode):
    """4 threads and 3 sequences: the (head, tile) items of a decode pass are too few for the
    threads, so each sequence past 256 positions splits its attention into span items merged in
    a second pass (csrc/cpu/attention.cpp attend), beside one that does not split."""
    model = lily.Model.load(cpu_matmul=mode, threads=4)
    batch, solo = _prefilled(model, [PROMPTS[4], PROMPTS[1], PROMPTS[3]])
    tokens = [1, 2, 3]
    for step in range(3):
        got = model._engine.decode_batch(batch, np.asarray(tokens, dtype=np.int32))
        _assert_same(got, _solo(model, solo, tokens), f"{mode}: split-K, step {step}")
        tokens = [int(t) for t in got.argmax(-1)]


def test_membership_changes_every_step(model):
    engine = model._engine
    batch, solo = _prefilled(model, PROMPTS)
    tok = [7, 8, 9, 10, 11]
    # (indices in the pass, in pass order) per step: joins, leaves, reorders, a lone sequence.
    for step, members in enumerate([[0, 1], [0, 1, 2], [1, 2], [2, 4, 0, 1], [3], [4, 3, 2, 1, 0], [1, 3]]):
        got = engine.decode_batch([batch[i] for i in members], np.asarray([tok[i] for i in members], dtype=np.int32))
        want = _solo(model, [solo[i] for i in members], [tok[i] for i in members])
        _assert_same(got, want, f"step {step}, members {members}")
        for j, i in enumerate(members):
            tok[i] = int(got[j].argmax())
    assert [s.position for s in batch] == [s.position for s in solo]


def test_prompt_prefilled_inside_decode_passes(model):
    """A 70-token prompt prefilled in chunks of 16 inside other sequences' decode steps (first,
    middle and last in the pass): its chunk-end logits equal a solo prefill's, the others'
    decode logits equal solo decodes."""
    engine = model._engine
    batch, solo = _prefilled(model, [PROMPTS[0], PROMPTS[3]])
    prompt = PROMPTS[4][:70]
    fresh = engine.new_state(1024)
    want_prompt = engine.prefill(engine.new_state(1024), np.asarray(prompt, dtype=np.int32), True)
    tok = [5, 6]
    for i, at in enumerate(range(0, len(prompt), 16)):
        chunk = np.asarray(prompt[at:at + 16], dtype=np.int32)
        states, tokens = [batch[0], batch[1]], [np.asarray([tok[0]], np.int32), np.asarray([tok[1]], np.int32)]
        where = i % 3  # the prefill chunk first, between, or after the decode rows
        states.insert(where, fresh)
        tokens.insert(where, chunk)
        got = engine.step(states, tokens)
        others = np.delete(got, where, axis=0)
        _assert_same(others, _solo(model, solo, tok), f"decode rows beside prefill chunk {i}")
        _assert_same(got[where], want_prompt[at + len(chunk) - 1], f"prefill chunk {i}'s last row")
        tok = [int(t) for t in others.argmax(-1)]
    assert fresh.position == len(prompt)
    # The prompt's state continues as a solo prefill's would.
    twin = engine.new_state(1024)
    engine.prefill(twin, np.asarray(prompt, dtype=np.int32), False)
    _assert_same(engine.decode_batch([fresh, batch[0]], np.asarray([3, tok[0]], np.int32))[0],
                 engine.decode(twin, 3), "decode after a prompt prefilled in batched passes")


def _refused(engine, states, tokens, match):
    before = [s.position for s in states]
    with pytest.raises(lily.RequestError, match=match):
        engine.decode_batch(states, np.asarray(tokens, dtype=np.int32))
    assert [s.position for s in states] == before


def test_refused_batches_change_nothing():
    model = lily.Model.load(threads=2)
    other = lily.Model.load(threads=2)
    engine = model._engine
    batch, solo = _prefilled(model, PROMPTS[:3])
    foreign = other._engine.new_state(64)
    full = engine.new_state(4)
    engine.prefill(full, np.asarray([1, 2, 3, 4], dtype=np.int32), False)

    _refused(engine, [batch[0], foreign], [1, 2], r"sequence 1 of the batch's state belongs to another engine")
    _refused(engine, [batch[0], batch[1], batch[0]], [1, 2, 3], r"sequence 2 of the batch's state is also sequence 0's")
    _refused(engine, [batch[0], full, batch[1]], [1, 2, 3], r"exceed the context of 4 \(sequence 1 of the batch\)")
    _refused(engine, [batch[0], batch[1]], [1, 10**6], r"token id 1000000 .*outside the vocabulary.*sequence 1")
    _refused(engine, [], [], r"at least one sequence")
    with pytest.raises(lily.RequestError, match=r"2 states but 3 tokens"):
        engine.decode_batch(batch[:2], np.asarray([1, 2, 3], dtype=np.int32))
    with pytest.raises(lily.RequestError, match=r"sequence 1 of the batch has no tokens"):
        engine.step(batch[:2], [np.asarray([1], np.int32), np.asarray([], np.int32)])
    assert foreign.position == 0 and full.position == 4
    # Nothing moved: the next steps equal the untouched clones', bit for bit.
    _assert_same(engine.decode_batch(batch, np.asarray([4, 5, 6], dtype=np.int32)), _solo(model, solo, [4, 5, 6]),
                 "decode after refused batches")


@pytest.fixture(scope="module")
def msl_path(store):
    return store.mlx("qwen3_5_moe", 4, 64, "bfloat16")


def _gpu_pass(engine, run, *args):
    """run(*args)'s result, the command buffers it took, the weight bytes its dispatches read per
    kernel and its dispatches per kernel."""
    engine.gpu_records(True)
    cb0 = engine.gpu_stats[2]
    out = run(*args)
    cb = engine.gpu_stats[2] - cb0
    weights, dispatches = collections.Counter(), collections.Counter()
    for r in engine.gpu_records(False):
        weights[r[0]] += r[2]
        dispatches[r[0]] += 1
    return out, cb, weights, dispatches


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("B", [2, 3, 4])
def test_msl_cpu_batched_decode_is_bit_identical_to_solo(msl_path, dense_path, kind, B):
    """B sequences at positions 3, 7, 40 (past split-K's 32) and 1 decode in one pass: one
    command buffer reading every dense matrix once (a solo step's bytes), each attention and
    DeltaNet kernel one dispatch per layer for all B sequences (as for one), logits
    bit-identical to solo."""
    model = lily.Model.load(msl_path if kind == "moe" else dense_path, backend="msl-cpu")
    engine = model._engine
    assert engine.batch_rows == 7
    batch, solo = _prefilled(model, [PROMPTS[1], PROMPTS[2][:7], PROMPTS[2], PROMPTS[0][:1]][:B])
    tokens = [11, 12, 13, 14][:B]
    for step in range(3):
        want, _, solo_bytes, solo_dispatches = _gpu_pass(engine, engine.decode, solo[0], tokens[0])
        want = np.stack([want] + [engine.decode(s, t) for s, t in zip(solo[1:], tokens[1:], strict=True)])
        got, cbs, weight_bytes, dispatches = _gpu_pass(engine, engine.decode_batch, batch,
                                                       np.asarray(tokens, np.int32))
        _assert_same(got, want, f"msl-cpu decode_batch of {B}, step {step}")
        assert cbs == 1
        # Each mixer kernel as many dispatches as in a solo step, one per layer (attn_combine: as
        # many as attn_decode; the solo row, at position 3, has no split to combine).
        decode = next(n for k, n in solo_dispatches.items() if k.startswith("attn_decode"))
        mixers = {k: n for k, n in dispatches.items() if k.startswith(("attn_", "gdn_"))}
        assert mixers == {k: solo_dispatches.get(k, decode) for k in mixers}, (mixers, solo_dispatches)
        # Dense matrices read once for all rows; the embedding rows and routed experts that
        # the rows choose (their union) are per row.
        per_row = [k for k in solo_bytes if k.startswith(("embed", "moe_gate_up", "moe_down"))]
        once = {k: (weight_bytes[k], n) for k, n in solo_bytes.items() if k not in per_row and weight_bytes[k] != n}
        assert not once and not any(weight_bytes[k] for k in set(weight_bytes) - set(solo_bytes)), once
        assert all(solo_bytes[k] <= weight_bytes[k] <= B * solo_bytes[k] for k in per_row)
        tokens = [int(t) for t in got.argmax(-1)]


def test_msl_cpu_per_sequence_mixers_is_the_same_pass_in_more_dispatches(msl_path):
    """backend_options per_sequence_mixers (phase M's A/B knob): the batched step's logits
    bit-identical to the sequence tables', each mixer kernel once per sequence and layer."""
    tables = lily.Model.load(msl_path, backend="msl-cpu")
    each = lily.Model.load(msl_path, backend="msl-cpu", backend_options=dict(per_sequence_mixers=True))
    prompts, tokens = [PROMPTS[1], PROMPTS[2][:7], PROMPTS[2]], np.asarray([11, 12, 13], np.int32)
    runs = []
    for model in (tables, each):
        batch, _ = _prefilled(model, prompts)
        runs.append(_gpu_pass(model._engine, model._engine.decode_batch, batch, tokens))
    _assert_same(runs[1][0], runs[0][0], "per-sequence mixers against tables")
    def count(run, prefix):
        return sum(n for k, n in run[3].items() if k.startswith(prefix))

    for prefix in ("attn_prepare", "attn_decode", "gdn_conv", "gdn_recurrence"):
        assert count(runs[0], prefix) > 0 and count(runs[1], prefix) == len(prompts) * count(runs[0], prefix), prefix


def test_msl_cpu_batched_pass_declares_its_dependencies(msl_path):
    """msl-cpu's dependency check runs each group of dispatches the hazard tracker deemed
    independent in reverse: the per-segment mixer dispatches (on offsets of shared activation
    and split-K scratch buffers) must declare every edge, or a batched step (decode rows at
    positions 3, 7 and 40, and a 3-token chunk) would differ from solo."""
    model = lily.Model.load(msl_path, backend="msl-cpu", backend_options=dict(check_dependencies=True))
    engine = model._engine
    batch, solo = _prefilled(model, [PROMPTS[1], PROMPTS[2][:7], PROMPTS[2]])
    fresh, twin = engine.new_state(64), engine.new_state(64)
    chunk = np.asarray(PROMPTS[3][:3], np.int32)
    got = engine.step([*batch, fresh], [np.asarray([t], np.int32) for t in (1, 2, 3)] + [chunk])
    _assert_same(got[:3], _solo(model, solo, [1, 2, 3]), "checked batched decode rows")
    _assert_same(got[3], engine.prefill(twin, chunk, False), "checked chunk beside them")


def test_msl_cpu_prefill_chunk_inside_decode_passes(msl_path):
    """A 12-token prompt in chunks of 4 inside two sequences' decode passes (6 rows: one pass),
    first, between or after them, against the same chunks prefilled alone; then a step of 8
    decode rows and one with a 9-token chunk, over batch_rows: split into passes, still
    bit-identical to solo."""
    model = lily.Model.load(msl_path, backend="msl-cpu")
    engine = model._engine
    batch, solo = _prefilled(model, [PROMPTS[1], PROMPTS[2]])
    prompt = PROMPTS[4][:12]
    fresh, twin = engine.new_state(64), engine.new_state(64)
    tok = [5, 6]
    for i, at in enumerate(range(0, len(prompt), 4)):
        chunk = np.asarray(prompt[at:at + 4], np.int32)
        states, tokens = [batch[0], batch[1]], [np.asarray([t], np.int32) for t in tok]
        states.insert(i % 3, fresh)
        tokens.insert(i % 3, chunk)
        got, cbs, _, _ = _gpu_pass(engine, engine.step, states, tokens)
        others = np.delete(got, i % 3, axis=0)
        _assert_same(others, _solo(model, solo, tok), f"decode rows beside prefill chunk {i}")
        _assert_same(got[i % 3], engine.prefill(twin, chunk, False), f"prefill chunk {i}'s last row")
        assert cbs == 1
        tok = [int(t) for t in others.argmax(-1)]
    # 8 decode rows: passes of 7 and 1.
    more, more_solo = _prefilled(model, [PROMPTS[3][:n] for n in (2, 3, 4, 5, 6)])
    states, twins = [fresh, *batch, *more], [twin, *solo, *more_solo]
    tokens = list(range(20, 28))
    got, cbs, _, _ = _gpu_pass(engine, engine.decode_batch, states, np.asarray(tokens, np.int32))
    _assert_same(got, _solo(model, twins, tokens), "8 decode rows (two passes)")
    assert cbs == 2
    # A 9-token chunk (the GEMM route: a pass of its own) beside two decode rows.
    chunk, alone = engine.new_state(64), engine.new_state(64)
    got, cbs, _, _ = _gpu_pass(engine, engine.step, [batch[0], chunk, batch[1]],
                            [np.asarray([3], np.int32), np.asarray(prompt[:9], np.int32), np.asarray([4], np.int32)])
    _assert_same(np.delete(got, 1, axis=0), _solo(model, solo[:2], [3, 4]), "decode rows beside a 9-token chunk")
    _assert_same(got[1], engine.prefill(alone, np.asarray(prompt[:9], np.int32), False), "the 9-token chunk")
    assert cbs == 2


def test_msl_cpu_failed_batched_pass_leaves_every_sequence_usable(msl_path):
    """Attention's decode kernel fails on its first dispatch (segment 0 of the pass), after
    every segment's DeltaNet layers were encoded: the step raises, no position moves, and the
    next steps equal solo decodes (abandon_pass put every segment's state copies back)."""
    model = lily.Model.load(msl_path, backend="msl-cpu",
                            backend_options=dict(fail_dispatch="attn_decode_float_d96", kv_dtype="float32"))
    engine = model._engine
    batch, solo = _prefilled(model, [PROMPTS[1], PROMPTS[2][:7], PROMPTS[2]])
    with pytest.raises(lily.LilyError, match=r"attn_decode_float_d96': injected failure"):
        engine.decode_batch(batch, np.asarray([7, 8, 9], np.int32))
    assert [s.position for s in batch] == [s.position for s in solo]
    tokens = [7, 8, 9]
    for step in range(2):
        got = engine.decode_batch(batch, np.asarray(tokens, np.int32))
        _assert_same(got, _solo(model, solo, tokens), f"decode_batch {step} after the failed pass")
        tokens = [int(t) for t in got.argmax(-1)]


def test_msl_cpu_refuses_a_batch_during_a_device_loop(msl_path):
    model = lily.Model.load(msl_path, backend="msl-cpu")
    engine = model._engine
    batch, _ = _prefilled(model, [PROMPTS[1], PROMPTS[2][:7]])
    twin = engine.new_state(64)
    # No batch while a device decode loop runs on the engine (its passes would interleave).
    assert engine.begin_device_decode(twin, 4, 2)
    try:
        _refused(engine, batch, [1, 2], r"device decode loop is running")
    finally:
        engine.end_device_decode(twin)
