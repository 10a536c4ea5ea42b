"""lily's CPU forward pass against Hugging Face transformers (fp32), on tiny random-weight
checkpoints of every supported architecture and checkpoint layout.

Each case checks one path through the engine against transformers' logits for the same tokens:
  (a) a whole prompt prefilled at once (`model.logits`),
  (b) a prefill followed by token-by-token `session.decode` continuing the same state,
  (c) a prompt longer than several prefill chunks (`prefill_chunk=16`, 70 tokens), then decode,
  (d) greedy `model.generate` against transformers' greedy `generate` (its cached decode path).
Metric and tolerance: rel_err = max|a-b| / max|b| <= TOL_FP32 (1e-4); see fixtures/cases.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fixtures import cases
from fixtures.references import rel_err

CASES = [pytest.param(c, id=cases.case_id(c)) for c in cases.HF_CASES]
TOL = cases.TOL_FP32


def _assert_close(got, want, what):
    got = np.asarray(got)
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}, expected float32"
    err = rel_err(got, want)
    assert err <= TOL, f"{what}: rel err {err:.3e} > {TOL:.0e}"


@pytest.fixture(params=CASES)
def case(request, store):
    path = store.hf(*request.param)
    return path, store.hf_reference(path)


def test_config(case, lily):
    path, _ = case
    model = lily.Model.load(path, cpu_matmul="f32")
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw)
    cfg = model.config
    assert cfg.model_type == raw["model_type"]
    assert cfg.hidden_size == text["hidden_size"]
    assert cfg.num_hidden_layers == text["num_hidden_layers"]
    assert list(cfg.layer_types) == text["layer_types"]
    assert cfg.vocab_size == text["vocab_size"]


def test_prefill_logits(case, lily):
    path, ref = case
    model = lily.Model.load(path, cpu_matmul="f32")
    logits = model.logits(cases.PROMPT)
    assert logits.shape == ref.prompt.shape
    _assert_close(logits, ref.prompt, "logits(prompt)")


def test_prefill_then_decode(case, lily):
    path, ref = case
    model = lily.Model.load(path, cpu_matmul="f32")
    s = model.session()
    n = cases.DECODE_SPLIT
    last = s.prefill(cases.PROMPT[:n])
    assert np.asarray(last).shape == (ref.prompt.shape[1],)
    _assert_close(last, ref.prompt[n - 1], "prefill last logits")
    assert s.position == n
    for i in range(n, len(cases.PROMPT)):
        _assert_close(s.decode(cases.PROMPT[i]), ref.prompt[i], f"decode at position {i}")
    assert s.position == len(cases.PROMPT)


def test_prefill_all_logits(case, lily):
    path, ref = case
    model = lily.Model.load(path, cpu_matmul="f32")
    s = model.session()
    n = cases.DECODE_SPLIT
    # Two prefills back to back: the second continues the state of the first.
    a = s.prefill(cases.PROMPT[:5], all_logits=True)
    b = s.prefill(cases.PROMPT[5:n], all_logits=True)
    assert np.asarray(a).shape == (5, ref.prompt.shape[1])
    _assert_close(np.concatenate([a, b]), ref.prompt[:n], "prefill(all_logits) in two calls")


def test_long_prompt_chunked(case, lily):
    path, ref = case
    model = lily.Model.load(path, prefill_chunk=cases.PREFILL_CHUNK, cpu_matmul="f32")
    _assert_close(model.logits(cases.LONG_PROMPT), ref.long,
                  f"logits of {len(cases.LONG_PROMPT)} tokens in chunks of {cases.PREFILL_CHUNK}")
    s = model.session()
    k = len(cases.LONG_PROMPT) - cases.LONG_DECODE
    _assert_close(s.prefill(cases.LONG_PROMPT[:k]), ref.long[k - 1], "chunked prefill")
    for i in range(k, len(cases.LONG_PROMPT)):
        _assert_close(s.decode(cases.LONG_PROMPT[i]), ref.long[i],
                      f"decode after chunked prefill, position {i}")


def test_generate_greedy(case, lily):
    path, ref = case
    cases.assert_greedy_matches(lily.Model.load(path, cpu_matmul="f32"), ref.gen_tokens)
