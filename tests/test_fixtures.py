"""The fixtures themselves: the two references agree with each other, and the tiny checkpoints
exercise what they claim to. These pass without lily; if one fails, a lily test failure could
be the fixture's fault, so they run first in CI output order (file name)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fixtures import cases
from fixtures import references as ref
from fixtures import safetensors_edit as st


@pytest.mark.parametrize("model_type", cases.MLX_FP32_CASES)
def test_mlx_lm_matches_transformers_fp32(model_type, store):
    """mlx-lm on its own fp32 conversion vs transformers on the HF source (measured ~3e-6)."""
    path = store.mlx(model_type, None)
    hf = store.hf_reference(path.with_name(path.name + ".hf"))
    got = ref.mlx_logits(ref.mlx_load(path), cases.PROMPT)
    assert ref.rel_err(got, hf.prompt) <= 1e-5


# The same weights in two layouts go through different transformers code (a fused expert
# GEMM vs a loop over experts), so the float32 sums run in another order: equal on one CPU,
# ~2e-6 apart on another (CI's AMD EPYC). Same model = equal up to float32 summation order.
SAME_MODEL_REL = 1e-5


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_next"])
def test_expert_layouts_hold_the_same_model(model_type, store):
    a = store.hf_reference(store.hf(model_type, "fused")).prompt
    b = store.hf_reference(store.hf(model_type, "per_expert")).prompt
    assert ref.rel_err(a, b) <= SAME_MODEL_REL


def test_text_only_class_holds_the_same_model(store):
    a = store.hf_reference(store.hf("qwen3_5_moe", "fused")).prompt
    b = store.hf_reference(store.hf("qwen3_5_moe_text", "per_expert")).prompt
    assert ref.rel_err(a, b) <= SAME_MODEL_REL


@pytest.mark.parametrize("model_type, layout", [("qwen3_5_moe", "fused"), ("qwen3_5", None),
                                                ("qwen3_next", "per_expert")])
def test_tiny_checkpoint_exercises_the_conversions(model_type, layout, store):
    from safetensors.numpy import load_file

    path = store.hf(model_type, layout)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert {"linear_attention", "full_attention"} <= set(text["layer_types"])
    assert text["full_attention_interval"] == 4
    rot = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"])
    assert rot % 2 == 0 and text["rope_parameters"]["rope_theta"] == 1e7
    for k in ("num_attention_heads", "head_dim", "linear_num_key_heads", "linear_key_head_dim"):
        assert text[k] & (text[k] - 1), f"{k} = {text[k]} is a power of two"
    t = load_file(str(path / "model.safetensors"))
    zero_centred = [k for k in t if k.endswith(("layernorm.weight", "q_norm.weight",
                                                 "k_norm.weight", "model.norm.weight"))]
    assert zero_centred and all(np.abs(t[k]).min() > 0 and np.abs(t[k]).max() > 0.2
                                for k in zero_centred)
    gated = [k for k in t if k.endswith("linear_attn.norm.weight")]
    assert gated and all(np.abs(t[k] - 1).max() > 0.2 for k in gated)
    assert all(np.ptp(t[k]) > 0.5 for k in t if k.endswith(("dt_bias", "A_log")))


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5", "qwen3_next"])
def test_quantized_checkpoint_quantizes_every_linear(model_type, store):
    """mlx_lm skips a Linear whose input dim is not a multiple of the group size; the tiny
    dims are chosen so that never happens (else the 4-bit tests would test less)."""
    path = store.mlx(model_type, 4)
    header, _ = st.read(path / "model.safetensors")
    names = [k for k in header if k != "__metadata__"]
    plain = [k for k in names if k.endswith(".weight") and header[k]["dtype"] != "U32"
             and len(header[k]["shape"]) >= 2 and "conv1d" not in k]
    assert plain == []
    q = json.loads((path / "config.json").read_text())["quantization"]
    assert q["bits"] == 4 and q["group_size"] == 64
    if model_type != "qwen3_5":  # MoE: router and shared-expert gate at 8 bits
        eight = [k for k, v in q.items() if isinstance(v, dict) and v.get("bits") == 8]
        assert any(k.endswith("mlp.gate") for k in eight)
        assert any(k.endswith("mlp.shared_expert_gate") for k in eight)
