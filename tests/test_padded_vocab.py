"""An embedding with more rows than the tokenizer has tokens (issue 22, item 9).

Qwen3.5/3.6 have 248,320 embedding rows for 248,077 tokens; a random-weight model with the real
vocabulary sampled a padding id (248262) and the completion failed with a 500 mid-generation
("token id 248262 is outside the vocabulary"). Here: a tiny random-weight qwen3_5 checkpoint with
4,160 rows under the demo tokenizer's 4,096 tokens, whose padding rows of the LM head are scaled
up so that, unmasked, they win most steps. Every sampler must keep to the tokenizer's ids:
- CPU backend, greedy: equal to transformers' greedy with the padding ids suppressed
  (suppress_tokens), checked for near ties first;
- MSL-on-CPU backend (the Metal kernels, tokens chosen on the device), greedy: equal to mlx-lm's
  argmax over the tokenizer's ids on the 4-bit conversion of the same weights, and to the CPU
  backend on that checkpoint; sampled: equal to the CPU backend's draws with the same seed;
- sampled on both: no id past the tokenizer, and the text decodes.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from fixtures import cases
from fixtures import references as ref
from fixtures.store import mc

TOKENS = 4096  # the demo tokenizer
ROWS = TOKENS + 64
PROMPT = [int(x) for x in np.random.default_rng(22).integers(0, TOKENS, 9)]
STEPS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, lily):
    """(HF fp32 folder, MLX 4-bit folder), both with the demo tokenizer."""
    import torch

    root = tmp_path_factory.mktemp("padded")
    model = mc.build_model("qwen3_5", "tiny", vocab_size=ROWS, seed=5)
    with torch.no_grad():
        model.lm_head.weight[TOKENS:] *= 40.0  # untrained padding rows that dominate the logits
    _, interval = mc.build_config("qwen3_5", "tiny", None, ROWS)
    hf = mc.save_checkpoint(model, root / "hf", "qwen3_5", interval)
    mlx = mc.quantize_checkpoint(hf, root / "mlx", 4, 64)
    demo = __import__("pathlib").Path(lily.__file__).resolve().parent / "demo"
    for d in (hf, mlx):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / name, d / name)
    return hf, mlx


def _masked_margins_ok(logits: np.ndarray, tol: float) -> None:
    m = ref.top1_margins(logits[:, :TOKENS])
    need = cases.MARGIN_FACTOR * tol * float(np.max(np.abs(logits[:, :TOKENS])))
    assert (m >= need).all(), f"reference near tie at step {int(np.argmin(m))}: change the seed"


def _hf_greedy_masked(path) -> list[int]:
    import torch

    model = ref.hf_load(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0,
                             suppress_tokens=list(range(TOKENS, ROWS)), return_dict_in_generate=True,
                             output_logits=True)
    steps = torch.stack([x[0] for x in out.logits]).float().numpy()
    _masked_margins_ok(steps, cases.TOL_FP32)
    assert (steps[:, TOKENS:].max(axis=1) > steps[:, :TOKENS].max(axis=1)).mean() > 0.5, \
        "the padding rows should win most steps unmasked (else this test proves little)"
    return out.sequences[0, len(PROMPT):].tolist()


def _mlx_greedy_masked(path) -> list[int]:
    model = ref.mlx_load(path)
    ids, rows = list(PROMPT), []
    for _ in range(STEPS):
        logits = ref.mlx_logits(model, ids)[-1]
        rows.append(logits)
        ids.append(int(np.argmax(logits[:TOKENS])))
    _masked_margins_ok(np.stack(rows), cases.TOL_MLX)
    return ids[len(PROMPT):]


def _check_sampled(model, seeds=range(4)) -> list[list[int]]:
    out = []
    for seed in seeds:
        r = model.generate(PROMPT, max_tokens=STEPS, temperature=1.0, seed=seed)
        assert max(r.tokens) < TOKENS, f"seed {seed}: sampled a padding id {max(r.tokens)}"
        assert r.text == model.tokenizer.decode(r.tokens, skip_special_tokens=True)
        out.append(r.tokens)
    return out


def test_cpu_never_chooses_padding_ids(checkpoints, lily):
    hf, _ = checkpoints
    model = lily.Model.load(hf, backend="cpu")
    assert model.config.vocab_size == ROWS and model.tokenizer.vocab_size == TOKENS
    got = model.generate(PROMPT, max_tokens=STEPS, temperature=0)
    assert got.tokens == _hf_greedy_masked(hf)
    _check_sampled(model, range(8))
    for kw in (dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05)):
        r = model.generate(PROMPT, max_tokens=STEPS, temperature=0.9, seed=3, **kw)
        assert max(r.tokens) < TOKENS


def test_msl_cpu_device_loop_never_chooses_padding_ids(checkpoints, lily, monkeypatch):
    _, mlx = checkpoints
    gpu = lily.Model.load(mlx, backend="msl-cpu", backend_options=cases.F32_KV, max_batch=1)  # one generation
    cpu = lily.Model.load(mlx, backend="cpu", cpu_matmul="f32")  # the reference mode: equal to the GPU kernels
    loops = []
    device_loop = lily.Session.device_loop

    def spy(self, *args):
        loop = device_loop(self, *args)
        loops.append(loop is not None)
        return loop

    monkeypatch.setattr(lily.Session, "device_loop", spy)
    want = _mlx_greedy_masked(mlx)
    assert gpu.generate(PROMPT, max_tokens=STEPS, temperature=0).tokens == want
    assert loops == [True], "the GPU backend should choose its tokens on the device"
    assert cpu.generate(PROMPT, max_tokens=STEPS, temperature=0).tokens == want
    assert _check_sampled(gpu, range(3)) == _check_sampled(cpu, range(3))
