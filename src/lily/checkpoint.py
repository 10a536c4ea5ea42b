"""Checkpoint loading: safetensors files -> the native engine's weight slots.

Two spellings of each model are accepted, and told apart the way mlx-lm does it:

* Hugging Face layout: ``model.language_model.*`` (or ``model.*``), zero-centred norms stored
  as ``w`` (the gain is ``1 + w``), conv1d as ``[C, 1, K]``, experts fused
  (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) or one tensor
  per expert (``mlp.experts.{e}.gate_proj.weight``).
* MLX layout: ``language_model.model.*``, norms already ``1 + w``, conv1d as ``[C, K, 1]``,
  experts stacked as ``mlp.switch_mlp.{gate,up,down}_proj``, linears affine-quantized
  (``.weight`` uint32 + ``.scales`` + ``.biases``) with per-path bit overrides in
  config.json ``quantization``.

The large matrices are never copied: the native builder keeps views into the memory-mapped
files. Vision-tower and MTP tensors are skipped on purpose, recognised after the text model's
prefix is stripped, so re-saved derivatives that nest them under the language model
(``model.language_model.visual.*``, ``model.language_model.mtp.*``) load like the releases; any
other tensor that is not used, any missing tensor, and any wrong shape is a CheckpointError
naming the tensor before any compute runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lily import _core
from lily._core import CheckpointError
from lily.config import ModelConfig
from lily.files import check_regular, read_json

# Tensors of the parts of released checkpoints lily does not run, matched on the canonical name
# (text-model prefix stripped): `model.visual.*`, `model.language_model.visual.*`, `mtp.*`,
# `model.language_model.mtp.*`, `language_model.mtp.*` all arrive here as `visual.` / `mtp.`.
_SKIP = re.compile(r"^(visual|vision_tower|mtp)\.")
_LAYER = re.compile(r"layers\.(\d{1,9})\.")
# Name prefixes of the text model, longest first.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


@dataclass
class _Tensor:
    file: int
    name: str  # as stored in the file
    dtype: str
    shape: tuple[int, ...]


def _canonical(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p) :]
    return name


def is_unused_part(name: str) -> bool:
    """A vision-tower or MTP tensor, under any of the prefixes released and re-saved checkpoints
    put them (the loader and `lily convert` both drop these)."""
    return _SKIP.match(_canonical(name)) is not None


def _shard_path(model_dir: Path, name, index: Path) -> Path:
    """A shard named by the index, which must be a plain relative path inside the model folder
    (an index naming "/etc/passwd" or "../../x" would have the loader open, and its error
    messages describe, a file outside the checkpoint)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise CheckpointError(f"[checkpoint] {index} names a shard {name!r}: not a file name")
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or os.path.normpath(name).startswith(".."):
        raise CheckpointError(f"[checkpoint] {index} names a shard {name!r} outside the model folder")
    return model_dir / name


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards (from model.safetensors.index.json, else *.safetensors), each
    checked to be a regular file inside the folder."""
    index = model_dir / "model.safetensors.index.json"
    if os.path.lexists(index):
        doc = read_json(index, CheckpointError, prefix="[checkpoint] ")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"[checkpoint] {index} is malformed: no 'weight_map' object")
        files = [_shard_path(model_dir, n, index) for n in weight_map.values()]
        files = sorted(set(files))
        for f in files:
            if not os.path.lexists(f):
                raise CheckpointError(f"[checkpoint] {index} names {f.name}, which does not exist")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"[checkpoint] no .safetensors files in {model_dir}")
    for f in files:  # a FIFO, a directory, a symlink loop: named here, before any open
        check_regular(f, CheckpointError, "[checkpoint] ")
    return files


class _Loader:
    def __init__(self, model_dir: Path, cfg: ModelConfig, resident: bool):
        self.cfg = cfg
        self.builder = _core.WeightsBuilder(cfg.to_native())
        self.tensors: dict[str, _Tensor] = {}
        self.used: set[str] = set()
        for path in safetensors_files(model_dir):
            fid = self.builder.add_file(str(path), resident=resident)
            for name, dtype, shape in self.builder.tensors(fid):
                if is_unused_part(name):
                    continue
                key = _canonical(name)
                if key in self.tensors:
                    raise CheckpointError(
                        f"[checkpoint] tensor '{name}' in {path.name} duplicates '{self.tensors[key].name}'"
                    )
                self.tensors[key] = _Tensor(fid, name, dtype, tuple(shape))
        self._check_layers()
        # The checkpoint's own prefix, so a missing tensor is named as this file would name it.
        self.prefix = next(
            (t.name[: len(t.name) - len(k)] for k, t in self.tensors.items() if k.startswith("layers.")), ""
        )
        conv = [t for k, t in self.tensors.items() if k.endswith("conv1d.weight")]
        # mlx-lm's own rule: a conv1d stored [C, 1, K] means Hugging Face layout, whose
        # zero-centred norms still need the + 1.
        self.hf_layout = any(t.shape[-1] != 1 for t in conv) if conv else not any(
            k.endswith(".scales") for k in self.tensors
        )
        self.quant = cfg.quantization or {}
        self._global_scales: dict[str, np.ndarray] = {}  # by module key: read once for all its experts

    def _check_layers(self) -> None:
        """config.json's layer count against the tensors, before anything is made per layer: a
        config claiming 10^6 layers over an 8-layer checkpoint fails here, at once."""
        present = {int(m.group(1)) for k in self.tensors if (m := _LAYER.match(k))}
        n = self.cfg.num_hidden_layers
        missing = next((i for i in range(n) if i not in present), None)
        if missing is not None:
            have = f"tensors for {len(present)} layers" if present else "no layer tensors"
            raise CheckpointError(f"[checkpoint] config.json says {n} layers, but the checkpoint has {have} "
                                  f"(none for layer {missing})")

    # -- lookups ----------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str) -> _Tensor:
        t = self.tensors.get(key)
        if t is None:
            name = key if key.startswith("lm_head") else self.prefix + key
            raise CheckpointError(f"[checkpoint] missing tensor '{name}'")
        self.used.add(key)
        return t

    def vector(self, slot: str, key: str, length: int, *, plus_one: bool = False) -> None:
        t = self.get(key)
        v = self.builder.read_f32(t.file, t.name)
        if v.size != length:
            raise CheckpointError(f"[checkpoint] tensor '{t.name}' has shape {list(t.shape)}, expected [{length}]")
        if plus_one:
            v = v + np.float32(1.0)
        self.builder.set_vector(slot, np.ascontiguousarray(v, dtype=np.float32))

    def _quant_params(self, module: str, t: _Tensor) -> tuple[int, int, str | None]:
        """(bits, group size, mode) from the module's own config.json entry (mlx-lm rebuilds a
        listed module from its entry alone: no "mode" there means affine); (0, 0, None) for a
        module the config does not list = infer all three from the tensors, as mlx-lm's
        infer_quant_config does (mixed-precision re-quantizations often drop those entries).
        The top-level defaults are checked either way."""
        override = self.quant.get(module)
        entry = override if isinstance(override, dict) else self.quant
        bits, group = entry.get("bits"), entry.get("group_size")
        if not isinstance(bits, int) or not isinstance(group, int):
            raise CheckpointError(
                f"[checkpoint] tensor '{t.name}' is quantized but config.json 'quantization' gives no "
                f"bits/group_size for '{module}'"
            )
        # The native builder names unsupported widths; values past a C int (or booleans) would
        # fail in the binding with a TypeError instead (found by tests/fuzz config target).
        if isinstance(bits, bool) or isinstance(group, bool) or not (0 < bits <= 64 and 0 < group <= 1 << 16):
            raise CheckpointError(
                f"[checkpoint] tensor '{t.name}': config.json 'quantization' for '{module}' has bits={bits!r}, "
                f"group_size={group!r}; expected bits in 2..8 and a group size of 32, 64 or 128"
            )
        if entry is not override:
            return 0, 0, None
        return bits, group, override.get("mode", "affine")

    def linear(self, slot: str, key: str, *, index: int = -1, rows: tuple[int, int] = (0, -1)) -> None:
        """key: the module path without '.weight' (canonical names)."""
        w = self.get(key + ".weight")
        if self.has(key + ".scales"):
            s = self.get(key + ".scales")
            bits, group, mode = self._quant_params(w.name[: -len(".weight")], w)
            # mxfp4 / mxfp8 / nvfp4 keep uint8 scales and no biases (mlx-lm tells them apart so)
            if mode not in (None, "affine") or (mode is None and s.dtype == "U8"):
                self.builder.set_microscaled(slot, w.file, w.name, s.file, s.name, mode or "", index, rows[0], rows[1],
                                             self._global_scale(key, w, index))
                return
            b = self.get(key + ".biases")
            self.builder.set_affine(
                slot, w.file, w.name, s.file, s.name, b.file, b.name, bits, group, index, rows[0], rows[1]
            )
        else:
            self.builder.set_dense(slot, w.file, w.name, index, rows[0], rows[1])

    def _global_scale(self, key: str, w: _Tensor, index: int) -> float | None:
        """nvfp4's optional global scale of expert `index` of the stacked weight `w`:
        mlx-lm's quantize_model(..., global_scale=True) gives each switch layer a float32
        `<module>.global_scale` [E], one per expert, and lists the module with "global_scale": true.
        A listed module must agree with the tensors, as mlx-lm rebuilds it from that entry and then
        loads strictly; the native builder refuses one on any mode but nvfp4."""
        module = w.name[: -len(".weight")]
        entry = self.quant.get(module)
        listed = isinstance(entry, dict) and entry.get("global_scale") is True
        if not self.has(key + ".global_scale"):
            if listed:
                raise CheckpointError(f"[checkpoint] config.json 'quantization' gives '{module}' a global_scale, "
                                      f"but there is no tensor '{module}.global_scale'")
            return None
        t = self.get(key + ".global_scale")
        if isinstance(entry, dict) and not listed:
            raise CheckpointError(f"[checkpoint] tensor '{t.name}': config.json 'quantization' lists '{module}' "
                                  f"without \"global_scale\": true")
        if index < 0 or t.dtype != "F32" or t.shape != (w.shape[0],):
            raise CheckpointError(
                f"[checkpoint] tensor '{t.name}' is {t.dtype} {list(t.shape)}; a global scale is float32 [experts] "
                f"beside a stacked expert weight (mlx-lm's switch layers), here {list(w.shape)}"
            )
        if key not in self._global_scales:
            self._global_scales[key] = self.builder.read_f32(t.file, t.name)
        return float(self._global_scales[key][index])

    def raw(self, slot: str, key: str, *, index: int = -1, rows: tuple[int, int] = (0, -1)) -> None:
        """A dense matrix stored under its own name (fused HF experts)."""
        t = self.get(key)
        self.builder.set_dense(slot, t.file, t.name, index, rows[0], rows[1])

    # -- the model ----------------------------------------------------------------------------

    def load(self):
        c = self.cfg
        self.linear("embed", "embed_tokens")
        if c.tie_word_embeddings:
            # Tied: the head is the embedding; a stored lm_head is dropped, as mlx-lm's sanitize
            # drops it and transformers ties over it.
            self.linear("lm_head", "embed_tokens")
            self.used.update(k for k in ("lm_head.weight", "lm_head.scales", "lm_head.biases") if self.has(k))
        else:
            self.linear("lm_head", "lm_head")
        zc = self.hf_layout  # zero-centred norms stored as w
        self.vector("final_norm", "norm.weight", c.hidden_size, plus_one=zc)
        for i in range(c.num_hidden_layers):
            p, s = f"layers.{i}.", f"layers.{i}."
            self.vector(s + "input_norm", p + "input_layernorm.weight", c.hidden_size, plus_one=zc)
            self.vector(s + "post_norm", p + "post_attention_layernorm.weight", c.hidden_size, plus_one=zc)
            if c.layer_types[i] == "full_attention":
                a = p + "self_attn."
                for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    self.linear(s + "attn." + proj, a + proj)
                self.vector(s + "attn.q_norm", a + "q_norm.weight", c.head_dim, plus_one=zc)
                self.vector(s + "attn.k_norm", a + "k_norm.weight", c.head_dim, plus_one=zc)
            else:
                self._gated_deltanet(i)
            if c.ffn_types[i] == "moe":
                self._moe(i)
            else:
                for proj in ("gate", "up", "down"):
                    self.linear(f"{s}mlp.{proj}", f"{p}mlp.{proj}_proj")
        unused = sorted(self.tensors[k].name for k in self.tensors.keys() - self.used)
        if unused:
            more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
            raise CheckpointError(f"[checkpoint] unexpected tensors: {', '.join(unused[:5])}{more}")
        return self.builder.finish()

    def _gated_deltanet(self, i: int) -> None:
        c, p, s = self.cfg, f"layers.{i}.linear_attn.", f"layers.{i}.gdn."
        projs = ("in_proj_qkvz", "in_proj_ba") if c.architecture == "qwen3_next" else (
            "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        for proj in projs + ("out_proj",):
            self.linear(s + proj.replace("in_proj_", "in_"), p + proj)
        channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + (
            c.linear_num_value_heads * c.linear_value_head_dim)
        conv = self.get(p + "conv1d.weight")
        K = c.linear_conv_kernel_dim
        if conv.shape not in ((channels, 1, K), (channels, K, 1), (channels, K)):
            raise CheckpointError(
                f"[checkpoint] tensor '{conv.name}' has shape {list(conv.shape)}, expected "
                f"[{channels}, 1, {K}] (Hugging Face) or [{channels}, {K}, 1] (MLX)"
            )
        taps = self.builder.read_f32(conv.file, conv.name)  # [C, K] in both layouts' memory order
        self.builder.set_vector(s + "conv1d", np.ascontiguousarray(taps, dtype=np.float32))
        self.vector(s + "dt_bias", p + "dt_bias", c.linear_num_value_heads)
        self.vector(s + "A_log", p + "A_log", c.linear_num_value_heads)
        self.vector(s + "norm", p + "norm.weight", c.linear_value_head_dim)

    def _moe(self, i: int) -> None:
        c, p, s = self.cfg, f"layers.{i}.mlp.", f"layers.{i}.moe."
        self.linear(s + "router", p + "gate")
        if c.shared_expert_intermediate_size > 0:
            self.linear(s + "shared_gate", p + "shared_expert_gate")
            for proj in ("gate", "up", "down"):
                self.linear(f"{s}shared.{proj}", f"{p}shared_expert.{proj}_proj")
        E, I = c.num_experts, c.moe_intermediate_size
        if self.has(p + "switch_mlp.gate_proj.weight"):  # MLX: stacked [E, ...]
            for e in range(E):
                for proj in ("gate", "up", "down"):
                    self.linear(f"{s}experts.{e}.{proj}", f"{p}switch_mlp.{proj}_proj", index=e)
        elif self.has(p + "experts.gate_up_proj"):  # HF fused [E, 2I, H] / [E, H, I]
            gu = self.get(p + "experts.gate_up_proj")
            if len(gu.shape) != 3 or gu.shape[1] != 2 * I:
                raise CheckpointError(
                    f"[checkpoint] tensor '{gu.name}' has shape {list(gu.shape)}, expected [{E}, {2 * I}, {c.hidden_size}]"
                )
            if gu.shape[0] != E:
                raise CheckpointError(f"[checkpoint] tensor '{gu.name}' holds {gu.shape[0]} experts, config says {E}")
            for e in range(E):
                self.raw(f"{s}experts.{e}.gate", p + "experts.gate_up_proj", index=e, rows=(0, I))
                self.raw(f"{s}experts.{e}.up", p + "experts.gate_up_proj", index=e, rows=(I, 2 * I))
                self.raw(f"{s}experts.{e}.down", p + "experts.down_proj", index=e)
        else:  # HF one tensor per expert
            for e in range(E):
                for proj in ("gate", "up", "down"):
                    self.linear(f"{s}experts.{e}.{proj}", f"{p}experts.{e}.{proj}_proj")


def load_weights(model_dir: str | Path, cfg: ModelConfig, resident: bool = False):
    """Validates every tensor and maps the files (resident=False) or reads them into memory
    (resident=True, see csrc/model/safetensors.h); returns the native weights object."""
    return _Loader(Path(model_dir), cfg, resident).load()


def available_memory() -> int | None:
    """Bytes the OS can give without swapping: MemAvailable on Linux, half the physical memory
    elsewhere (macOS has no cheap equivalent); None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return None


def resident_by_default(model_dir: str | Path, backend: str) -> bool:
    """use_mmap=None: the CPU backend reads the checkpoint into memory when it takes at most 3/4
    of the available memory (decode streams the weights every token, faster from huge pages);
    GPU backends, and checkpoints that would crowd memory, stay mapped."""
    if backend != "cpu":
        return False
    need = sum(f.stat().st_size for f in safetensors_files(Path(model_dir)))
    avail = available_memory()
    return avail is not None and need <= 0.75 * avail
