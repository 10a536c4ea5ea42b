#!/usr/bin/env python3
"""Random-weight checkpoints of the real Qwen3.5 / Qwen3.6 / Qwen3-Next architectures.

Importable module and CLI:

    python scripts/make_checkpoint.py --model-type qwen3_5_moe --size tiny --out DIR \
        [--quantize 4|8 --group-size 64 --scale-dtype float32|bfloat16] \
        [--expert-layout fused|per_expert] [--layers N] [--seed S] [--vocab V]

Design choices:
- The model is built by Hugging Face transformers from a config of the real architecture and saved
  with `save_pretrained`, so the tensor names, shapes and config.json are the ones transformers
  (and therefore the released checkpoints) use. Nothing here re-implements the model.
- Every parameter is filled from its own generator seeded by (seed, canonical name), where the
  canonical name drops the composite prefix (`model.language_model.` -> `model.`). The same seed
  therefore gives the same numbers whatever the wrapper class or expert layout, and a test can
  compare layouts against each other.
- The values are chosen so the conversions a loader must do are exercised: zero-centred norm
  weights are non-zero (a loader that forgets the 1+w fails), the gated DeltaNet norm has a
  plain gain far from 1, dt_bias and A_log are random, and the lm_head is scaled so logits have a
  spread of a few units (top-1 margins far above fp32 noise, so greedy comparisons are stable).
- Dims of `tiny` are small and not powers of two where the architecture allows, but every
  matmul input dimension is a multiple of 64 so mlx_lm quantizes every Linear at group size
  32 or 64 (mlx_lm silently leaves a layer unquantized when its input dim is not a multiple of
  the group size; a fixture that did so would test less than it claims).
- Quantization uses mlx_lm's own code path (load_model -> optional dtype cast ->
  quantize_model -> save_model / save_config), i.e. `mlx_lm.convert` minus the tokenizer, which
  these checkpoints do not have. Scales follow the weight dtype as in mlx_lm: float32 weights give
  float32 scales; --scale-dtype bfloat16 casts first, as a release conversion from bf16 would.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import zlib
from pathlib import Path

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_next")
SIZES = ("tiny", "medium")

# ---------------------------------------------------------------------------------------------
# Dimensions
# ---------------------------------------------------------------------------------------------

# tiny: a few layers, odd head counts/dims; every Linear input dim (hidden 192, attention
# 6 x 96 = 576, DeltaNet values 6 x 96 = 576, experts 192, shared 128, dense 320) is a multiple
# of 64. RoPE rotates 96 * 0.25 = 24 dims (even). GQA ratio 3, DeltaNet value/key head ratio 2.
_TINY = dict(
    vocab_size=503,
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=96,
    linear_num_key_heads=3,
    linear_num_value_heads=6,
    linear_key_head_dim=48,
    linear_value_head_dim=96,
    linear_conv_kernel_dim=4,
    num_experts=7,
    num_experts_per_tok=3,
    moe_intermediate_size=192,
    shared_expert_intermediate_size=128,
    intermediate_size=320,
)

# medium: the real Qwen3.6-35B-A3B per-layer dims (Qwen3-Next-80B-A3B: 512 experts top-10).
_MEDIUM = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    intermediate_size=6144,
)


def _dims(model_type: str, size: str) -> dict:
    d = dict(_TINY if size == "tiny" else _MEDIUM)
    if model_type == "qwen3_next" and size == "medium":
        d.update(num_experts=512, num_experts_per_tok=10)
    return d


def _rope_parameters(head_dim: int) -> dict:
    # Real checkpoints: rope_theta 1e7, partial_rotary_factor 0.25, mrope_section [11, 11, 10]
    # (sums to rotary_dim / 2 = 32). For text the three mrope sections see the same position, so
    # this is plain RoPE; scale the sections to our rotary dim so they stay consistent.
    rot_half = int(head_dim * 0.25) // 2
    a = round(rot_half * 11 / 32)
    sections = [a, a, rot_half - 2 * a]
    return {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": sections,
        "mrope_interleaved": True,
    }


def _layer_types(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def build_config(model_type: str, size: str = "tiny", layers: int | None = None,
                 vocab_size: int | None = None):
    """A transformers config of the real architecture with our dims. Returns (config, interval)."""
    import transformers as tf

    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; expected one of {MODEL_TYPES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    d = _dims(model_type, size)
    n = layers or d["num_hidden_layers"]
    # Full attention at (i+1) % interval == 0, as the real models (interval 4). With fewer than
    # 4 layers the last layer is attention so both mixers always exist.
    interval = 4 if n >= 4 else n
    if n < 2:
        raise ValueError("need at least 2 layers (one DeltaNet and one attention layer)")
    text = dict(
        vocab_size=vocab_size or d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=n,
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"],
        linear_num_key_heads=d["linear_num_key_heads"],
        linear_num_value_heads=d["linear_num_value_heads"],
        linear_key_head_dim=d["linear_key_head_dim"],
        linear_value_head_dim=d["linear_value_head_dim"],
        linear_conv_kernel_dim=d["linear_conv_kernel_dim"],
        layer_types=_layer_types(n, interval),
        rope_parameters=_rope_parameters(d["head_dim"]),
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=248046 if (vocab_size or d["vocab_size"]) > 248046 else None,
        pad_token_id=None,
    )
    moe = dict(
        num_experts=d["num_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
    )
    # A small vision tower: present so loaders prove they skip it, cheap to build.
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=d["hidden_size"], patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16)

    if model_type == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeConfig(text_config=dict(**text, **moe), vision_config=vision)
    elif model_type == "qwen3_5_moe_text":
        cfg = tf.Qwen3_5MoeTextConfig(**text, **moe)
    elif model_type == "qwen3_5":
        cfg = tf.Qwen3_5Config(text_config=dict(**text, intermediate_size=d["intermediate_size"]),
                               vision_config=vision)
    else:  # qwen3_next: one dense-MLP layer (mlp_only_layers) to test the per-layer option
        rp = dict(text["rope_parameters"])
        rp.pop("mrope_section")
        rp.pop("mrope_interleaved")
        text["rope_parameters"] = rp
        cfg = tf.Qwen3NextConfig(**text, **moe, intermediate_size=d["intermediate_size"],
                                 decoder_sparse_step=1, mlp_only_layers=[1],
                                 norm_topk_prob=True)
    return cfg, interval


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

def canonical_name(name: str) -> str:
    """Parameter name without the composite wrapper prefix (same numbers in every layout)."""
    return name.replace("model.language_model.", "model.")


def _fill(name: str, shape: tuple[int, ...], seed: int):
    """Deterministic values for one parameter (float32 torch tensor); rules by role."""
    import torch

    g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(name.encode())) & 0x7FFFFFFF)

    def normal(std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    def uniform(lo, hi):
        return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

    leaf = name.rsplit(".", 1)[-1]
    if "visual" in name:
        return normal(0.05)
    if name.endswith("linear_attn.norm.weight"):       # gated RMSNorm: plain gain w
        return uniform(0.5, 1.5)
    if name.endswith("norm.weight"):                   # zero-centred RMSNorm: (1 + w)
        return uniform(-0.5, 0.5)
    if leaf == "dt_bias":
        return uniform(-1.0, 1.5)
    if leaf == "A_log":                                # A in [0.3, 8]: decays exp(-A softplus)
        return torch.log(uniform(0.3, 8.0))
    if name.endswith("conv1d.weight"):                 # [C, 1, K]
        return uniform(-0.6, 0.6)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("lm_head.weight"):                # logits spread of ~3
        return normal(3.0 / math.sqrt(shape[-1]))
    if name.endswith("mlp.gate.weight"):               # router: decisive but not one-hot
        return normal(2.0 / math.sqrt(shape[-1]))
    if len(shape) >= 2:                                # Linear [out, in] / experts [E, out, in]
        return normal(1.0 / math.sqrt(shape[-1]))
    return normal(0.1)                                 # any other vector (biases)


def randomize(model, seed: int) -> None:
    """Overwrite every parameter of `model` with _fill values (in place, no grad)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            v = _fill(canonical_name(name), tuple(p.shape), seed)
            p.copy_(v.to(p.dtype))


def build_model(model_type: str, size: str = "tiny", layers: int | None = None,
                vocab_size: int | None = None, seed: int = 0, dtype: str = "float32"):
    """The transformers model (eval mode) with deterministic random weights."""
    import torch
    import transformers as tf

    cfg, _ = build_config(model_type, size, layers, vocab_size)
    cls = {
        "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration,
        "qwen3_5_moe_text": tf.Qwen3_5MoeForCausalLM,
        "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
        "qwen3_next": tf.Qwen3NextForCausalLM,
    }[model_type]
    # Built on the CPU as transformers builds it (buffers such as the rotary inv_freq come out
    # right), in the target dtype so a medium model never exists in fp32; then overwritten.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        # transformers' own init is skipped (every parameter is overwritten below; buffers such
        # as the rotary inv_freq are computed in __init__ and unaffected): minutes on medium.
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    # Released bf16 checkpoints keep the DeltaNet A_log in fp32 (so do mlx_lm conversions, via
    # its cast_predicate); a mixed-dtype file is what a loader meets.
    for mod in model.modules():
        if isinstance(getattr(mod, "A_log", None), torch.nn.Parameter):
            mod.A_log.data = mod.A_log.data.float()
    randomize(model, seed)
    model.config.use_cache = True
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------

def _expert_tensors(name: str, t, layout: str | None):
    """(name, tensor) pairs to write for one state-dict entry, in the asked expert layout.

    transformers 5 keeps experts fused in memory (`<p>.mlp.experts.gate_up_proj` [E, 2I, H],
    gate = rows [0, I); `<p>.mlp.experts.down_proj` [E, H, I]) and splits them per expert only
    when it saves. Layouts written here:
      fused:      the in-memory tensors as they are (released Qwen3.5/3.6 checkpoints)
      per_expert: <p>.mlp.experts.{e}.{gate,up}_proj.weight [I, H], .down_proj.weight [H, I]
                  (the Qwen3-Next release; what transformers' save_pretrained writes)
    """
    if layout is None or not name.endswith((".mlp.experts.gate_up_proj",
                                            ".mlp.experts.down_proj")):
        return [(name, t)]
    if layout == "fused":
        return [(name, t)]
    if layout != "per_expert":
        raise ValueError(f"unknown expert layout {layout!r}")
    p = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):
        i = t.shape[1] // 2
        return [x for e in range(t.shape[0])
                for x in ((f"{p}.{e}.gate_proj.weight", t[e, :i]),
                          (f"{p}.{e}.up_proj.weight", t[e, i:]))]
    return [(f"{p}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]


def _write_safetensors(out: Path, tensors, shard_bytes: int) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors + index when over shard_bytes
    (released checkpoints are sharded; a shard at a time bounds the serialization copy)."""
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for k, v in tensors:
        nb = v.numel() * v.element_size()
        if cur and size + nb > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + nb
    shards.append(cur)
    if len(shards) == 1:
        save_file({k: v.contiguous() for k, v in shards[0].items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in sh.items()}, str(out / fname),
                  metadata={"format": "pt"})
        for k, v in sh.items():
            index["weight_map"][k] = fname
            index["metadata"]["total_size"] += v.numel() * v.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _patch_config(path: Path, model_type: str, interval: int) -> None:
    """Fields the released config.json files carry that transformers 5 no longer writes."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg)
    # Released Qwen3.5/3.6 configs carry both layer_types and full_attention_interval; mlx_lm
    # builds its layer schedule from full_attention_interval only.
    text["full_attention_interval"] = interval
    if model_type == "qwen3_next":
        # The Qwen3-Next release config (and mlx_lm's qwen3_next ModelArgs, where they are
        # required) has rope_theta / partial_rotary_factor at top level.
        rp = text.get("rope_parameters") or {}
        text["rope_theta"] = rp.get("rope_theta", 10000000.0)
        text["partial_rotary_factor"] = rp.get("partial_rotary_factor", 0.25)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model, out: Path, model_type: str, interval: int,
                    expert_layout: str | None = None, shard_bytes: int = 2 << 30) -> Path:
    """config.json + generation_config.json + safetensors of `model` in `out`.

    The tensors come straight from the state dict (names as transformers saves them; checked
    equal to `save_pretrained`'s for every model type) in the asked expert layout, without the
    save-then-reload a relayout would need: a medium model never exists twice in memory.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in list(out.glob("*.safetensors")) + list(out.glob("*.index.json")):
        f.unlink()
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(str(out))
    eos = model.config.get_text_config().eos_token_id
    gen = {"do_sample": False, "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _patch_config(out, model_type, interval)
    state = model.state_dict()
    tensors = (x for k in sorted(state) for x in _expert_tensors(k, state[k], expert_layout))
    _write_safetensors(out, tensors, shard_bytes)
    return out


def default_expert_layout(model_type: str) -> str | None:
    """The layout the real checkpoints of each type use."""
    return {"qwen3_5_moe": "fused", "qwen3_5_moe_text": "per_expert",
            "qwen3_next": "per_expert", "qwen3_5": None}[model_type]


# ---------------------------------------------------------------------------------------------
# MLX quantization (mlx_lm's converter, minus the tokenizer)
# ---------------------------------------------------------------------------------------------

def quantize_checkpoint(src: Path, dst: Path, bits: int | None = 4, group_size: int = 64,
                        scale_dtype: str | None = None) -> Path:
    """Convert an HF-layout checkpoint `src` to MLX in `dst` with mlx_lm (affine `bits`-bit,
    or unquantized MLX names/layout when `bits` is None).

    Mirrors mlx_lm.convert.convert(quantize=True): load_model (runs the model's sanitize: key
    renames, expert stacking, conv1d transpose, norm +1) -> cast to `scale_dtype` if given (the
    cast_predicate keeps A_log in fp32) -> quantize_model (the model's quant_predicate: router
    and shared_expert_gate 8-bit g64) -> save_model + save_config. `scale_dtype` None = mlx_lm's
    default (the config dtype; float32 for our fp32 checkpoints).
    """
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    model, config = load_model(src, lazy=True)
    if scale_dtype is not None:
        dt = getattr(mx, scale_dtype)
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, group_size, bits)
    save_model(dst, model, donate_model=True)
    save_config(config, config_path=dst / "config.json")
    for f in ("generation_config.json",):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return dst


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def make_checkpoint(model_type: str, out, size: str = "tiny", *, layers: int | None = None,
                    seed: int = 0, vocab_size: int | None = None,
                    expert_layout: str | None = None, quantize: int | None = None,
                    group_size: int = 64, scale_dtype: str | None = None,
                    dtype: str | None = None, mlx: bool = False,
                    shard_bytes: int = 2 << 30) -> Path:
    """Build, randomize and save one checkpoint; convert it to MLX (quantized to `quantize`
    bits, or unquantized with `mlx=True`) if asked.

    With an MLX conversion, `out` holds the MLX checkpoint and the HF source goes to `out`.hf.
    """
    out = Path(out)
    dtype = dtype or ("bfloat16" if size == "medium" else "float32")
    model = build_model(model_type, size, layers, vocab_size, seed, dtype)
    _, interval = build_config(model_type, size, layers, vocab_size)
    layout = expert_layout or default_expert_layout(model_type)
    if quantize is None and not mlx:
        return save_checkpoint(model, out, model_type, interval, layout, shard_bytes)
    if model_type == "qwen3_5_moe_text":
        raise ValueError("mlx_lm has no qwen3_5_moe_text model; quantize qwen3_5_moe instead")
    hf = out.with_name(out.name + ".hf")
    # mlx_lm's qwen3_5_moe sanitize needs the fused layout; qwen3_next's the per-expert one.
    mlx_layout = {"qwen3_5_moe": "fused", "qwen3_next": "per_expert"}.get(model_type)
    save_checkpoint(model, hf, model_type, interval, mlx_layout, shard_bytes)
    del model
    return quantize_checkpoint(hf, out, quantize, group_size, scale_dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-type", choices=MODEL_TYPES)
    ap.add_argument("--from-hf", metavar="DIR",
                    help="convert this existing HF checkpoint with --quantize/--mlx instead of "
                         "building one (e.g. a medium model made earlier)")
    ap.add_argument("--size", default="tiny", choices=SIZES)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, help="vocab size (medium default 248320)")
    ap.add_argument("--expert-layout", choices=("fused", "per_expert"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="weight dtype of the HF checkpoint (tiny: float32, medium: bfloat16)")
    ap.add_argument("--shard-mb", type=int, default=2048,
                    help="max MiB per safetensors shard (more -> index.json + shards)")
    ap.add_argument("--quantize", type=int, choices=(2, 3, 4, 5, 6, 8),
                    help="convert to MLX affine-quantized (the HF source is kept in OUT.hf)")
    ap.add_argument("--mlx", action="store_true",
                    help="convert to MLX names/layout without quantizing")
    ap.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--scale-dtype", choices=("float32", "bfloat16", "float16"),
                    help="dtype to cast to before quantizing (sets the scales/biases dtype)")
    a = ap.parse_args(argv)
    if a.from_hf:
        if a.quantize is None and not a.mlx:
            ap.error("--from-hf needs --quantize BITS or --mlx")
        print(quantize_checkpoint(Path(a.from_hf), Path(a.out), a.quantize, a.group_size,
                                  a.scale_dtype))
        return 0
    if a.model_type is None:
        ap.error("--model-type is required (unless --from-hf)")
    p = make_checkpoint(a.model_type, a.out, a.size, layers=a.layers, seed=a.seed,
                        vocab_size=a.vocab, expert_layout=a.expert_layout, quantize=a.quantize,
                        group_size=a.group_size, scale_dtype=a.scale_dtype, dtype=a.dtype,
                        mlx=a.mlx, shard_bytes=a.shard_mb << 20)
    print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
