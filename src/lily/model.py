"""The model object: load a checkpoint, run prefill/decode, generate."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lily import _core
from lily._core import ConfigError, RequestError
from lily.checkpoint import load_weights
from lily.config import ModelConfig, load_config

BACKENDS = ("cpu",)


def _token_array(tokens: Sequence[int] | np.ndarray, what: str = "token_ids") -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise RequestError(f"[{what}] expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise RequestError(f"[{what}] token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise RequestError(f"[{what}] token id out of range")
    return np.ascontiguousarray(arr, dtype=np.int32)


class Session:
    """One sequence's state (KV cache, DeltaNet and conv state) on a model.

    ``prefill`` appends tokens and returns logits; ``decode`` appends one token. Sessions of one
    model share its weights and engine; calls are serialised by the model's lock.
    """

    def __init__(self, model: Model, max_context: int | None = None):
        self._model = model
        self._state = model._engine.new_state(max_context or model.max_context)

    @property
    def position(self) -> int:
        """Tokens processed so far."""
        return self._state.position

    @property
    def max_context(self) -> int:
        return self._state.max_context

    def prefill(self, token_ids: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Appends ``token_ids``; returns logits [vocab] of the last (or [T, vocab] of every) token."""
        ids = _token_array(token_ids)
        if ids.size == 0:
            raise RequestError("[prefill] no tokens given")
        with self._model._lock:
            return self._model._engine.prefill(self._state, ids, all_logits)

    def decode(self, token_id: int) -> np.ndarray:
        """Appends one token; returns its logits [vocab]."""
        with self._model._lock:
            return self._model._engine.decode(self._state, int(token_id))

    def fork(self) -> Session:
        """An independent copy of this session's state (a snapshot to branch from)."""
        twin = object.__new__(Session)
        twin._model = self._model
        with self._model._lock:
            twin._state = self._state.clone()
        return twin


class Model:
    """A loaded Qwen3.5 / Qwen3.6 / Qwen3-Next model.

    >>> model = lily.Model.load("path/to/checkpoint")
    >>> model.logits([1, 2, 3]).shape
    (3, vocab_size)
    """

    def __init__(self, path: Path, config: ModelConfig, weights, engine, max_context: int):
        self.path = path
        self.config = config
        self._weights = weights
        self._engine = engine
        self.max_context = max_context
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        backend: str = "cpu",
        threads: int | None = None,
        prefill_chunk: int = 512,
        max_context: int | None = None,
    ) -> Model:
        """Loads a checkpoint folder (config.json + *.safetensors).

        backend: "cpu". threads: worker threads (default: all cores). prefill_chunk: tokens per
        prefill step (bounds scratch memory). max_context: default context of new sessions
        (default: the model's max_position_embeddings).
        """
        if backend not in BACKENDS:
            raise ConfigError(f"[load] unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
        if prefill_chunk < 1:
            raise ConfigError("[load] prefill_chunk must be at least 1")
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"[load] {path} is not a directory")
        config = load_config(root)
        weights = load_weights(root, config)
        engine = _core.Engine(weights, backend, threads or 0, prefill_chunk)
        return cls(root, config, weights, engine, max_context or config.max_position_embeddings)

    def __repr__(self) -> str:
        c = self.config
        quant = c.quantization
        q = f"{quant.get('bits')}-bit" if quant else "unquantized"
        return (
            f"<lily.Model {c.family} ({c.model_type}) layers={c.num_hidden_layers} hidden={c.hidden_size} "
            f"vocab={c.vocab_size} {q} {self._weights.nbytes / 1e9:.2f} GB backend={self._engine.backend} "
            f"threads={self._engine.threads}>"
        )

    def session(self, max_context: int | None = None) -> Session:
        """A fresh sequence state."""
        return Session(self, max_context)

    def logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) from a fresh state."""
        ids = _token_array(token_ids)
        if ids.size == 0:
            raise RequestError("[logits] no tokens given")
        return self.session(max(ids.size, 1)).prefill(ids, all_logits=True)

    def generate(self, token_ids: Sequence[int] | np.ndarray, max_tokens: int = 32) -> list[int]:
        """Greedy continuation of ``token_ids``: returns the new token ids (stops at EOS)."""
        ids = _token_array(token_ids)
        if max_tokens < 0:
            raise RequestError("[generate] max_tokens must be non-negative")
        if ids.size == 0:
            raise RequestError("[generate] no prompt tokens given")
        s = self.session(min(self.max_context, ids.size + max_tokens))
        out: list[int] = []
        if max_tokens == 0:
            return out
        logits = s.prefill(ids)
        eos = set(self.config.eos_token_id)
        while True:
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in eos or len(out) >= max_tokens:
                return out
            logits = s.decode(tok)
