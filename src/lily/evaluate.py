"""`lily eval`: teacher-forced comparison of lily against a reference implementation.

The same token ids go through lily and the reference, each teacher-forced from an empty state;
at each of N positions both predict the next token. Reported: each side's perplexity on the
actual next tokens, top-1 agreement (how often the argmaxes match), the mean KL divergence
KL(reference || lily), and the largest logit difference. References: ``mlx`` (mlx-lm, loading
the same checkpoint or ``reference_model``) or ``lily:BACKEND`` (another lily backend).

Text: the given text, else a built-in passage, tokenized with the model's tokenizer and
repeated to reach N + 1 tokens; a checkpoint without a tokenizer gets seeded pseudo-random ids.
"""

from __future__ import annotations

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


def _reference_logits(reference: str, path, ids: np.ndarray, model) -> tuple[str, np.ndarray]:
    if reference == "mlx":
        import mlx.core as mx
        from mlx_lm import load

        ref_model, _ = load(str(path))
        out = ref_model(mx.array(ids)[None])
        return "mlx-lm", np.array(out[0].astype(mx.float32))
    if reference.startswith("lily:"):
        import lily

        other = lily.Model.load(path, backend=reference.split(":", 1)[1])
        return f"lily ({other._engine.backend})", other.logits(ids)
    raise ValueError(f"[eval] unknown reference {reference!r}: use mlx or lily:BACKEND")


def evaluate(model, *, reference: str = "mlx", positions: int = 256, text: str | None = None,
             reference_model=None) -> dict:
    if positions < 1:
        raise ValueError("[eval] positions must be at least 1")
    if positions + 1 > model.max_context:
        raise ValueError(f"[eval] {positions} positions exceed the context ({model.max_context})")
    ids = _token_ids(model, positions, text)
    inputs, targets = ids[:-1], ids[1:]
    ours = model.logits(inputs)
    ref_name, theirs = _reference_logits(reference, reference_model or model.path, inputs, model)
    if theirs.shape != ours.shape:
        raise ValueError(f"[eval] reference logits have shape {theirs.shape}, lily's {ours.shape}")
    lp_ours, lp_ref = _log_softmax(ours), _log_softmax(theirs)
    rows = np.arange(len(targets))
    nll_ours = -lp_ours[rows, targets]
    nll_ref = -lp_ref[rows, targets]
    kl = (np.exp(lp_ref) * (lp_ref - lp_ours)).sum(axis=-1)
    return {
        "model": str(model.path), "backend": model._engine.backend, "reference": ref_name,
        "positions": int(len(targets)),
        "perplexity": float(np.exp(nll_ours.mean())), "reference_perplexity": float(np.exp(nll_ref.mean())),
        "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
        "mean_kl": float(kl.mean()), "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
    }


def print_report(r: dict) -> None:
    print(f"lily eval - {r['model']} ({r['backend']}) vs {r['reference']}, {r['positions']} positions")
    print(f"  perplexity        lily {r['perplexity']:.4f}   reference {r['reference_perplexity']:.4f}")
    print(f"  top-1 agreement   {100 * r['top1_agreement']:.2f} %")
    print(f"  mean KL(ref||lily) {r['mean_kl']:.3e}   max |logit diff| {r['max_abs_logit_diff']:.3e}")
