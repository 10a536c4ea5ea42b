"""`lily eval`: teacher-forced comparison of lily against a reference implementation.

The same token ids go through lily and the reference, each teacher-forced from an empty state;
at each of N positions both predict the next token. Reported: each side's perplexity on the
actual next tokens, top-1 agreement (how often the argmaxes match), the mean KL divergence
KL(reference || lily), and the largest logit difference. References: ``mlx-lm`` (also ``mlx``:
mlx-lm loading the same checkpoint or ``reference_model``) or ``lily:BACKEND`` (another lily
backend).

Compute dtype: lily computes in float32. mlx-lm computes in the checkpoint's dtype (bfloat16
for the published MLX checkpoints), whose rounding flips the argmax wherever the top two
logits are close: on the demo model (lily in its f32 mode) 93.8% top-1 agreement against mlx-lm in
bfloat16, 100% against the same mlx-lm in float32. So the reference runs in float32 by default
(``reference_dtype="float32"``: mlx-lm's floating-point parameters cast to float32, the
quantized weights untouched); ``"native"`` keeps the checkpoint's dtype. The report names the
dtype the reference computed in.

Text: the given text, else a built-in passage, tokenized with the model's tokenizer and
repeated to reach N + 1 tokens; a checkpoint without a tokenizer gets seeded pseudo-random ids.
"""

from __future__ import annotations

import sys
from typing import TextIO

import numpy as np

PASSAGE = (
    "The Python standard library is very extensive, offering a wide range of facilities. The library "
    "contains built-in modules, written in C, that provide access to system functionality such as file "
    "I/O that would otherwise be inaccessible to Python programmers, as well as modules written in Python "
    "that provide standardized solutions for many problems that occur in everyday programming. A list is "
    "a mutable sequence, typically used to store collections of homogeneous items. Tuples are immutable "
    "sequences. A dictionary maps hashable values to arbitrary objects; it is a mutable object. "
)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _token_ids(model, positions: int, text: str | None) -> np.ndarray:
    need = positions + 1
    if model.tokenizer is None:
        return np.random.default_rng(0).integers(0, model.config.vocab_size, size=need, dtype=np.int32)
    ids = model.tokenizer.encode(text or PASSAGE)
    if not ids:
        raise ValueError("[eval] the text has no tokens")
    reps = -(-need // len(ids))
    return np.asarray((ids * reps)[:need], dtype=np.int32)


REFERENCES = ("mlx-lm", "mlx", "lily:BACKEND")


def _reference_logits(reference: str, path, ids: np.ndarray, dtype: str) -> tuple[str, str, np.ndarray]:
    """(name, compute dtype, logits [T, vocab] float32) of the reference on ``ids``."""
    if reference in ("mlx", "mlx-lm"):
        try:
            import mlx.core as mx
            from mlx_lm import load
        except ImportError as e:
            raise ValueError(f"[eval] the mlx-lm reference needs mlx and mlx-lm, which are not installed "
                             f"({e}); pip install mlx-lm (Linux: mlx[cpu]), or use --reference lily:cpu") from None
        ref_model, _ = load(str(path))
        if dtype == "float32":
            ref_model.set_dtype(mx.float32)  # floating-point parameters only: packed weights stay
        out = ref_model(mx.array(ids)[None])
        return "mlx-lm", str(out.dtype).removeprefix("mlx.core."), np.array(out[0].astype(mx.float32))
    if reference.startswith("lily:"):
        import lily

        other = lily.Model.load(path, backend=reference.split(":", 1)[1])
        return f"lily ({other._engine.backend})", "float32", other.logits(ids)
    raise ValueError(f"[eval] unknown reference {reference!r}: use {', '.join(REFERENCES)}")


def evaluate(model, *, reference: str = "mlx-lm", positions: int = 256, text: str | None = None,
             reference_model=None, reference_dtype: str = "float32") -> dict:
    if reference_dtype not in ("float32", "native"):
        raise ValueError(f"[eval] reference_dtype must be 'float32' or 'native', not {reference_dtype!r}")
    if positions < 1:
        raise ValueError("[eval] positions must be at least 1")
    if positions + 1 > model.max_context:
        raise ValueError(f"[eval] {positions} positions exceed the context ({model.max_context})")
    ids = _token_ids(model, positions, text)
    inputs, targets = ids[:-1], ids[1:]
    ours = model.logits(inputs)
    ref_name, ref_dtype, theirs = _reference_logits(reference, reference_model or model.path, inputs,
                                                    reference_dtype)
    if theirs.shape != ours.shape:
        raise ValueError(f"[eval] reference logits have shape {theirs.shape}, lily's {ours.shape}")
    lp_ours, lp_ref = _log_softmax(ours), _log_softmax(theirs)
    rows = np.arange(len(targets))
    nll_ours = -lp_ours[rows, targets]
    nll_ref = -lp_ref[rows, targets]
    kl = (np.exp(lp_ref) * (lp_ref - lp_ours)).sum(axis=-1)
    return {
        "model": str(model.path), "backend": model._engine.backend, "reference": ref_name,
        "reference_dtype": ref_dtype, "positions": int(len(targets)),
        "perplexity": float(np.exp(nll_ours.mean())), "reference_perplexity": float(np.exp(nll_ref.mean())),
        "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
        "mean_kl": float(kl.mean()), "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
    }


def print_report(r: dict, file: TextIO | None = None) -> None:
    out = file or sys.stdout
    print(f"lily eval - {r['model']} ({r['backend']}) vs {r['reference']} ({r['reference_dtype']}), "
          f"{r['positions']} positions", file=out)
    print(f"  perplexity        lily {r['perplexity']:.4f}   reference {r['reference_perplexity']:.4f}", file=out)
    print(f"  top-1 agreement   {100 * r['top1_agreement']:.2f} %", file=out)
    print(f"  mean KL(ref||lily) {r['mean_kl']:.3e}   max |logit diff| {r['max_abs_logit_diff']:.3e}", file=out)
