"""Bad checkpoints must fail at load with a clear Python exception that names the culprit;
unusual but valid ones (extra `mtp.*` / vision tensors, several shards) must load and compute.

Each test damages a private copy of a valid tiny checkpoint in exactly one way (byte-level
header surgery from fixtures/safetensors_edit.py, or a rewrite with the safetensors library)
and expects lily.CheckpointError (files, headers, tensors) or lily.ConfigError (config.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fixtures import cases
from fixtures import safetensors_edit as st
from fixtures.references import rel_err

P = "model.language_model."  # HF qwen3_5_moe prefix
L0 = P + "layers.0."


@pytest.fixture
def ckpt(store, request) -> Path:
    """A private copy of the valid fused qwen3_5_moe fp32 checkpoint."""
    return store.copy(store.hf("qwen3_5_moe", "fused"), request.node.name)


def _file(d: Path) -> Path:
    return d / "model.safetensors"


def _rewrite(d: Path, fn) -> None:
    """Load all tensors, let fn edit the dict, save again (a well-formed file)."""
    from safetensors.numpy import load_file, save_file

    t = load_file(str(_file(d)))
    fn(t)
    save_file(t, str(_file(d)), metadata={"format": "pt"})


def _raises(exc, d: Path, *names: str):
    """Model.load(d) raises `exc` and the message contains at least one of `names`."""
    import lily

    with pytest.raises(exc) as info:
        lily.Model.load(d)
    msg = str(info.value)
    assert any(n in msg for n in names), f"message {msg!r} names none of {names}"
    return msg


def test_error_classes(lily):
    for cls in (lily.CheckpointError, lily.ConfigError):
        assert issubclass(cls, lily.LilyError) and issubclass(cls, ValueError)


# ---------------------------------------------------------------------------------------------
# Files and headers
# ---------------------------------------------------------------------------------------------

def test_truncated_file(ckpt, lily):
    f = _file(ckpt)
    header, data = st.read(f)
    start = os.path.getsize(f) - len(data)          # where the data section begins
    cut = start + len(data) // 2
    with open(f, "r+b") as fh:
        fh.truncate(cut)
    # Names the file, or a tensor whose bytes are now past the end.
    past = [k for k, v in header.items()
            if k != "__metadata__" and v["data_offsets"][1] > cut - start]
    _raises(lily.CheckpointError, ckpt, f.name, *past)


def test_header_length_past_end(ckpt, lily):
    f = _file(ckpt)
    header, data = st.read(f)
    st.write(f, header, data, header_len=os.path.getsize(f) + 4096)
    _raises(lily.CheckpointError, ckpt, f.name)


def test_header_not_json(ckpt, lily):
    f = _file(ckpt)
    raw = bytearray(f.read_bytes())
    raw[8:12] = b"\x00\xff{["
    f.write_bytes(bytes(raw))
    _raises(lily.CheckpointError, ckpt, f.name)


def test_tensor_offset_past_end(ckpt, lily):
    f = _file(ckpt)
    name = L0 + "linear_attn.in_proj_z.weight"

    def lie(h):
        b, e = h[name]["data_offsets"]
        _, data = st.read(f)
        h[name]["data_offsets"] = [b + len(data), e + len(data)]  # same size, past the end
    st.edit_header(f, lie)
    _raises(lily.CheckpointError, ckpt, name)


def test_size_inconsistent_with_dtype_and_shape(ckpt, lily):
    name = L0 + "linear_attn.out_proj.weight"

    def lie(h):
        assert h[name]["dtype"] == "F32"
        h[name]["dtype"] = "F16"  # the offsets now span twice dtype x shape
    st.edit_header(_file(ckpt), lie)
    _raises(lily.CheckpointError, ckpt, name)


def test_overlapping_tensors(ckpt, lily):
    a, b = L0 + "input_layernorm.weight", L0 + "post_attention_layernorm.weight"

    def lie(h):
        h[b]["data_offsets"] = list(h[a]["data_offsets"])  # b now aliases a's bytes
    st.edit_header(_file(ckpt), lie)
    _raises(lily.CheckpointError, ckpt, a, b)


def test_no_safetensors_file(ckpt, lily):
    _file(ckpt).unlink()
    _raises(lily.CheckpointError, ckpt, ".safetensors", str(ckpt))


def test_index_names_missing_shard(ckpt, lily):
    names = st.tensor_names(_file(ckpt))
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"][L0 + "linear_attn.A_log"] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _raises(lily.CheckpointError, ckpt, "model-00002-of-00002.safetensors")


# ---------------------------------------------------------------------------------------------
# Tensor set and shapes
# ---------------------------------------------------------------------------------------------

def test_missing_tensor(ckpt, lily):
    name = L0 + "linear_attn.A_log"
    _rewrite(ckpt, lambda t: t.pop(name))
    _raises(lily.CheckpointError, ckpt, name)


def test_missing_expert_tensor(ckpt, lily):
    name = P + "layers.2.mlp.experts.down_proj"
    _rewrite(ckpt, lambda t: t.pop(name))
    _raises(lily.CheckpointError, ckpt, name)


def test_extra_unknown_tensor(ckpt, lily):
    name = L0 + "mlp.mystery_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, np.zeros((4, 4), np.float32)))
    _raises(lily.CheckpointError, ckpt, name)


@pytest.mark.parametrize("name, shape", [
    (L0 + "linear_attn.in_proj_z.weight", (576, 191)),
    (P + "layers.3.self_attn.q_proj.weight", (576, 192)),     # query without its gate half
    (P + "layers.1.mlp.experts.gate_up_proj", (7, 192, 192)),  # gate only
    (P + "layers.0.linear_attn.conv1d.weight", (864, 1, 3)),
    (P + "norm.weight", (191,)),
])
def test_wrong_shape(ckpt, lily, name, shape):
    _rewrite(ckpt, lambda t: t.__setitem__(name, np.zeros(shape, np.float32)))
    _raises(lily.CheckpointError, ckpt, name)


def test_quantized_scales_wrong_shape(store, lily, request):
    d = store.copy(store.mlx("qwen3_5_moe", 4), request.node.name)
    name = "language_model.model.layers.0.linear_attn.in_proj_z.scales"

    def fn(t):
        assert t[name].shape == (576, 3)
        t[name] = np.ones((576, 2), np.float32)
    _rewrite(d, fn)
    _raises(lily.CheckpointError, d, name)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

def _edit_config(d: Path, fn) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def test_unknown_model_type(ckpt, lily):
    _edit_config(ckpt, lambda c: c.__setitem__("model_type", "llama_x9"))
    _raises(lily.ConfigError, ckpt, "llama_x9")


def test_missing_config(ckpt, lily):
    (ckpt / "config.json").unlink()
    _raises((lily.ConfigError, lily.CheckpointError), ckpt, "config.json")


def test_config_not_json(ckpt, lily):
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_moe", ')
    _raises(lily.ConfigError, ckpt, "config.json")


def test_config_missing_field(ckpt, lily):
    _edit_config(ckpt, lambda c: c["text_config"].pop("hidden_size"))
    _raises(lily.ConfigError, ckpt, "hidden_size")


def test_config_unknown_layer_type(ckpt, lily):
    _edit_config(ckpt, lambda c: c["text_config"]["layer_types"].__setitem__(1, "sliding_window"))
    _raises(lily.ConfigError, ckpt, "sliding_window")


# ---------------------------------------------------------------------------------------------
# Valid variants that must load and compute the same logits
# ---------------------------------------------------------------------------------------------

def test_mtp_and_vision_tensors_are_skipped(ckpt, store, lily):
    """Released checkpoints carry a vision tower (already in this fixture) and MTP layers."""
    from safetensors.numpy import load_file

    t = load_file(str(_file(ckpt)))
    assert any(k.startswith("model.visual.") for k in t), "fixture lost its vision tower"
    h = 192
    extra = {
        "mtp.fc.weight": np.ones((h, 2 * h), np.float32),
        "mtp.norm.weight": np.ones((h,), np.float32),
        "mtp.pre_fc_norm_embedding.weight": np.ones((h,), np.float32),
        "mtp.pre_fc_norm_hidden.weight": np.ones((h,), np.float32),
        "mtp.layers.0.self_attn.q_proj.weight": np.ones((1152, h), np.float32),
        "mtp.layers.0.mlp.experts.gate_up_proj": np.ones((7, 384, h), np.float32),
    }
    _rewrite(ckpt, lambda t: t.update(extra))
    ref = store.hf_reference(store.hf("qwen3_5_moe", "fused"))
    got = lily.Model.load(ckpt, cpu_matmul="f32").logits(cases.PROMPT)
    assert rel_err(got, ref.prompt) <= cases.TOL_FP32


def test_sharded_checkpoint(ckpt, store, lily):
    """Several shards + model.safetensors.index.json, as released checkpoints are stored."""
    from safetensors.numpy import load_file, save_file

    t = load_file(str(_file(ckpt)))
    _file(ckpt).unlink()
    names = sorted(t)
    shards = [names[i::3] for i in range(3)]  # interleaved: every layer spans all shards
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in t.values()))},
             "weight_map": {}}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: t[k] for k in part}, str(ckpt / fname), metadata={"format": "pt"})
        index["weight_map"].update({k: fname for k in part})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    ref = store.hf_reference(store.hf("qwen3_5_moe", "fused"))
    got = lily.Model.load(ckpt, cpu_matmul="f32").logits(cases.PROMPT)
    assert rel_err(got, ref.prompt) <= cases.TOL_FP32
