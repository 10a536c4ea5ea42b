"""The device decode loop over several sequences (``Engine.begin_device_batch``, GPU backends) and
the batcher that runs every generation's decode row in it (lily.batching).

Backend: msl-cpu (the Metal kernels on the CPU) with a float32 KV cache. Reference: each sequence
alone on the host loop of the same backend: ``Engine.decode`` and the native host sampler with
the same parameters and seed. A batched row's logits are bit-identical to its sequence's alone
(tests/test_batching.py) and the GPU sampler picks the host sampler's token from identical logits
and generator state (tests/test_metal_sampling.py), so the tokens must be exactly equal:
- three sequences at different positions, rows greedy and seeded with different filters, for
  several steps: each row's tokens are its solo host-loop tokens; afterwards each host sampler's
  generator state is the solo sampler's (the engine advances the host copy as the device draws),
  and each state, with the step in flight undone by end, gives the solo state's next logits bit
  for bit;
- a loop refuses what it cannot run (more rows than a pass holds, a state twice, a sampler with
  penalties, more steps than a context holds) and changes nothing; other calls while it runs;
- threads generating at once (the batcher): device rows of different lengths joining and leaving
  the loop, a request that needs the host (a repetition penalty) turning passes into host passes,
  and a stream closed mid-generation: every other answer is the one it gets alone.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import lily
from lily import _core
from test_continuous_batching import _in_threads

PROMPTS = [[5, 6, 7], list(range(40, 75)), [11, 3, 9, 27, 14, 2, 8, 60, 61, 62, 63]]
SAMPLING = [None, dict(temperature=0.8, top_k=20, seed=3), dict(temperature=1.1, top_p=0.9, min_p=0.02, seed=11)]
STEPS = 6


@pytest.fixture(scope="module")
def model(store):
    return lily.Model.load(store.mlx("qwen3_5_moe", 4, 64, "bfloat16"), backend="msl-cpu",
                           backend_options={"kv_dtype": "float32"})


def _sampler(kw):
    return None if kw is None else _core.Sampler(_core.SamplingParams(**kw), token_limit=0)


def _prefilled(engine, prompt):
    st = engine.new_state(256)
    engine.prefill(st, np.asarray(prompt[:-1], np.int32), False)
    return st


def _host_token(sampler, logits):
    return int(np.argmax(logits)) if sampler is None else sampler.sample(logits)[0]


def test_device_batch_gives_each_row_its_solo_tokens(model):
    engine = model._engine
    assert engine.has_device_loop
    batch = [_prefilled(engine, p) for p in PROMPTS]
    solo = [s.clone() for s in batch]
    device_samplers = [_sampler(kw) for kw in SAMPLING]
    host_samplers = [_sampler(kw) for kw in SAMPLING]
    first = [p[-1] for p in PROMPTS]

    # Solo: each sequence on the host loop.
    want = []
    for st, sampler, tok in zip(solo, host_samplers, first, strict=True):
        toks = []
        for _ in range(STEPS):
            tok = _host_token(sampler, engine.decode(st, tok))
            toks.append(tok)
        want.append(toks)

    starts = [s.position for s in batch]
    assert engine.begin_device_batch(batch, first, STEPS, device_samplers)
    assert engine.device_loop_running
    got = []
    for _ in range(STEPS):
        tokens, errors = engine.next_device_tokens()
        assert errors == [None] * len(PROMPTS)
        got.append(tokens)
    engine.end_device_batch()
    assert not engine.device_loop_running
    assert [list(row) for row in zip(*got, strict=True)] == want
    for d, h in zip(device_samplers, host_samplers, strict=True):
        if d is not None:
            assert d.rng_state == h.rng_state, "the host sampler did not follow the device's draws"
    # The state holds the first token and every returned one but the last (the step in flight undone).
    assert [s.position for s in batch] == [p + STEPS for p in starts] == [s.position for s in solo]
    for st, ref, toks in zip(batch, solo, want, strict=True):
        assert np.array_equal(engine.decode(st, toks[-1]), engine.decode(ref, toks[-1]))


def test_device_batch_refusals_change_nothing(model):
    engine = model._engine
    a, b = (_prefilled(engine, p) for p in PROMPTS[:2])
    before = [a.position, b.position]
    greedy = [None, None]
    with pytest.raises(lily.RequestError, match="appear|once"):
        engine.begin_device_batch([a, a], [1, 2], 2, greedy)
    with pytest.raises(lily.RequestError, match="at most 7 sequences"):
        states = [_prefilled(engine, [3, 4]) for _ in range(8)]
        engine.begin_device_batch(states, [1] * 8, 2, [None] * 8)
    penalty = _core.Sampler(_core.SamplingParams(temperature=0, repetition_penalty=1.2), token_limit=0)
    with pytest.raises(lily.RequestError, match="penalties"):
        engine.begin_device_batch([a, b], [1, 2], 2, [None, penalty])
    with pytest.raises(lily.RequestError, match="exceed the context"):
        engine.begin_device_batch([a, b], [1, 2], 10_000, greedy)
    assert [a.position, b.position] == before and not engine.device_loop_running
    # While a loop runs, host calls are refused (the batcher ends the loop before any).
    assert engine.begin_device_batch([a, b], [1, 2], 3, greedy)
    try:
        with pytest.raises(lily.RequestError, match="device decode loop is running"):
            engine.decode(a, 1)
    finally:
        engine.end_device_batch()
    assert [a.position, b.position] == before  # begin's step undone, none read


def test_threads_share_the_device_loop_and_get_their_solo_answers(model):
    """Four generations at once: three device rows of 3, 14 and 20 tokens (joining and leaving the
    loop) and a request with a repetition penalty (its logits must reach the host, so while it
    runs the passes are host passes, the device rows drawn by their samplers on the host); then
    a stream closed after 2 tokens among two others. (The two long rows outlast the 6-token
    penalty request by enough steps to share device-loop steps however the threads start.)"""
    reqs = [dict(max_tokens=3, temperature=0, repetition_penalty=1),
            dict(max_tokens=14, temperature=0.8, top_k=20, seed=4, repetition_penalty=1),
            dict(max_tokens=20, temperature=1.0, top_p=0.9, seed=9, repetition_penalty=1),
            dict(max_tokens=6, temperature=0.7, seed=2, repetition_penalty=1.3)]
    solo = [model.generate(p, **r).tokens for p, r in zip(PROMPTS + [[9, 9, 1]], reqs, strict=True)]
    stats = model._batcher.stats
    steps0, loops0 = stats.device_steps, stats.device_loops
    stats.max_device_sequences = 0
    got = _in_threads(lambda i: model.generate((PROMPTS + [[9, 9, 1]])[i], **reqs[i]).tokens, 4)
    assert got == solo
    assert stats.max_device_sequences > 1, "no device-loop step held two rows"
    assert stats.device_loops - loops0 > 1 and stats.device_steps > steps0

    # A stream closed mid-generation leaves the others' answers unchanged (and the model free).
    def run(i):
        if i == 0:
            with model.generate(PROMPTS[0], stream=True, **reqs[2]) as stream:
                return [c.token for _, c in zip(range(2), stream, strict=False)]
        return model.generate(PROMPTS[i], **reqs[i]).tokens

    got = _in_threads(run, 3)
    assert got[1:] == solo[1:3]
    assert got[0] == model.generate(PROMPTS[0], **reqs[2]).tokens[:2]


def test_state_operations_wait_for_the_device_loop(model):
    """A session's state operations refuse while its own generation runs in the device loop (the
    state moves on the device between steps), and a row closed where it could not end the loop
    (a finalizer inside a pass) leaves it to the next state operation, which ends it first: the
    session's position then equals its recorded tokens."""
    s = model.session()
    s.prefill(PROMPTS[0])
    row = s.device_loop(4, 6, None)
    row.next()
    row.next()
    with pytest.raises(lily.RequestError, match="generation is running on this session"):
        s.take_snapshot()
    batcher = model._batcher
    batcher._leader = threading.get_ident()  # as if closed by a finalizer inside a pass
    try:
        row.close()
    finally:
        batcher._leader = None
    assert batcher._loop and s.position == len(s._tokens) + 1  # the step in flight, not yet undone
    s.take_snapshot()  # settles first
    assert not batcher._loop and s.position == len(s.tokens) == len(PROMPTS[0]) + 2
    assert s.snapshots[-1].position == s.position
