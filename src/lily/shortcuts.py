"""mlx-lm-style functions: ``load``, ``generate``, ``stream_generate``.

For users coming from mlx-lm, whose habits are::

    from lily import load, generate, stream_generate
    model, tokenizer = load("mlx-community/Qwen3.6-35B-A3B-4bit")
    text = generate(model, tokenizer, prompt="Hello", max_tokens=64, verbose=True)
    for chunk in stream_generate(model, tokenizer, "Hello", max_tokens=64):
        print(chunk.text, end="")

They are thin wrappers over :meth:`lily.Model.load` and :meth:`lily.Model.generate` (one
generation flow). Sampling is given by name (``temperature=``, ``top_p=``, ...), not as
mlx-lm's ``sampler`` / ``logits_processors`` callables.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lily._core import RequestError
from lily.generation import GenerationChunk
from lily.model import Model
from lily.tokenizer import Tokenizer

# mlx-lm arguments with no lily counterpart, and what to use instead.
_MLX_LM_ONLY = {
    "sampler": "pass temperature=, top_p=, top_k=, min_p= (and seed=) directly",
    "logits_processors": "pass repetition_penalty=, presence_penalty= or frequency_penalty= directly",
    "draft_model": "speculative decoding is not implemented",
    "prompt_cache": "use model.chat() (a conversation keeps its state between turns)",
    "kv_bits": "KV cache quantization is not implemented",
}

Prompt = str | Sequence[int] | Sequence[dict] | np.ndarray


def load(path_or_hf_repo: str | os.PathLike | None = None, **options: Any) -> tuple[Model, Tokenizer | None]:
    """``(model, tokenizer)`` as mlx-lm's ``load`` returns them: :meth:`lily.Model.load` with
    the same ``options`` (``revision``, ``backend``, ``threads``, ...), and its tokenizer."""
    model = Model.load(path_or_hf_repo, **options)
    return model, model.tokenizer


def _check(model: Model, tokenizer: Tokenizer | None, kwargs: dict[str, Any]) -> None:
    if not isinstance(model, Model):
        raise RequestError(f"[generate] model must be a lily.Model (from lily.load), got {type(model).__name__}")
    if tokenizer is not None and tokenizer is not model.tokenizer:
        raise RequestError("[generate] tokenizer must be the model's own (the second value lily.load returns)")
    for name in kwargs:
        if name in _MLX_LM_ONLY:
            raise RequestError(f"[generate] lily does not take mlx-lm's {name!r}: {_MLX_LM_ONLY[name]}")


def stream_generate(model: Model, tokenizer: Tokenizer | None, prompt: Prompt, max_tokens: int = 256,
                    **kwargs: Any) -> Iterator[GenerationChunk]:
    """Yields a :class:`lily.GenerationChunk` per step (``.text``, ``.token``, and
    ``.finish_reason`` on the last). ``kwargs`` are :meth:`lily.Model.generate`'s."""
    _check(model, tokenizer, kwargs)
    with model.generate(prompt, max_tokens=max_tokens, stream=True, **kwargs) as stream:
        yield from stream


def generate(model: Model, tokenizer: Tokenizer | None, prompt: Prompt, verbose: bool = False,
             **kwargs: Any) -> str:
    """The generated text. ``verbose=True`` prints it as it is generated, then token counts
    and speeds. ``kwargs`` are :meth:`lily.Model.generate`'s (``max_tokens`` defaults to 256)."""
    _check(model, tokenizer, kwargs)
    kwargs.setdefault("max_tokens", 256)
    with model.generate(prompt, stream=True, **kwargs) as stream:
        for chunk in stream:
            if verbose:
                print(chunk.text, end="", flush=True)
    result = stream.result
    assert result is not None
    if verbose:
        print()
        print(f"Prompt: {result.prompt_tokens} tokens, {result.prefill_tokens_per_s:.3f} tokens-per-sec\n"
              f"Generation: {result.completion_tokens} tokens, {result.decode_tokens_per_s:.3f} tokens-per-sec",
              file=sys.stdout)
    return result.text
