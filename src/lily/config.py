"""Model configuration: config.json of the Qwen3.5 / Qwen3.6 / Qwen3-Next families.

The three families spell the same architecture differently (a nested ``text_config`` or a flat
dict, ``layer_types`` or ``full_attention_interval``, ``rope_parameters`` or top-level
``rope_theta``); this module reads all of them into one :class:`ModelConfig` and hands the
native core a validated ``lily._core.ModelConfig``. Anything else is a :class:`ConfigError`
naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from lily import _core
from lily._core import ConfigError
from lily.files import read_json

#: model_type values lily runs, top-level or under text_config.
SUPPORTED_MODEL_TYPES = {
    "qwen3_5_moe": "Qwen3.5 / Qwen3.6 MoE",
    "qwen3_5_moe_text": "Qwen3.5 / Qwen3.6 MoE (text only)",
    "qwen3_5": "Qwen3.5 / Qwen3.6 dense",
    "qwen3_5_text": "Qwen3.5 / Qwen3.6 dense (text only)",
    "qwen3_next": "Qwen3-Next",
}


#: MLX quantization modes lily reads ("mode" in config.json "quantization"); every backend runs
#: them (the GPU kernels read mxfp4 / mxfp8 / nvfp4 through their *_uchar instantiations).
QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The text model's shape, as read from config.json."""

    model_type: str  # as config.json names it
    architecture: str  # "qwen3_5_moe" | "qwen3_5" | "qwen3_next": what the engine runs
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention"
    ffn_types: tuple[str, ...]  # "moe" | "dense"
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # gated attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # feed-forward
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    # YaRN rope scaling (see _yarn); yarn_factor 1 = plain RoPE
    yarn_factor: float = 1.0
    yarn_low: float = 0.0
    yarn_high: float = 0.0
    rope_attention_factor: float = 1.0
    # quantization as written by MLX converters ({"group_size", "bits", "mode", per-path overrides})
    quantization: dict[str, Any] | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return "moe" in self.ffn_types

    def to_native(self) -> _core.ModelConfig:
        c = _core.ModelConfig()
        c.model_type = self.model_type
        c.hidden = self.hidden_size
        c.vocab = self.vocab_size
        c.max_position = self.max_position_embeddings
        c.rms_eps = self.rms_norm_eps
        c.layer_types = list(self.layer_types)
        c.ffn_types = list(self.ffn_types)
        c.n_heads = self.num_attention_heads
        c.n_kv_heads = self.num_key_value_heads
        c.head_dim = self.head_dim
        c.rotary_dim = self.rotary_dim
        c.rope_theta = self.rope_theta
        c.yarn_factor = self.yarn_factor
        c.yarn_low = self.yarn_low
        c.yarn_high = self.yarn_high
        c.rope_attention_factor = self.rope_attention_factor
        c.gdn_k_heads = self.linear_num_key_heads
        c.gdn_v_heads = self.linear_num_value_heads
        c.gdn_k_dim = self.linear_key_head_dim
        c.gdn_v_dim = self.linear_value_head_dim
        c.conv_kernel = self.linear_conv_kernel_dim
        c.gdn_fused_qkvz = self.architecture == "qwen3_next"
        c.intermediate = self.intermediate_size
        c.n_experts = self.num_experts
        c.top_k = self.num_experts_per_tok
        c.moe_intermediate = self.moe_intermediate_size
        c.shared_intermediate = self.shared_expert_intermediate_size
        c.norm_topk_prob = self.norm_topk_prob
        c.validate()
        return c


_INT32_MAX = 2**31 - 1
# Released models have at most a few hundred layers. The per-layer tuples below are built before
# the checkpoint is read, so a claim of 2^31 layers must stop here (the loader then checks the
# claim against the checkpoint's tensors before anything is allocated per layer).
MAX_LAYERS = 1 << 16


def _get(d: dict, key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
    if key not in d or d[key] is None:
        if default is dataclasses.MISSING:
            raise ConfigError(f"[config] missing required field '{key}'")
        return default
    v = d[key]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if kind is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ConfigError(f"[config] field '{key}' must be {kind.__name__}, got {type(v).__name__} {v!r}")
    if kind in (int, float) and (not math.isfinite(v) or v < 0):
        raise ConfigError(f"[config] field '{key}' must be a finite non-negative number, got {v!r}")
    # Sizes go to the native core as C ints; a larger value would surface as a TypeError from the
    # binding (found by the tests/fuzz config target).
    if kind is int and v > _INT32_MAX:
        raise ConfigError(f"[config] field '{key}' is {v}, larger than the supported {_INT32_MAX}")
    return v


def _layer_types(t: dict, n_layers: int) -> tuple[str, ...]:
    if t.get("layer_types") is not None:
        types = t["layer_types"]
        if not isinstance(types, list) or len(types) != n_layers:
            raise ConfigError(f"[config] 'layer_types' must be a list of {n_layers} entries")
        for i, x in enumerate(types):
            if x not in ("linear_attention", "full_attention"):
                raise ConfigError(f"[config] layer_types[{i}] is {x!r}; expected 'linear_attention' or 'full_attention'")
        return tuple(types)
    interval = _get(t, "full_attention_interval", int, 4)
    if interval < 1:
        raise ConfigError("[config] 'full_attention_interval' must be at least 1")
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    partial_rotary_factor: float
    # YaRN (transformers' _compute_yarn_parameters); factor 1 = plain RoPE
    yarn_factor: float = 1.0
    yarn_low: float = 0.0  # correction range, in frequency indices
    yarn_high: float = 0.0
    attention_factor: float = 1.0


# Every model of the family defaults to a quarter of each head rotated when the config does not
# say: transformers 5.x's Qwen3_5TextConfig, Qwen3_5MoeTextConfig and Qwen3NextConfig all do
# `kwargs.setdefault("partial_rotary_factor", 0.25)`, and mlx-lm's qwen3_5 ModelArgs defaults to
# 0.25 (its qwen3_next requires the field).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25


def _rope(t: dict, head_dim: int) -> Rope:
    params = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError("[config] 'rope_parameters' must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope", "yarn", None):
        raise ConfigError(f"[config] rope type {rope_type!r} is not supported (default RoPE and 'yarn')")
    theta = params.get("rope_theta", t.get("rope_theta"))
    factor = params.get("partial_rotary_factor", t.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    theta = _get({"rope_theta": theta}, "rope_theta", float)
    factor = _get({"partial_rotary_factor": factor}, "partial_rotary_factor", float)
    if not 0.0 < factor <= 1.0:
        raise ConfigError(f"[config] partial_rotary_factor must be in (0, 1], got {factor}")
    if rope_type != "yarn":
        return Rope(theta, factor)
    return _yarn(params, t, theta, factor, int(head_dim * factor))


def _yarn(params: dict, t: dict, theta: float, partial: float, dim: int) -> Rope:
    """YaRN as transformers 5.x computes it (modeling_rope_utils._compute_yarn_parameters): the
    scalars here, the per-frequency ramp in the native ModelConfig.rope_inv_freq."""
    original = _get(params, "original_max_position_embeddings", int)
    if original < 1:
        raise ConfigError("[config] rope_parameters 'original_max_position_embeddings' must be positive")
    scale = params.get("factor")
    if scale is None:  # DeepSeek-V3's convention, kept by transformers
        scale = _get(t, "max_position_embeddings", int) / original
    scale = _get({"factor": scale}, "factor", float)
    if scale < 1.0:
        raise ConfigError(f"[config] YaRN 'factor' must be at least 1, got {scale}")
    if theta <= 1.0 or dim < 2:
        raise ConfigError(f"[config] YaRN needs rope_theta > 1 and a rotary dimension of at least 2 "
                          f"(rope_theta {theta}, rotary dim {dim})")

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = _get(params, "mscale", float, 0.0), _get(params, "mscale_all_dim", float, 0.0)
        attention = mscale(scale, m) / mscale(scale, m_all) if m and m_all else mscale(scale)
    attention = _get({"attention_factor": attention}, "attention_factor", float)
    beta_fast = _get(params, "beta_fast", float, 0.0) or 32.0
    beta_slow = _get(params, "beta_slow", float, 0.0) or 1.0

    def correction_dim(rotations: float) -> float:  # the frequency index that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return Rope(theta, partial, scale, max(low, 0), min(high, dim - 1), attention)


def parse_config(raw: dict) -> ModelConfig:
    """Reads a config.json dict (top-level or nested text_config) into a ModelConfig."""
    if not isinstance(raw, dict):
        raise ConfigError("[config] config.json must hold a JSON object")
    # The top-level model_type names the checkpoint; a composite (vision + text) release keeps
    # the text model's fields under text_config.
    model_type = raw.get("model_type")
    t = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    # A non-string model_type (a dict or list is unhashable) must not reach the set lookup
    # (found by the tests/fuzz config target).
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"[config] model_type {model_type!r} is not supported; lily runs "
            + ", ".join(sorted(k for k in SUPPORTED_MODEL_TYPES if not k.endswith("_text")))
        )
    family = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_5_text": "qwen3_5"}.get(model_type, model_type)

    n_layers = _get(t, "num_hidden_layers", int)
    if not 1 <= n_layers <= MAX_LAYERS:
        raise ConfigError(f"[config] 'num_hidden_layers' is {n_layers}; lily runs 1 to {MAX_LAYERS} layers")
    layer_types = _layer_types(t, n_layers)
    hidden = _get(t, "hidden_size", int)
    n_heads = _get(t, "num_attention_heads", int)
    head_dim = _get(t, "head_dim", int, hidden // n_heads if n_heads else 0)
    rope = _rope(t, head_dim)
    num_experts = _get(t, "num_experts", int, 0)

    if family == "qwen3_5_moe":
        ffn_types = ("moe",) * n_layers
    elif family == "qwen3_5":
        ffn_types = ("dense",) * n_layers
    else:  # qwen3_next: per-layer dense / sparse choice
        mlp_only = t.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise ConfigError("[config] 'mlp_only_layers' must be a list of layer indices")
        step = _get(t, "decoder_sparse_step", int, 1)
        if step < 1:
            raise ConfigError("[config] 'decoder_sparse_step' must be at least 1")
        ffn_types = tuple(
            "moe" if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else "dense"
            for i in range(n_layers)
        )

    eos = raw.get("eos_token_id", t.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    quant = raw.get("quantization", raw.get("quantization_config"))
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError("[config] 'quantization' must be an object")
    if quant is not None and quant.get("quant_method") == "fp8":
        block = quant.get("weight_block_size")
        raise ConfigError(
            f"[config] this is an FP8 checkpoint (quantization_config quant_method 'fp8', fmt "
            f"{quant.get('fmt', 'e4m3')!r}, block scales {block!r} in '*.weight_scale_inv'), which lily does not "
            "run directly: convert it with `lily convert SRC --out DST` (MLX affine 4/8-bit) and load DST"
        )
    if quant is not None and quant.get("quant_method") not in (None, "mlx"):
        raise ConfigError(f"[config] quantization_config quant_method {quant.get('quant_method')!r} is not supported "
                          "(lily runs MLX affine-quantized checkpoints, and FP8 ones after `lily convert`)")
    if quant is not None:
        for where, entry in [("quantization", quant)] + [(f"quantization[{k!r}]", v) for k, v in quant.items()
                                                         if isinstance(v, dict)]:
            if entry.get("mode", "affine") not in QUANT_MODES:
                raise ConfigError(f"[config] {where} mode {entry.get('mode')!r} is not supported "
                                  f"({', '.join(QUANT_MODES)})")

    cfg = ModelConfig(
        model_type=model_type,
        architecture=family,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        vocab_size=_get(t, "vocab_size", int),
        layer_types=layer_types,
        ffn_types=ffn_types,
        rms_norm_eps=_get(t, "rms_norm_eps", float, 1e-6),
        max_position_embeddings=_get(t, "max_position_embeddings", int, 262144),
        # mlx-lm reads it from the text config (its TextModelArgs); a composite's top level second.
        tie_word_embeddings=bool(t.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        num_attention_heads=n_heads,
        num_key_value_heads=_get(t, "num_key_value_heads", int),
        head_dim=head_dim,
        rotary_dim=int(head_dim * rope.partial_rotary_factor),
        rope_theta=rope.theta,
        yarn_factor=rope.yarn_factor,
        yarn_low=rope.yarn_low,
        yarn_high=rope.yarn_high,
        rope_attention_factor=rope.attention_factor,
        linear_num_key_heads=_get(t, "linear_num_key_heads", int),
        linear_num_value_heads=_get(t, "linear_num_value_heads", int),
        linear_key_head_dim=_get(t, "linear_key_head_dim", int),
        linear_value_head_dim=_get(t, "linear_value_head_dim", int),
        linear_conv_kernel_dim=_get(t, "linear_conv_kernel_dim", int, 4),
        intermediate_size=_get(t, "intermediate_size", int, 0),
        num_experts=num_experts,
        num_experts_per_tok=_get(t, "num_experts_per_tok", int, 0),
        moe_intermediate_size=_get(t, "moe_intermediate_size", int, 0),
        shared_expert_intermediate_size=_get(t, "shared_expert_intermediate_size", int, 0),
        # Qwen3.5 MoE always renormalises the top-k weights; Qwen3-Next says so in its config.
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        quantization=quant,
        eos_token_id=eos_ids,
    )
    cfg.to_native()  # native validation: head divisibility, rotary dim, ...
    return cfg


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not os.path.lexists(path):
        raise ConfigError(f"[config] no config.json in {model_dir}")
    # A regular file only (a FIFO would block the open forever), JSON of any depth or number
    # size failing as a ConfigError (lily.files).
    return parse_config(read_json(path, ConfigError, prefix="[config] "))
