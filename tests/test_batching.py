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
GPU backends run a batch as one pass per sequence: on msl-cpu (the Metal kernels on the CPU)
decode_batch and a mixed step equal solo decodes and prefills.
"""

from __future__ import annotations

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


def test_msl_cpu_runs_a_batch_one_sequence_at_a_time(msl_path):
    model = lily.Model.load(msl_path, backend="msl-cpu")
    engine = model._engine
    prompts = [PROMPTS[1], PROMPTS[2][:7]]
    batch, solo = _prefilled(model, prompts)
    tokens = [11, 12]
    for step in range(2):
        got = engine.decode_batch(batch, np.asarray(tokens, dtype=np.int32))
        _assert_same(got, _solo(model, solo, tokens), f"msl-cpu decode_batch step {step}")
        tokens = [int(t) for t in got.argmax(-1)]
    # A mixed step: a 3-token chunk beside a decode row.
    fresh, twin = engine.new_state(64), engine.new_state(64)
    got = engine.step([batch[0], fresh], [np.asarray([tokens[0]], np.int32), np.asarray([1, 2, 3], np.int32)])
    _assert_same(got[0], engine.decode(solo[0], tokens[0]), "msl-cpu step: the decode row")
    _assert_same(got[1], engine.prefill(twin, np.asarray([1, 2, 3], np.int32), False), "msl-cpu step: the chunk")
    # No batch while a device decode loop runs on the engine (its passes would interleave).
    assert engine.begin_device_decode(twin, 4, 2)
    try:
        _refused(engine, batch, [1, 2], r"device decode loop is running")
    finally:
        engine.end_device_decode(twin)
