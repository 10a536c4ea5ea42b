"""The native sampler (csrc/engine/sampler.cpp) against a NumPy reference written here.

The reference follows the documented order (docs/api-generation.md): penalties on the raw
logits -> temperature -> top-k -> top-p (renormalized over the top-k set) -> min-p -> draw, with
ties broken by the lowest id; logprobs are the log-softmax of the penalized, untempered logits.
Statistical checks use fixed seeds and bounds at a 1e-6 false-alarm rate, so a wrong
distribution fails and a right one does not flake.
"""

import numpy as np
import pytest
from scipy import stats

import lily
from lily._core import Sampler, SamplingParams


def make_sampler(**kw):
    return Sampler(SamplingParams(**kw))


def ref_penalize(logits, window, rep=1.0, presence=0.0, frequency=0.0):
    out = logits.astype(np.float32).copy()
    if len(window) == 0:
        return out
    ids, counts = np.unique(np.asarray(window), return_counts=True)
    v = out[ids]
    v = np.where(v > 0, v / np.float32(rep), v * np.float32(rep)).astype(np.float32)
    out[ids] = v - (np.float32(presence) + np.float32(frequency) * counts.astype(np.float32))
    return out


def ref_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def ref_allowed(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Token ids that may be drawn, and their renormalized probabilities."""
    s = logits.astype(np.float64) / temperature
    v = len(s)
    order = np.lexsort((np.arange(v), -s))  # descending logit, ascending id
    cand = order[:top_k] if 0 < top_k < v else order
    if top_p < 1.0:
        w = np.exp(s[cand] - s.max())
        w /= w.sum()
        before = np.cumsum(w) - w
        cand = cand[: max(1, int(np.sum(before < top_p)))]
    if min_p > 0:
        cand = cand[np.exp(s[cand] - s.max()) >= min_p]
    p = np.exp(s[cand] - s.max())
    return cand, p / p.sum()


def draw_many(sampler, logits, n):
    return np.array([sampler.sample(logits)[0] for _ in range(n)])


def assert_matches_distribution(draws, ids, probs):
    """All draws inside ids, and their histogram consistent with probs (chi-square, p > 1e-6)."""
    allowed = set(ids.tolist())
    outside = set(np.unique(draws).tolist()) - allowed
    assert not outside, f"sampled tokens outside the allowed set: {sorted(outside)[:10]}"
    index = {t: i for i, t in enumerate(ids.tolist())}
    counts = np.bincount([index[t] for t in draws.tolist()], minlength=len(ids))
    expected = probs * len(draws)
    # Pool the rare tokens so every cell expects >= 5 draws (chi-square validity).
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        exp = exp * obs.sum() / exp.sum()
    if len(obs) < 2:
        return
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    bound = stats.chi2.ppf(1 - 1e-6, len(obs) - 1)
    assert chi2 < bound, f"chi2 {chi2:.1f} >= {bound:.1f} over {len(obs)} cells"


# ------------------------------------------------------------------------------------- greedy


def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(0)
    s = make_sampler(temperature=0.0)
    for v in (1, 2, 31, 32, 33, 1000, 248320):
        logits = rng.standard_normal(v).astype(np.float32) * 4
        assert s.sample(logits)[0] == int(np.argmax(logits))


def test_tiny_temperature_is_greedy():
    logits = np.random.default_rng(11).standard_normal(1000).astype(np.float32)
    logits[[5, 700]] = logits.max() + 1  # a tie: a division by ~0 must not turn it into NaN
    for t in (1e-30, 1e-7):
        assert make_sampler(temperature=t, seed=3, top_p=0.9).sample(logits)[0] == 5


def test_argmax_ties_pick_lowest_id():
    logits = np.zeros(100, np.float32)
    logits[[17, 42, 99]] = 3.0
    assert make_sampler().sample(logits)[0] == 17  # np.argmax agrees: first occurrence
    assert int(np.argmax(logits)) == 17


def test_greedy_ignores_seed_and_truncation():
    logits = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    picks = {make_sampler(seed=s, top_k=3, top_p=0.5, min_p=0.3).sample(logits)[0] for s in range(5)}
    assert picks == {int(np.argmax(logits))}


# ---------------------------------------------------------------------------- reproducibility


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = np.random.default_rng(2).standard_normal(2000).astype(np.float32)
    kw = dict(temperature=1.0, top_p=0.95)
    a = draw_many(make_sampler(seed=1234, **kw), logits, 200)
    b = draw_many(make_sampler(seed=1234, **kw), logits, 200)
    c = draw_many(make_sampler(seed=1235, **kw), logits, 200)
    np.testing.assert_array_equal(a, b)
    assert (a != c).sum() > 150  # nearly flat over ~1800 tokens: independent streams rarely agree


# ------------------------------------------------------------------------------- distributions


def test_plain_temperature_matches_softmax():
    logits = np.random.default_rng(3).standard_normal(12).astype(np.float32) * 1.5
    for t in (0.5, 1.0, 2.0):
        ids, probs = ref_allowed(logits, t)
        draws = draw_many(make_sampler(temperature=t, seed=11), logits, 20000)
        assert_matches_distribution(draws, ids, probs)


def test_wrong_temperature_is_detected():
    # The statistical check must be able to fail: draws at T=1 against a T=0.7 reference.
    logits = np.random.default_rng(3).standard_normal(12).astype(np.float32) * 1.5
    draws = draw_many(make_sampler(temperature=1.0, seed=11), logits, 20000)
    ids, probs = ref_allowed(logits, 0.7)
    with pytest.raises(AssertionError, match="chi2"):
        assert_matches_distribution(draws, ids, probs)


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=7),
        dict(top_p=0.6),
        dict(min_p=0.2),
        dict(top_k=40, top_p=0.9, min_p=0.05),
        dict(top_k=2000),  # above the heap limit: nth_element path
    ],
)
def test_truncation_sets_and_distribution(kw):
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal(5000) * 2.5).astype(np.float32)
    t = 0.8
    ids, probs = ref_allowed(logits, t, **kw)
    assert 1 < len(ids) < 5000
    draws = draw_many(make_sampler(temperature=t, seed=5, **kw), logits, 6000)
    assert_matches_distribution(draws, ids, probs)
    if len(ids) <= 60:
        # Small sets are covered completely: the sampler is not stricter than the reference.
        assert set(np.unique(draws).tolist()) == set(ids.tolist())


def test_top_p_over_full_vocab_cut_far_below_the_head():
    # 10 likely tokens and 248K unlikely ones whose total mass dominates: the top-p prefix
    # reaches deep into the tail, where the bucketed cut must still be exact.
    rng = np.random.default_rng(6)
    v = 248320
    logits = (-10.0 + 0.5 * rng.standard_normal(v)).astype(np.float32)
    logits[rng.choice(v, 10, replace=False)] = 0.0
    ids, probs = ref_allowed(logits, 1.0, top_p=0.6)
    assert 10 < len(ids) < v
    draws = draw_many(make_sampler(temperature=1.0, top_p=0.6, seed=9), logits, 2000)
    assert set(draws.tolist()) <= set(ids.tolist())
    # Mass on the 10 head tokens (ids[:10] are the ties at 0, lowest ids first).
    head = probs[:10].sum()
    frac = np.isin(draws, ids[:10]).mean()
    assert abs(frac - head) < 5 * np.sqrt(head * (1 - head) / len(draws))


def test_top_k_boundary_ties_keep_lowest_ids():
    logits = np.zeros(50, np.float32)
    logits[[3, 9, 20, 30, 40]] = 1.0
    draws = draw_many(make_sampler(temperature=1.0, top_k=3, seed=0), logits, 3000)
    assert set(draws.tolist()) == {3, 9, 20}


# ----------------------------------------------------------------------------------- penalties


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8),
        dict(presence_penalty=0.7),
        dict(frequency_penalty=0.4),
        dict(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.25),
    ],
)
def test_penalties_match_reference(kw):
    rng = np.random.default_rng(7)
    v = 64
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    window = rng.integers(0, v, 40).astype(np.int32)  # repeats count for frequency
    s = make_sampler(top_logprobs=v, **kw)
    token, logprob, top = s.sample(logits, window)
    ref = ref_log_softmax(
        ref_penalize(
            logits,
            window,
            kw.get("repetition_penalty", 1.0),
            kw.get("presence_penalty", 0.0),
            kw.get("frequency_penalty", 0.0),
        )
    )
    got = np.full(v, np.nan)
    for tid, lp in top:
        got[tid] = lp
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)
    assert token == int(np.argmax(ref))
    assert abs(logprob - ref[token]) < 2e-5
    # The penalties changed something (so the comparison above is not vacuous).
    assert np.abs(ref - ref_log_softmax(logits)).max() > 0.05


def test_penalties_leave_caller_array_and_unlisted_tokens_alone():
    logits = np.array([5.0, 4.9, 1.0, -1.0], np.float32)
    before = logits.copy()
    s = make_sampler(repetition_penalty=2.0)
    assert s.sample(logits, np.array([0, 0, 0], np.int32))[0] == 1  # 5/2 < 4.9
    np.testing.assert_array_equal(logits, before)
    assert make_sampler(repetition_penalty=2.0).sample(logits, np.array([3], np.int32))[0] == 0


# ------------------------------------------------------------------------------------ logprobs


def test_logprobs_are_untempered_and_top_sorted():
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal(300) * 2).astype(np.float32)
    ref = ref_log_softmax(logits)
    s = make_sampler(temperature=2.0, top_k=50, seed=3, top_logprobs=5)
    for _ in range(20):
        token, logprob, top = s.sample(logits)
        assert abs(logprob - ref[token]) < 1e-5
        order = np.lexsort((np.arange(300), -ref))[:5]
        assert [t for t, _ in top] == order.tolist()
        np.testing.assert_allclose([lp for _, lp in top], ref[order], atol=1e-5)


def test_logprobs_on_full_vocab():
    logits = (np.random.default_rng(9).standard_normal(248320) * 3).astype(np.float32)
    token, logprob, top = make_sampler(top_logprobs=3).sample(logits)
    ref = ref_log_softmax(logits)
    assert token == int(np.argmax(logits))
    assert abs(logprob - ref[token]) < 1e-5
    assert [t for t, _ in top] == np.argsort(-ref, kind="stable")[:3].tolist()


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", float("inf")),
        ("frequency_penalty", float("nan")),
        ("top_logprobs", -1),
        ("top_logprobs", 5000),
    ],
)
def test_bad_params_raise_naming_the_parameter(name, value):
    params = SamplingParams(**{name: value})
    with pytest.raises(lily.RequestError, match=name):
        params.validate()
    with pytest.raises(lily.RequestError, match=name):
        Sampler(params)


def test_bad_inputs_raise():
    s = make_sampler(repetition_penalty=1.1)
    logits = np.zeros(10, np.float32)
    with pytest.raises(lily.RequestError, match="penalty token 10"):
        s.sample(logits, np.array([1, 10], np.int32))
    with pytest.raises(lily.RequestError, match="penalty token -3"):
        s.sample(logits, np.array([-3], np.int32))
    bad = logits.copy()
    bad[4] = np.nan
    with pytest.raises(lily.LilyError, match="token 4"):
        make_sampler().sample(bad)
    with pytest.raises(lily.LilyError, match="-inf"):
        make_sampler().sample(np.full(5, -np.inf, np.float32))
    with pytest.raises(lily.RequestError, match="logits"):
        make_sampler().sample(np.zeros(0, np.float32))


def test_masked_logits_never_sampled():
    logits = np.random.default_rng(10).standard_normal(100).astype(np.float32)
    logits[::2] = -np.inf
    draws = draw_many(make_sampler(temperature=1.5, seed=2), logits, 2000)
    assert (draws % 2 == 1).all()


# ------------------------------------------------------------------------ the token mask (issue 22, item 9)
# A sampled id the tokenizer cannot decode (the embedding's padding rows: 248,320 rows for
# 248,077 tokens) ended a completion with a 500. Every sampler takes a per-request token mask:
# a limit (ids below it) and an optional per-step bitmask (structured output).


def _bits(allowed: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.zeros((vocab + 31) // 32, np.uint32)
    for i in np.flatnonzero(allowed):
        bits[i // 32] |= np.uint32(1) << np.uint32(i % 32)
    return bits


def test_token_limit_keeps_padding_rows_out():
    """The padding rows hold the largest logits; greedy, draws and top logprobs stay below the limit."""
    rng = np.random.default_rng(22)
    logits = rng.standard_normal(300).astype(np.float32)
    logits[250:] += 20.0  # what an untrained padding row can look like
    greedy = Sampler(SamplingParams(top_logprobs=5), token_limit=250)
    tok, lp, top = greedy.sample(logits)
    assert tok == int(np.argmax(logits[:250]))
    assert [t for t, _ in top] == list(np.argsort(-logits[:250], kind="stable")[:5])
    assert lp == pytest.approx(ref_log_softmax(logits[:250])[tok], abs=1e-5)
    for kw in ({}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}):
        s = Sampler(SamplingParams(temperature=1.0, seed=4, **kw), token_limit=250)
        ids, probs = ref_allowed(logits[:250], 1.0, **kw)
        assert_matches_distribution(draw_many(s, logits, 3000), ids, probs)
    assert Sampler(SamplingParams(), token_limit=250).token_limit == 250
    assert Sampler(SamplingParams(), token_limit=1000).sample(logits)[0] == int(np.argmax(logits))  # past the row


def test_allowed_tokens_bitmask():
    rng = np.random.default_rng(23)
    logits = rng.standard_normal(200).astype(np.float32)
    allowed = rng.random(200) < 0.1
    allowed[150:] = False
    s = Sampler(SamplingParams(temperature=0.8, seed=1, top_logprobs=40))
    s.set_allowed_tokens(_bits(allowed, 150))  # words for 150 ids: ids past them are out as well
    masked = np.where(allowed, logits, -np.inf)
    ids, probs = ref_allowed(masked[np.flatnonzero(allowed)], 0.8)
    draws = draw_many(s, logits, 3000)
    assert_matches_distribution(draws, np.flatnonzero(allowed)[ids], probs)
    tok, lp, top = s.sample(logits)
    assert lp == pytest.approx(ref_log_softmax(logits[allowed])[list(np.flatnonzero(allowed)).index(tok)], abs=1e-5)
    assert sorted(t for t, _ in top) == sorted(np.flatnonzero(allowed).tolist())  # no masked alternative
    greedy = Sampler(SamplingParams())
    greedy.set_allowed_tokens(_bits(allowed, 200))
    assert greedy.sample(logits)[0] == int(np.flatnonzero(allowed)[np.argmax(logits[allowed])])
    greedy.set_allowed_tokens(None)
    assert greedy.sample(logits)[0] == int(np.argmax(logits))
    greedy.set_allowed_tokens(np.zeros(7, np.uint32))
    with pytest.raises(lily.RequestError, match="allows no token"):
        greedy.sample(logits)
    with pytest.raises(lily.RequestError, match="token limit"):
        Sampler(SamplingParams(), token_limit=-1)


def test_token_mask_property():
    """Property: for any logits, limit, bitmask and sampling parameters, the chosen token is
    inside the mask, and greedy picks NumPy's argmax over the allowed ids (lowest id on ties)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None)
    @given(vocab=st.integers(1, 400), seed=st.integers(0, 2**32), limit=st.integers(0, 450),
           density=st.floats(0.0, 1.0), use_bits=st.booleans(), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
           top_k=st.integers(0, 50), top_p=st.sampled_from([1.0, 0.9, 0.3]), min_p=st.sampled_from([0.0, 0.1]))
    def check(vocab, seed, limit, density, use_bits, temperature, top_k, top_p, min_p):
        rng = np.random.default_rng(seed)
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        logits[rng.random(vocab) < 0.05] = -np.inf
        allowed = np.ones(vocab, bool)
        if limit:
            allowed[limit:] = False
        s = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
                    token_limit=limit)
        if use_bits:
            bitmask = rng.random(vocab) < density
            s.set_allowed_tokens(_bits(bitmask, vocab))
            allowed &= bitmask
        finite = allowed & np.isfinite(logits)
        if not finite.any():
            with pytest.raises(lily.LilyError):
                s.sample(logits)
            return
        tok = s.sample(logits)[0]
        assert allowed[tok] and np.isfinite(logits[tok])
        if temperature == 0.0:
            best = np.flatnonzero(finite)[np.argmax(logits[finite])]
            assert tok == best

    check()
