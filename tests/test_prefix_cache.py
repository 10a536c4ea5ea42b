"""lily.prefix_cache on the demo model: reuse, rewind to snapshots, LRU eviction under a budget.

Reference: teacher-forced logits of the whole sequence from a fresh state (model.logits).
"""

from __future__ import annotations

import numpy as np
import pytest

import lily
from lily.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def model():
    return lily.Model.load()


def _fill(seq: lily.Session, ids: list[int], reused: int) -> np.ndarray:
    out = seq.prefill(np.asarray(ids[reused:], dtype=np.int32))
    seq.take_snapshot()
    return out


def test_extend_and_branch_equal_fresh_logits(model):
    cache = PrefixCache(model, 1 << 30)
    a = list(range(100, 140))
    seq, reused = cache.acquire(a)
    assert reused == 0
    _fill(seq, a, reused)
    cache.release(seq)

    longer = a + list(range(300, 320))  # extends everything processed: all of a reused
    seq, reused = cache.acquire(longer)
    assert reused == len(a)
    np.testing.assert_allclose(_fill(seq, longer, reused), model.logits(longer)[-1], rtol=1e-4, atol=1e-4)
    cache.release(seq)

    branch = a + list(range(500, 510))  # differs after a: back to the snapshot at len(a)
    seq, reused = cache.acquire(branch)
    assert reused == len(a) and seq.position == len(a)
    np.testing.assert_allclose(_fill(seq, branch, reused), model.logits(branch)[-1], rtol=1e-4, atol=1e-4)
    cache.release(seq)

    inside = a[:20] + [7, 8, 9]  # differs before any snapshot: nothing reusable
    seq, reused = cache.acquire(inside)
    assert reused == 0
    assert cache.hits == 2 and cache.misses == 2


def test_lru_eviction_keeps_the_budget(model):
    probe = model.session()
    probe.prefill(np.arange(10, 50, dtype=np.int32))
    probe.take_snapshot()
    one = probe.nbytes
    cache = PrefixCache(model, int(2.5 * one))
    prompts = [[i] + list(range(10, 49)) for i in (1, 2, 3)]
    for p in prompts:
        seq, _ = cache.acquire(p)
        _fill(seq, p, 0)
        cache.release(seq)
        assert cache.nbytes <= cache.budget_bytes
    assert len(cache) == 2 and cache.evictions == 1
    # the oldest went, the newest two stay
    assert cache.acquire(prompts[0] + [5])[1] == 0
    assert cache.acquire(prompts[2] + [5])[1] == len(prompts[2])
    off = PrefixCache(model, 0)  # budget 0: no caching at all
    seq, _ = off.acquire(prompts[0])
    _fill(seq, prompts[0], 0)
    off.release(seq)
    assert len(off) == 0 and off.acquire(prompts[0] + [5])[1] == 0
