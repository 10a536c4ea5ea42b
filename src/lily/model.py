"""The model object: load a checkpoint, run prefill/decode, generate."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from lily import _core, session_file
from lily._core import ConfigError, RequestError
from lily.batching import Batcher, BatchStream, DeviceRow, generate_batch, is_prompt_batch
from lily.chat_template import render, template_kwargs
from lily.checkpoint import load_weights, resident_by_default
from lily.config import ModelConfig, load_config
from lily.generation import (
    GenerationResult,
    GenerationSlots,
    GenerationStream,
    check_type,
    logit_bias_pairs,
    stop_token_list,
)
from lily.generation_config import GenerationDefaults, load_generation_config
from lily.hub import resolve_model_path
from lily.prefix_cache import reusable_prefix
from lily.request import Generation, GenerationRequest
from lily.structured import compile_constraint, grammar_for
from lily.tokenizer import Tokenizer
from lily.tool_calls import opens_reasoning

if TYPE_CHECKING:
    from typing_extensions import TypedDict, Unpack  # typing's own from Python 3.11 / 3.12

    from lily.chat import Chat

    Prompt = str | Sequence[dict] | Sequence[int] | np.ndarray
    PromptBatch = list[str] | list[list[int]] | list[list[dict]] | list[np.ndarray]

    class GenerateOptions(TypedDict, total=False):
        """Model.generate's keyword arguments but ``stream`` (what its overloads share)."""

        max_tokens: int | None
        temperature: float | None
        top_p: float | None
        top_k: int | None
        min_p: float | None
        repetition_penalty: float | None
        presence_penalty: float | None
        frequency_penalty: float | None
        seed: int | None
        stop: str | Sequence[str] | None
        logprobs: bool | int | None
        tools: Sequence[dict] | None
        enable_thinking: bool | None
        chat_template_kwargs: Mapping[str, Any] | None
        on_prefill_progress: Callable[[int, int], None] | None
        prompt_cache: Session | None
        logit_bias: dict[int, float] | None
        stop_token_ids: Sequence[int] | None
        json_schema: dict | bool | None
        regex: str | None
        grammar: str | None


# Generations at once by default on a backend that batches: benchmarks/serve_load.py on the
# medium model, 2 cores (docs/server.md, "Measured"; benchmarks/README.md, "Batched decode").
DEFAULT_MAX_BATCH = 8


def default_max_batch(engine) -> int:
    """Generations at once by default (``Model.load``, ``lily serve``): DEFAULT_MAX_BATCH, and on
    a GPU backend at most the rows of one pass (``engine.batch_rows``, 7), so every running
    generation's decode row shares one pass, which reads the weights once
    (benchmarks/metal_plan.py --batches), in the device loop (lily.batching)."""
    return min(DEFAULT_MAX_BATCH, int(engine.batch_rows))

# "msl-cpu" runs the Metal backend's dispatch sequence on the MSL-on-CPU runtime (tests; slow);
# "msl-cuda" the same kernels and dispatch sequence on an NVIDIA GPU (docs/msl-on-cuda.md).
BACKENDS = ("cpu", "metal", "msl-cpu", "msl-cuda")


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
    """One sequence on a model: its state (KV cache, DeltaNet and conv state), the token ids it
    has processed, and snapshots of its recurrent state to go back to.

    ``prefill`` appends tokens and returns logits; ``decode`` appends one token. Sessions of one
    model share its weights and engine; calls from several threads at once share engine passes
    (lily.batching), which changes no logits. ``save``
    writes the state and its tokens to a file that :meth:`Model.load_session` reads back.

    Prefix reuse (``Chat``, the server's prompt cache, ``generate(n=...)``): ``take_snapshot``
    keeps the recurrent state at the current position (at most ``max_snapshots``, oldest dropped
    first); ``rewind(ids)`` brings the session to the longest prefix of ``ids`` it can keep
    (attention KV is cut back in place; DeltaNet and conv state come back from the latest
    snapshot at or before the first differing token, lily.prefix_cache). ``nbytes`` counts the
    state and the snapshots (recurrent state only, no KV).
    """

    def __init__(self, model: Model, max_context: int | None = None, max_snapshots: int = 16):
        self._model = model
        # State operations take the engine lock: on a GPU backend they wait for the device
        # (finish), which must not happen while another thread encodes a pass.
        with model._lock:
            self._state = model._engine.new_state(max_context or model.max_context)
        # The ids processed, in order (save() and rewind() read them). They are recorded before
        # the engine call: Ctrl-C can raise between any two Python steps, and a state that moved
        # on without its tokens could not be matched again. They may thus run ahead of the
        # state, never behind; _sync() trims them back.
        self._tokens: list[int] = []
        self.max_snapshots = max_snapshots
        self.snapshots: list = []  # native Snapshots, ascending position
        self.metadata: dict[str, str] = {}  # strings saved with the session (Session.save)

    @property
    def position(self) -> int:
        """Tokens processed so far."""
        return self._state.position

    @property
    def max_context(self) -> int:
        return self._state.max_context

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    @property
    def nbytes(self) -> int:
        """The state's memory (KV cache as allocated plus recurrent state) and its snapshots'."""
        return self._state.nbytes + self.snapshot_bytes

    def prefill(self, token_ids: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Appends ``token_ids``; returns logits [vocab] of the last (or [T, vocab] of every) token."""
        ids = _token_array(token_ids)
        if ids.size == 0:
            raise RequestError("[prefill] no tokens given")
        self._sync()
        self._tokens.extend(ids.tolist())
        return self._model._batcher.run(self._state, ids, all_logits)

    def decode(self, token_id: int) -> np.ndarray:
        """Appends one token; returns its logits [vocab]."""
        check_type("decode", "token_id", token_id, (int, np.integer), "an integer")
        self._sync()
        self._tokens.append(int(token_id))
        return self._model._batcher.run(self._state, np.array([token_id], dtype=np.int32))

    def device_loop(self, token: int, max_steps: int, sampler) -> DeviceRow | None:
        """A decode row from ``token`` whose tokens are chosen by ``sampler``'s algorithm on the
        device where the pass allows it (GPU backends; it shares the engine's device loop with the
        other generations running), or None where the backend has none (see
        :class:`lily.batching.DeviceRow`). The session records each token the row feeds to the
        state, so its ``tokens`` stay its state's (after ``close()``: every token the row
        returned but the last)."""
        self._sync()
        return self._model._batcher.device_row(self._state, token, max_steps, sampler, self._tokens.append)

    def __repr__(self) -> str:
        return f"<lily.Session position={self.position} max_context={self.max_context}>"

    @property
    def tokens(self) -> list[int]:
        """The token ids this session has processed, in order."""
        self._sync()
        return list(self._tokens)

    @contextlib.contextmanager
    def _engine_lock(self) -> Iterator[None]:
        """The model's engine lock for an operation on this session's state, with the device
        loop ended first if it still holds a closed row (lily.batching.Batcher.settle)."""
        with self._model._lock:
            if self._model._batcher.settle(self._state):
                raise RequestError("[session] a generation is running on this session: its state moves on the "
                                   "device between steps (close the stream first)")
            yield

    def _sync(self) -> None:
        """Drops recorded tokens the state never processed (an interrupted or failed step)."""
        del self._tokens[self.position :]

    def fork(self) -> Session:
        """An independent copy of this session's state (a snapshot to branch from); the copy
        starts with no snapshots of its own."""
        twin = object.__new__(Session)
        twin._model = self._model
        self._sync()
        with self._engine_lock():
            twin._state = self._state.clone()
        twin._tokens = list(self._tokens)
        twin.max_snapshots = self.max_snapshots
        twin.snapshots = []
        twin.metadata = dict(self.metadata)
        return twin

    def take_snapshot(self) -> None:
        """Keeps the recurrent state at the current position (for ``rewind``); the oldest
        snapshot is dropped beyond ``max_snapshots``."""
        if self.snapshots and self.snapshots[-1].position == self.position:
            return
        with self._engine_lock():
            self.snapshots.append(self._state.snapshot())
        if len(self.snapshots) > self.max_snapshots:
            self.snapshots.pop(0)

    def reusable(self, ids: Sequence[int]) -> int:
        """Tokens of prompt ``ids`` that ``rewind(ids)`` would keep (no state change)."""
        self._sync()
        return reusable_prefix(self._tokens, [s.position for s in self.snapshots], ids)

    def rewind(self, ids: Sequence[int]) -> int:
        """Brings the session to the longest reusable prefix of ``ids``; returns its length. At
        least one token of ``ids`` is always left to prefill (its logits start a generation)."""
        keep = self.reusable(ids)
        if keep == len(self._tokens):
            return keep
        # The state holds tokens past the reusable prefix: go back to the snapshot there.
        while self.snapshots and self.snapshots[-1].position > keep:
            self.snapshots.pop()
        if self.snapshots:
            snap = self.snapshots[-1]
            with self._engine_lock():
                self._state.restore(snap)
            del self._tokens[snap.position :]
            return snap.position
        self.reset()
        return 0

    def reset(self) -> None:
        """Starts over: an empty state, no tokens, no snapshots."""
        with self._model._lock:
            self._state = self._model._engine.new_state(self.max_context)
        self._tokens, self.snapshots = [], []

    def save(self, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> int:
        """Writes the token ids, KV cache and DeltaNet/conv state to ``path``: one safetensors
        file (docs/api-generation.md, "Saved sessions and prompt caches") stamped with the model's fingerprint and the engine
        settings, which :meth:`Model.load_session` checks. ``metadata``: strings of your own
        kept with it (the loaded session's ``metadata``). Returns the file's size in bytes."""
        extra = dict(metadata or {})
        for k, v in extra.items():
            check_type("save", f"metadata[{k!r}]", v, (str,), "a string")
        saved = self.saved_state(snapshots=False)
        saved.extra = extra
        return session_file.write(path, self._model, saved)

    def saved_state(self, *, snapshots: bool = True) -> session_file.SavedState:
        """The session as lily.session_file writes it: tokens, state, and (``snapshots``: the
        server's disk tier) each snapshot's recurrent state."""
        self._sync()
        state = self._state
        with self._engine_lock():
            tensors = state.export_tensors()
            snaps = {}
            for snap in self.snapshots if snapshots else ():
                try:
                    snaps[snap.position] = state.export_tensors(snap, with_kv=False)
                except RequestError:
                    continue  # stale (the session was rolled back past it): rewind() never uses it either
        return session_file.SavedState(np.asarray(self._tokens, np.int32), tensors, snaps)


class Model:
    """A loaded Qwen3.5 / Qwen3.6 / Qwen3-Next model.

    >>> model = lily.Model.load("path/or/hf-repo-id")
    >>> print(model.generate("The capital of France is", max_tokens=8).text)
    """

    def __init__(self, *args: Any, **kwargs: Any):
        """Not for direct use: a model is created by :meth:`Model.load` (or ``lily.load``)."""
        raise TypeError("lily.Model is not constructed directly: use lily.Model.load(path_or_repo_id, ...) "
                        "(or lily.load(...))")

    @classmethod
    def _from_parts(cls, path: Path, config: ModelConfig, weights: Any, engine: Any, max_context: int,
                    tokenizer: Tokenizer | None, defaults: GenerationDefaults) -> Model:
        self = object.__new__(cls)
        self._setup(path, config, weights, engine, max_context, tokenizer, defaults)
        return self

    def _setup(self, path: Path, config: ModelConfig, weights: Any, engine: Any, max_context: int,
               tokenizer: Tokenizer | None, defaults: GenerationDefaults) -> None:
        self.path = path
        self.config = config
        self.tokenizer = tokenizer
        self.generation_defaults = defaults
        self._weights = weights
        self._engine = engine
        self.max_context = max_context
        self._lock = threading.Lock()  # one engine call at a time (shared scratch)
        # Engine passes shared by every thread's calls (lily.batching); generations at once:
        # max_batch on a backend that batches (all of them today), else one at a time.
        self._batcher = Batcher(engine, self._lock, prefill_rows=engine.prefill_chunk)
        self._generation = GenerationSlots(1)
        self.max_batch = default_max_batch(engine)

    @property
    def batches(self) -> bool:
        """Whether generations running at once share engine passes (continuous batching,
        lily.batching: every backend today); elsewhere they take turns."""
        return self._batcher.batches

    @property
    def max_batch(self) -> int:
        """How many generations run at once (more wait their turn); 1 where the backend does
        not batch. Settable: ``Model.load(max_batch=...)``, ``lily serve --max-batch``."""
        return self._generation.capacity

    @max_batch.setter
    def max_batch(self, n: int) -> None:
        check_type("max_batch", "max_batch", n, (int, np.integer), "an integer")
        if n < 1:
            raise ConfigError(f"[load] max_batch must be at least 1, got {n}")
        self._generation.capacity = int(n) if self.batches else 1

    @classmethod
    def load(
        cls,
        path_or_repo_id: str | os.PathLike | None = None,
        *,
        revision: str | None = None,
        backend: str = "auto",
        threads: int | None = None,
        prefill_chunk: int = 512,
        max_context: int | None = None,
        backend_options: dict | None = None,
        cpu_matmul: str = "auto",
        use_mmap: bool | None = None,
        max_batch: int | None = None,
    ) -> Model:
        """Loads a checkpoint: a local folder, or a Hugging Face repo id (downloaded into the
        standard HF cache, only the files lily needs; offline when cached). With no argument,
        the small demo model shipped inside the package.

        backend: "auto" (Metal on a Mac whose GPU compiled the kernels and passed the
        known-answer check against the CPU backend, run once per lily build, kernel set and GPU
        and cached; else the CPU, with a lily.backend_choice.BackendWarning saying why where a
        Metal GPU was found: docs/metal.md; `lily doctor` shows the choice), "cpu", "metal"
        (macOS builds; unverified on Apple hardware), "msl-cpu" (the Metal kernels run on the CPU, for tests) or "msl-cuda" (the same
        kernels on an NVIDIA GPU, PTX from the kernel cache: docs/msl-on-cuda.md). threads: CPU worker threads
        (default: all cores). prefill_chunk: tokens per prefill step (bounds scratch memory).
        max_context: default context of new sequences (default: the model's
        max_position_embeddings, capped on a GPU backend to what fits beside the weights in the
        GPU's recommended working set; an explicit one that does not fit is a ConfigError naming
        the sizes). backend_options: GPU backends' test knobs (split_threshold,
        split_len: the attention route thresholds; block_threshold, block_len: the context from
        which the KV cache moves into fixed blocks, and their length; gemm_min_rows: the
        shortest chunk that runs prefill GEMMs rather than GEMVs; gemm: "auto", "simdgroup" or
        "tensor", the prefill GEMMs' inner product (simdgroup_matrix, or Metal 4 tensor ops
        where the GPU has them); kv_dtype: the KV cache's elements, "float16" (the default,
        "auto") or "float32" (the CPU backend's precision);
        check_dependencies, interleavings, asan: the MSL-on-CPU runtime's checking modes;
        metal4, apple_gpu_family, working_set: what the MSL-on-CPU device reports (Metal 4
        tensors, the Apple GPU family 7-10, recommendedMaxWorkingSetSize in bytes);
        fail_dispatch, fail_library: its fault injection for tests of the host's error paths;
        opaque_buffers: its buffers hide their storage from the host, as device memory does;
        permute_threadgroups, seed, timing, synchronous: the msl-cuda device's modes, see
        docs/msl-on-cuda.md; gemv_words: the decode GEMVs read 32-bit words instead of 16-byte
        loads, the earlier kernels' reads, for A/B timing; per_sequence_mixers: a pass of
        several sequences runs the attention and DeltaNet kernels once per sequence instead of
        once for all, for A/B timing; exclusive_weights (default True here): the int8 CPU
        backend may rearrange the loaded weights for its kernels, False keeps them as
        stored, for A/B timing; see docs/performance.md, "Interleaved rows").
        cpu_matmul: how the CPU backend multiplies quantized (4/8-bit) weights: "int8" rounds
        activations to int8 per block of 32 and uses integer dot products (2-4x faster; logits
        within ~1% of f32, see docs/performance.md); "f32" expands the weights to f32 (the
        reference: matches mlx-lm to ~1e-6); "auto" (default): "int8" where the CPU has the
        integer kernels (x86 AVX2, AVX-VNNI or AVX-512 VNNI; arm64), else "f32". Either way a
        token's logits are bit-identical however its prompt was chunked, cached or restored
        (tests/test_invariance.py). The model's repr says which mode runs.
        use_mmap: True maps the checkpoint files (instant load, no private memory; the files
        must not change while loaded, which lily checks); False reads them into memory (2 MiB
        pages where the OS gives them: CPU decode ~30% faster in docs/performance.md; costs
        load time and memory, and the files may then change freely); None (default): read
        into memory on the CPU backend when the files take at most 3/4 of the available
        memory, mapped otherwise.
        max_batch: how many generations run at once, sharing engine passes (continuous
        batching); more wait their turn. Default 8 on the CPU backend; 1 on the GPU backends,
        where a lone generation then runs on the device loop (tokens chosen on the GPU, about
        twice the host loop's rate) -- set it (up to 7, the rows of one pass there) to batch
        threads and prompt lists instead, on the host loop (``lily serve`` does: 7).
        """
        for name, value, types, what in (
                ("path_or_repo_id", path_or_repo_id, (str, os.PathLike, type(None)), "a path or repo id"),
                ("revision", revision, (str, type(None)), "a string"),
                ("backend", backend, (str,), "a string"),
                ("threads", threads, (int, type(None)), "an integer"),
                ("prefill_chunk", prefill_chunk, (int,), "an integer"),
                ("max_context", max_context, (int, type(None)), "an integer"),
                ("backend_options", backend_options, (dict, type(None)), "a dict"),
                ("cpu_matmul", cpu_matmul, (str,), "a string")):
            if isinstance(value, bool) or not isinstance(value, types):
                raise ConfigError(f"[load] {name} must be {what}, got {type(value).__name__} {value!r}")
        if backend == "auto":
            from lily.backend_choice import auto_backend

            # Metal once its known-answer check passed on this GPU (cached), else the CPU.
            backend = auto_backend(stacklevel=2).backend
        if backend not in BACKENDS:
            raise ConfigError(f"[load] unknown backend {backend!r}; available: auto, {', '.join(BACKENDS)}")
        if prefill_chunk < 1:
            raise ConfigError("[load] prefill_chunk must be at least 1")
        if cpu_matmul not in ("auto", "f32", "int8"):
            raise ConfigError(f"[load] cpu_matmul must be 'auto', 'int8' or 'f32', not {cpu_matmul!r}")
        if path_or_repo_id is None:
            root = demo_model_path()
        elif Path(path_or_repo_id).expanduser().is_dir():
            # A local folder: the config and checkpoint loaders name whatever is wrong in it.
            root = Path(path_or_repo_id).expanduser()
        else:
            try:
                root = resolve_model_path(path_or_repo_id, revision=revision)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"[load] {e}") from None
        if use_mmap not in (None, True, False):
            raise ConfigError(f"[load] use_mmap must be True, False or None, not {use_mmap!r}")
        config = load_config(root)
        resident = resident_by_default(root, backend) if use_mmap is None else not use_mmap
        weights = load_weights(root, config, resident=resident)
        # The weights serve this engine alone, so the int8 CPU backend may rearrange them for its
        # kernels (docs/performance.md, "Interleaved rows").
        engine = _core.Engine(weights, backend, threads or 0, prefill_chunk, cpu_matmul=cpu_matmul,
                              **{"exclusive_weights": True, **(backend_options or {})})
        tokenizer = Tokenizer.from_dir(root) if os.path.lexists(root / "tokenizer.json") else None
        defaults = load_generation_config(root)
        if max_context is not None and max_context < 0:
            raise ConfigError("[load] max_context must be at least 1")
        if not max_context:
            # The model's full context, capped to what fits beside the weights in the memory
            # the backend may use (a GPU's recommended working set).
            ctx = min(config.max_position_embeddings, engine.max_fitting_context)
            engine.check_context(max(ctx, 1))  # the weights alone may not fit: say so now
        else:
            ctx = max_context
            engine.check_context(ctx)
        if ctx < 1:
            raise ConfigError("[load] max_context must be at least 1")
        model = cls._from_parts(root, config, weights, engine, ctx, tokenizer, defaults)
        # The fingerprint saved sessions carry (lily.session_file), taken from the files as they
        # were loaded: with use_mmap=False they may change afterwards, the weights in memory not.
        session_file.model_identity(model)
        if max_batch is not None:
            model.max_batch = max_batch
        return model

    def __repr__(self) -> str:
        c = self.config
        quant = c.quantization
        q = f"{quant.get('bits')}-bit" if quant else "unquantized"
        return (
            f"<lily.Model {c.family} ({c.model_type}) layers={c.num_hidden_layers} hidden={c.hidden_size} "
            f"vocab={c.vocab_size} {q} {self._weights.nbytes / 1e9:.2f} GB backend={self._engine.backend} "
            f"threads={self._engine.threads}"
            + (f" cpu_matmul={self._engine.cpu_matmul}" if self._engine.cpu_matmul else "") + ">"
        )

    # -- low level -------------------------------------------------------------------------

    def session(self, max_context: int | None = None, max_snapshots: int = 16) -> Session:
        """A fresh sequence state (``max_snapshots``: see :meth:`Session.take_snapshot`)."""
        return Session(self, max_context, max_snapshots)

    def load_session(self, path: str | os.PathLike, max_context: int | None = None) -> Session:
        """A session continuing from a file :meth:`Session.save` wrote with this model: the next
        prefill / decode gives bit-identical logits to the session that was saved. Raises
        ConfigError naming the difference when the file belongs to another model, a changed
        checkpoint or other engine settings (backend, KV dtype, cpu_matmul), and CheckpointError
        when it is not a session file, truncated or corrupted."""
        return self._session_from(session_file.read(path, self), max_context, str(path))

    def _session_from(self, saved, max_context: int | None, source: str, max_snapshots: int | None = None) -> Session:
        """A session holding a SavedState (lily.session_file) read for this model. With
        ``max_snapshots`` (the server's disk tier) it keeps the saved snapshots and one at its end,
        so a later prompt that diverges after it still reuses it."""
        session = self.session(max_context)
        if saved.position > session.max_context:
            raise RequestError(f"[session] {source} holds {saved.position} tokens; the context holds "
                               f"{session.max_context}")
        with self._lock:
            session._state.import_tensors(saved.position, saved.tensors)
        session._tokens = saved.tokens.tolist()
        session.metadata = saved.extra
        if max_snapshots is not None:
            session.max_snapshots = max_snapshots
            with self._lock:
                session.snapshots = [session._state.snapshot_from_tensors(p, saved.snapshots[p])
                                     for p in sorted(saved.snapshots) if p < saved.position]
            if saved.position:
                session.take_snapshot()
            session.snapshots = session.snapshots[-max_snapshots:]
        return session

    def logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Teacher-forced logits [T, vocab] (float32) from a fresh state."""
        ids = _token_array(token_ids)
        if ids.size == 0:
            raise RequestError("[logits] no tokens given")
        return self.session(max(ids.size, 1)).prefill(ids, all_logits=True)

    # -- generation ------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_id) | set(self.generation_defaults.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"[generate] {what} needs a tokenizer, and {self.path} has no tokenizer.json")
        return self.tokenizer

    def render_chat(self, messages: Sequence[dict], *, tools=None, enable_thinking: bool | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The chat template applied to OpenAI-format messages (sandboxed). Every key of
        ``chat_template_kwargs`` becomes a template variable (e.g. Qwen3.6's ``preserve_thinking``)."""
        tok = self._need_tokenizer("a chat prompt")
        if not tok.chat_template:
            raise RequestError(f"[generate] {self.path} has no chat template")
        try:
            variables = template_kwargs(chat_template_kwargs, enable_thinking)
        except ValueError as e:
            raise RequestError(f"[generate] {e}") from None
        return render(tok.chat_template, list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                      **variables)

    def encode_prompt(self, prompt: str | Sequence[dict] | Sequence[int] | np.ndarray, *,
                      tools: Sequence[dict] | None = None, enable_thinking: bool | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> np.ndarray:
        """A prompt (text, OpenAI chat messages or token ids) as token ids."""
        return self._encode(prompt, tools=tools, enable_thinking=enable_thinking,
                            chat_template_kwargs=chat_template_kwargs)[0]

    def _encode(self, prompt: Any, *, tools: Sequence[dict] | None, enable_thinking: bool | None,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[np.ndarray, str | None]:
        """Token ids of ``prompt`` and, for a chat prompt, the rendered text."""
        rendered = None
        if isinstance(prompt, str):
            ids = self._need_tokenizer("a text prompt").encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            rendered = self.render_chat(prompt, tools=tools, enable_thinking=enable_thinking,
                                        chat_template_kwargs=chat_template_kwargs)
            ids = self._need_tokenizer("a chat prompt").encode(rendered)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = prompt
        else:
            raise RequestError(f"[generate] the prompt must be a string, a list of chat messages or token ids, "
                               f"got {type(prompt).__name__}")
        ids = _token_array(ids, "prompt")
        if ids.size == 0:
            raise RequestError("[generate] the prompt is empty")
        return ids, rendered

    @overload
    def generate(self, prompt: PromptBatch, *, stream: Literal[False] = ...,
                 **options: Unpack[GenerateOptions]) -> list[GenerationResult]: ...

    @overload
    def generate(self, prompt: PromptBatch, *, stream: Literal[True],
                 **options: Unpack[GenerateOptions]) -> BatchStream: ...

    @overload
    def generate(self, prompt: Prompt, *, n: int, stream: Literal[False] = ...,
                 **options: Unpack[GenerateOptions]) -> list[GenerationResult]: ...

    @overload
    def generate(self, prompt: Prompt, *, n: int, stream: Literal[True],
                 **options: Unpack[GenerateOptions]) -> BatchStream: ...

    @overload
    def generate(self, prompt: Prompt, *, stream: Literal[False] = ...,
                 **options: Unpack[GenerateOptions]) -> GenerationResult: ...

    @overload
    def generate(self, prompt: Prompt, *, stream: Literal[True], **options: Unpack[GenerateOptions]) -> GenerationStream: ...

    @overload
    def generate(self, prompt: Prompt, *, stream: bool,
                 **options: Unpack[GenerateOptions]) -> GenerationResult | GenerationStream: ...

    def generate(
        self,
        prompt: str | Sequence[dict] | Sequence[int] | np.ndarray | Sequence[str] | Sequence[Sequence[Any]],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: bool | int | None = None,
        stream: bool = False,
        tools: Sequence[dict] | None = None,
        enable_thinking: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        on_prefill_progress: Callable[[int, int], None] | None = None,
        prompt_cache: Session | None = None,
        logit_bias: dict[int, float] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        json_schema: dict | bool | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        n: int | None = None,
    ) -> GenerationResult | GenerationStream | list[GenerationResult] | BatchStream:
        """Generates a continuation of ``prompt``: a string, a list of OpenAI-format chat
        messages (rendered with the checkpoint's chat template), or token ids.

        Sampling defaults come from the checkpoint's generation_config.json, else greedy.
        ``logprobs``: True for the sampled token's logprob, an int N for the top N as well.
        ``stream=True`` returns a :class:`GenerationStream` of chunks instead of a result. Up to
        ``max_batch`` generations run at once; when all slots are taken, this thread's oldest
        stream still open is ended (finish_reason "cancelled") before this one starts.
        ``on_prefill_progress(done, total)`` is called after each prefill chunk (progress bars).
        ``prompt_cache``: a :class:`Session` holding a prefix of the prompt (``load_session`` of a
        file ``lily cache`` or ``Session.save`` wrote): the prompt's token ids must start with the
        session's and add at least one; only the rest is prefilled, on a copy (the session is
        left as it was, to serve the next prompt).
        ``logit_bias``: {token id: bias} added to those tokens' logits before sampling (OpenAI's
        logit_bias; -100 all but bans a token). ``stop_token_ids``: token ids that end generation
        as EOS does (finish_reason "stop"; the token is not in the output).
        Structured output (at most one of): ``json_schema`` (a JSON Schema dict, or True for any
        JSON object), ``regex`` (the whole output matches it) or ``grammar`` (a Lark or GBNF
        grammar); each token is chosen among those that keep the output valid (llguidance, the
        ``structured`` extra). A schema, regex or grammar the library rejects is a RequestError
        (a ValueError) naming the problem. For a chat prompt that opens a ``<think>`` block the
        constraint applies after it closes. ``max_tokens`` can still cut a document short.
        ``chat_template_kwargs``: extra variables for the chat template (every key reaches it).
        The result's ``content`` / ``reasoning`` / ``tool_calls`` split the text of a chat
        prompt (the ``<think>`` block and tool calls); for other prompts ``content`` is the text.
        A list of prompts (strings, token-id lists or message lists) runs them as one batch and
        returns one result per prompt, in order (with ``stream=True`` a :class:`lily.batching.BatchStream`
        of chunks tagged with their prompt's ``index``); up to ``max_batch`` run at once, sharing
        engine passes, each getting the tokens it gets alone. Threads calling ``generate`` on
        one model at once are batched the same way.
        ``n``: that many choices, returned as a list of results (a list whenever ``n`` is
        given, as OpenAI's ``choices``; with ``stream=True`` a :class:`lily.batching.BatchStream`
        of chunks tagged with their choice's ``index``, the choices streamed one after another).
        The prompt is prefilled once and each choice continues from its state; choice i samples
        with seed ``seed + i`` (as the server's ``n``), so it equals ``generate(..., seed=seed + i)``;
        later choices count the prompt but its last token as ``cached_tokens``.
        """
        if is_prompt_batch(prompt):  # several prompts, run as one batch (lily.batching)
            options = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                           repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                           frequency_penalty=frequency_penalty, seed=seed, stop=stop, logprobs=logprobs, tools=tools,
                           enable_thinking=enable_thinking, chat_template_kwargs=chat_template_kwargs,
                           on_prefill_progress=on_prefill_progress, prompt_cache=prompt_cache,
                           logit_bias=logit_bias, stop_token_ids=stop_token_ids, json_schema=json_schema,
                           regex=regex, grammar=grammar)
            if n is not None:
                raise RequestError("[generate] n cannot be combined with a list of prompts (repeat the prompt "
                                   "in the list instead)")
            return BatchStream.of_prompts(self, list(prompt), options) if stream else generate_batch(self, list(prompt),
                                                                                                    options)
        ids, rendered = self._encode(prompt, tools=tools, enable_thinking=enable_thinking,
                                     chat_template_kwargs=chat_template_kwargs)
        thinking = rendered is not None and opens_reasoning(rendered)
        request = GenerationRequest.build(
            self, ids, max_tokens=max_tokens, stop=stop, logprobs=logprobs, n=n, context=self.max_context,
            sampling=dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, seed=seed),
            rules=dict(logit_bias=logit_bias, stop_token_ids=stop_token_ids, json_schema=json_schema, regex=regex,
                       grammar=grammar),
            thinking=thinking, chat=rendered is not None, tools=tools)
        if prompt_cache is None:
            def sequence() -> tuple[Session, int]:
                return self.session(int(ids.size) + request.max_tokens), 0
        else:
            cached = _cached_prefix(prompt_cache, ids)
            if prompt_cache._model is not self:
                raise RequestError("[generate] prompt_cache is a session of another model")
            if ids.size >= prompt_cache.max_context:
                raise RequestError(f"[generate] the prompt has {ids.size} tokens; the prompt cache's context holds "
                                   f"{prompt_cache.max_context}")
            request.max_tokens = min(request.max_tokens, prompt_cache.max_context - int(ids.size))

            def sequence() -> tuple[Session, int]:
                # A copy: the cache is left as it was, to serve the next prompt. Its only
                # snapshot is the one n > 1 takes before the prompt's last token (choice_loops).
                return prompt_cache.fork(), len(cached)

        run = Generation(self, request, sequence, on_prefill_progress=on_prefill_progress)
        if n is None:
            stream_obj = run.stream(own_slot=True)  # the stream frees the slot when it ends
            return stream_obj if stream else stream_obj.drain()
        if stream:  # one worker runs the choices in order, its chunks tagged with their choice
            return BatchStream(lambda _i: run.stream(), int(n), 1, on_end=run.close)
        try:
            return [s.drain() for s in run.streams()]
        finally:
            run.close()

    def _token_rules(self, options: dict[str, Any], *, thinking: bool, where: str = "generate"):
        """(logit bias pairs, stop token ids, structured-output constraint or None) from the
        request options ``logit_bias``, ``stop_token_ids``, ``json_schema``, ``regex``,
        ``grammar`` (checked here; see :meth:`generate`). ``thinking``: the prompt opens a
        ``<think>`` block, which the constraint leaves free."""
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else self.config.vocab_size
        bias = logit_bias_pairs(options.get("logit_bias"), vocab, where)
        stop_ids = stop_token_list(options.get("stop_token_ids"), vocab, where)
        rules = grammar_for(json_schema=options.get("json_schema"), regex=options.get("regex"),
                            grammar=options.get("grammar"), where=where)
        # The grammar ends on the model's own EOS ids (stop_token_ids stop only where it allows
        # them), so the tokenizer index, built once per model, is shared by every request.
        constraint = None if rules is None else compile_constraint(self.tokenizer, rules, self.eos_token_ids,
                                                                   thinking=thinking, where=where)
        return bias, stop_ids, constraint

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else ""

    def _max_tokens(self, max_tokens: int | None) -> int:
        if max_tokens is None:
            max_tokens = self.generation_defaults.max_new_tokens or 256
        if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise RequestError(f"[generate] max_tokens must be a non-negative integer, got {max_tokens!r}")
        return int(max_tokens)

    def chat(self, system: str | None = None, *, tools: Sequence[dict] | None = None,
             enable_thinking: bool | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
             max_snapshots: int = 16, prompt_cache: Session | None = None, **sampling: Any) -> Chat:
        """A conversation that keeps its state between turns (see :class:`lily.Chat`)."""
        from lily.chat import Chat

        return Chat(self, system, tools=tools, enable_thinking=enable_thinking,
                    chat_template_kwargs=chat_template_kwargs, max_snapshots=max_snapshots,
                    prompt_cache=prompt_cache, **sampling)


def _cached_prefix(cache: Session, ids: np.ndarray) -> list[int]:
    """The tokens of ``cache``, checked to be a proper prefix of the prompt ``ids``."""
    if not isinstance(cache, Session):
        raise RequestError(f"[generate] prompt_cache must be a lily.Session, got {type(cache).__name__}")
    cached = cache.tokens
    prompt = ids.tolist()
    if len(prompt) <= len(cached) or prompt[: len(cached)] != cached:
        same = next((i for i, (a, b) in enumerate(zip(prompt, cached, strict=False)) if a != b),
                    min(len(prompt), len(cached)))
        raise RequestError(
            f"[generate] the prompt ({len(prompt)} tokens) does not extend the prompt cache ({len(cached)} tokens): "
            + (f"they differ at token {same}" if same < min(len(prompt), len(cached)) else
               "the prompt must add at least one token to the cached ones"))
    return cached


def demo_model_path() -> Path:
    """The small demo model shipped inside the package."""
    path = Path(__file__).resolve().parent / "demo"
    if not (path / "config.json").is_file():
        raise ConfigError(f"[load] the demo model is missing from this installation ({path})")
    return path
