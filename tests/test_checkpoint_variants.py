"""Checkpoint variants users have (issue 20, "Checkpoints"), each from a fixture built with the real
libraries and compared with those libraries:

- re-saved derivatives nesting the vision tower and MTP layer under the language model;
- MLX mixed quantization whose config.json lost the per-module entries (mlx-lm infers them);
- MLX's mxfp4 / mxfp8 / nvfp4 modes, nvfp4 also with mlx-lm's per-expert global scales;
- Qwen's FP8 layout (float8_e4m3fn weights, 128x128 `weight_scale_inv` blocks) written with torch;
- RoPE: the 0.25 partial_rotary_factor default, YaRN `rope_scaling`, tie_word_embeddings from the
  text config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fixtures import cases
from fixtures import references as ref
from fixtures.references import rel_err


def _load_all(d: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _save(d: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(d: Path, fn) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), f"{n} differs"


# -- re-saved derivatives -----------------------------------------------------------------------

def test_resaved_layout_nesting_vision_and_mtp_loads_and_converts(store, lily, tmp_path):
    """`model.language_model.visual.*` / `model.language_model.mtp.*` (fine-tuned and abliterated
    re-saves): skipped once the language-model prefix is stripped, by the loader and by convert."""
    from lily.convert import convert

    src = store.hf("qwen3_5_moe", "fused")
    d = store.copy(src, "resaved")
    t = _load_all(d)
    visual = [k for k in t if k.startswith("model.visual.")]
    assert visual, "fixture lost its vision tower"
    nested = {("model.language_model." + k[len("model."):] if k in visual else k): v for k, v in t.items()}
    h = 192
    nested.update({
        "model.language_model.mtp.fc.weight": np.ones((h, 2 * h), np.float32),
        "model.language_model.mtp.norm.weight": np.ones((h,), np.float32),
        "model.language_model.mtp.layers.0.self_attn.q_proj.weight": np.ones((1152, h), np.float32),
    })
    _save(d, nested)
    assert any(k.startswith("model.language_model.visual.") for k in _load_all(d))

    want = store.hf_reference(src)
    got = lily.Model.load(d, cpu_matmul="f32").logits(cases.PROMPT)
    assert rel_err(got, want.prompt) <= cases.TOL_FP32

    # lily convert of the re-save == lily convert of the release (itself byte-identical to
    # mlx_lm.convert, tests/test_convert.py)
    a = convert(d, tmp_path / "resaved-mlx", progress=False)
    b = convert(src, tmp_path / "release-mlx", progress=False)
    _same_files(a, b)


# -- mixed quantization without per-module entries ------------------------------------------------

MIXED = {"self_attn.": {"group_size": 32, "bits": 8}, "linear_attn.out_proj": {"group_size": 32, "bits": 6},
         "switch_mlp.down_proj": {"group_size": 64, "bits": 2}}


@pytest.fixture(scope="module")
def mixed(store):
    """An mlx-lm quantization of the tiny MoE with three module kinds at other bits / group sizes
    (its quant_predicate), and a copy whose config.json lost every per-module entry."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src = store.hf("qwen3_5_moe", "fused")
    out = store.root / "mixed-q4"
    model, config = load_model(src, lazy=True)

    def predicate(path, module):
        for key, params in MIXED.items():
            if key in path:
                return params
        return model.quant_predicate(path, module)

    model, config = quantize_model(model, config, 64, 4, quant_predicate=predicate)
    save_model(out, model, donate_model=True)
    save_config(config, config_path=out / "config.json")
    bare = store.copy(out, "mixed-q4-no-entries")

    def strip(c):
        for key in ("quantization", "quantization_config"):
            c[key] = {k: v for k, v in c[key].items() if not isinstance(v, dict)}
    _edit_config(bare, strip)
    return out, bare


def test_mixed_quantization_infers_bits_from_shapes(mixed, lily):
    full, bare = mixed
    cfg = json.loads((full / "config.json").read_text())["quantization"]
    assert {v["bits"] for v in cfg.values() if isinstance(v, dict)} == {2, 6, 8}  # the fixture is mixed
    assert not any(isinstance(v, dict) for v in json.loads((bare / "config.json").read_text())["quantization"].values())
    want = ref.mlx_logits(ref.mlx_load(full, upcast_fp32=True), cases.PROMPT)  # mlx-lm, with the entries
    got = lily.Model.load(bare, cpu_matmul="f32").logits(cases.PROMPT)
    assert rel_err(got, want) <= cases.TOL_MLX
    np.testing.assert_array_equal(got, lily.Model.load(full, cpu_matmul="f32").logits(cases.PROMPT))


def test_uninferable_quantized_shapes_are_named(mixed, store, lily):
    d = store.copy(mixed[1], "mixed-bad-scales")
    t = _load_all(d)
    name = "language_model.model.layers.0.linear_attn.in_proj_z.scales"
    t[name] = np.ones((t[name].shape[0], 5), t[name].dtype)  # 192 inputs in 5 groups
    t[name.replace(".scales", ".biases")] = t[name].copy()
    _save(d, t)
    with pytest.raises(lily.CheckpointError, match=name):
        lily.Model.load(d)


# -- FP8 ------------------------------------------------------------------------------------------

BLOCK = 128


def _fp8_quantize(w):
    """torch: float8_e4m3fn weight + per-128x128-block float32 scale (edge blocks partial), the
    layout of Qwen's FP8 releases; returns (fp8 weight, weight_scale_inv, the dequantized weight)."""
    import torch

    rows, cols = w.shape
    gr, gc = -(-rows // BLOCK), -(-cols // BLOCK)
    pad = torch.zeros(gr * BLOCK, gc * BLOCK)
    pad[:rows, :cols] = w
    tiles = pad.reshape(gr, BLOCK, gc, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max  # [gr, gc]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.to(torch.float32) * full


@pytest.fixture(scope="module")
def fp8(store):
    """The tiny per-expert MoE in Qwen's FP8 layout (written by torch's safetensors writer), and the
    same file dequantized by torch (the reference)."""
    import torch
    from safetensors.torch import load_file, save_file

    src = store.hf("qwen3_5_moe", "per_expert")
    fp8_dir, deq_dir = store.copy(src, "fp8"), store.copy(src, "fp8-dequantized")
    t = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for k, v in t.items():
        # Qwen's FP8 releases keep embeddings, lm_head, norms, the router and the vision tower in bf16
        linear = (k.endswith("proj.weight") and v.ndim == 2 and k.startswith("model.language_model.layers."))
        if linear:
            q, s, w = _fp8_quantize(v)
            quantized[k], quantized[k + "_scale_inv"] = q, s
            dequantized[k] = w
        else:
            quantized[k] = dequantized[k] = v
    save_file(quantized, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(fp8_dir, lambda c: c.update(quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}))
    assert any(v.dtype == torch.float8_e4m3fn for v in quantized.values())
    return fp8_dir, deq_dir


def test_fp8_checkpoint_load_says_convert(fp8, lily):
    with pytest.raises(lily.ConfigError, match=r"FP8 checkpoint.*lily convert"):
        lily.Model.load(fp8[0])
    # without the config's quantization_config, the tensors' dtype says it
    d = fp8[0].parent / "fp8-no-qconfig"
    shutil.copytree(fp8[0], d)
    _edit_config(d, lambda c: c.pop("quantization_config"))
    with pytest.raises(lily.CheckpointError, match=r"F8_E4M3 is FP8.*lily convert"):
        lily.Model.load(d)


@pytest.mark.parametrize("bits", [4, 8])
def test_fp8_converts_like_the_torch_dequantized_file(fp8, lily, tmp_path, bits):
    from lily.convert import convert

    ours = convert(fp8[0], tmp_path / "from-fp8", bits=bits, progress=False)
    want = convert(fp8[1], tmp_path / "from-dequantized", bits=bits, progress=False)
    _same_files(ours, want)
    cfg = json.loads((ours / "config.json").read_text())
    assert cfg["quantization"]["bits"] == bits and "quant_method" not in cfg["quantization_config"]
    # and it runs: the same logits as mlx-lm on the converted checkpoint
    got = lily.Model.load(ours, cpu_matmul="f32").logits(cases.PROMPT)
    assert rel_err(got, ref.mlx_logits(ref.mlx_load(ours, upcast_fp32=True), cases.PROMPT)) <= cases.TOL_MLX


# -- RoPE and tied embeddings -----------------------------------------------------------------------

def test_partial_rotary_factor_defaults_to_a_quarter(store, lily):
    """transformers 5.x (Qwen3_5MoeTextConfig.__post_init__: setdefault 0.25) on the edited config."""
    d = store.copy(store.hf("qwen3_5_moe", "fused"), "no-partial-rotary")
    _edit_config(d, lambda c: c["text_config"]["rope_parameters"].pop("partial_rotary_factor"))
    m = lily.Model.load(d, cpu_matmul="f32")
    assert m.config.rotary_dim == m.config.head_dim // 4
    want = ref.hf_logits(ref.hf_load(d), cases.PROMPT)
    assert rel_err(m.logits(cases.PROMPT), want) <= cases.TOL_FP32


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}


@pytest.mark.parametrize("extra", [{}, {"truncate": False, "beta_fast": 16, "beta_slow": 2},
                                   {"attention_factor": 1.3}], ids=["defaults", "untruncated", "attention_factor"])
def test_yarn_matches_transformers(store, lily, extra):
    """YaRN at positions past original_max_position_embeddings (LONG_PROMPT has 70), f32 mode."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = store.copy(store.hf("qwen3_5_moe", "fused"), "yarn-" + "-".join(extra) or "yarn")
    _edit_config(d, lambda c: c["text_config"]["rope_parameters"].update(YARN, **extra))
    m = lily.Model.load(d, cpu_matmul="f32")
    # the frequencies and attention factor themselves, against transformers' own function
    hf_cfg = AutoConfig.from_pretrained(d).text_config
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    np.testing.assert_allclose(m.config.to_native().rope_inv_freq(), inv_freq.numpy(), rtol=1e-6)
    assert m.config.rope_attention_factor == pytest.approx(attention, rel=1e-12)
    hf = ref.hf_load(d)
    assert hf.model.language_model.rotary_emb.rope_type == "yarn"
    want = ref.hf_logits(hf, cases.LONG_PROMPT)
    got = m.logits(cases.LONG_PROMPT)
    assert rel_err(got, want) <= cases.TOL_FP32
    # and YaRN changed something past the original window
    plain = lily.Model.load(store.hf("qwen3_5_moe", "fused"), cpu_matmul="f32").logits(cases.LONG_PROMPT)
    assert rel_err(plain, want) > 10 * cases.TOL_FP32


def test_yarn_on_the_gpu_kernels_matches_transformers(store, lily):
    """The GPU backends read the same frequency table and folded gains (msl-cpu runs the kernels)."""
    d = store.copy(store.hf("qwen3_5_moe", "fused"), "yarn-msl-cpu")
    _edit_config(d, lambda c: c["text_config"]["rope_parameters"].update(YARN, attention_factor=1.3))
    want = ref.hf_logits(ref.hf_load(d), cases.LONG_PROMPT)
    got = lily.Model.load(d, backend="msl-cpu", backend_options=cases.F32_KV).logits(cases.LONG_PROMPT)
    assert rel_err(got, want) <= cases.TOL_FP32


def test_tie_word_embeddings_read_from_the_text_config(store, lily):
    """mlx-lm reads tie_word_embeddings from text_config (TextModelArgs): a checkpoint that ties
    there (top level saying false) and so has no lm_head must run like mlx-lm runs it."""
    d = store.copy(store.mlx("qwen3_5_moe", None), "tied-in-text-config")
    t = _load_all(d)
    t.pop("language_model.lm_head.weight")
    _save(d, t)

    def tie(c):
        c["text_config"]["tie_word_embeddings"] = True
        c["tie_word_embeddings"] = False
    _edit_config(d, tie)
    want = ref.mlx_logits(ref.mlx_load(d, upcast_fp32=True), cases.PROMPT)
    m = lily.Model.load(d, cpu_matmul="f32")
    assert m.config.tie_word_embeddings
    assert rel_err(m.logits(cases.PROMPT), want) <= cases.TOL_MLX


# -- MLX's other quantization modes -----------------------------------------------------------------

MODES = ["mxfp4", "mxfp8", "nvfp4"]


@pytest.mark.parametrize("mode,global_scale", [(m, False) for m in MODES] + [("nvfp4", True)])
@pytest.mark.parametrize("rows,cols", [(3, 64), (17, 160), (5, 512)])
def test_microscaled_dequantize_matches_mlx(lily, mode, global_scale, rows, cols):
    """The CPU backend's decoding of mxfp4 / mxfp8 / nvfp4 bytes, bit for bit against
    mlx.core.dequantize on the same bytes (NaN-free random weights at several magnitudes); nvfp4
    also with a global scale (mx.quantize(..., global_scale=max|w|), as mlx-lm computes it)."""
    import mlx.core as mx

    rng = np.random.default_rng(rows * cols)
    w = mx.array((rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-3, 3, (rows, 1))).astype(np.float32))
    gs = mx.max(mx.abs(w)).astype(mx.float32) if global_scale else None
    packed, scales = mx.quantize(w, mode=mode, global_scale=gs)[:2]
    want = np.array(mx.dequantize(packed, scales, mode=mode, global_scale=gs, dtype=mx.float32))
    got = lily._core.dequantize_microscaled(np.array(packed), np.array(scales), mode,
                                            global_scale=None if gs is None else gs.item())
    np.testing.assert_array_equal(got, want)


def _mlx_lm_quantized(store, variant: str) -> Path:
    """mlx-lm's quantization of the tiny MoE in mode `variant` (its quant_predicate keeps the
    routers at affine 8-bit: one checkpoint, two modes), as mlx_lm.convert --q-mode writes it;
    "nvfp4-global-scale": quantize_model(..., global_scale=True), one float32 scale per expert of
    each switch layer (mlx_lm.convert has no flag for it; its Python API does)."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    out = store.root / f"mode-{variant}"
    if not out.exists():
        model, config = load_model(store.hf("qwen3_5_moe", "fused"), lazy=True)
        model, config = quantize_model(model, config, None, None, mode=variant.removesuffix("-global-scale"),
                                       global_scale=variant.endswith("-global-scale"))
        save_model(out, model, donate_model=True)
        save_config(config, config_path=out / "config.json")
    return out


@pytest.fixture(scope="module", params=MODES + ["nvfp4-global-scale"])
def microscaled(request, store):
    return request.param.removesuffix("-global-scale"), _mlx_lm_quantized(store, request.param)


def test_microscaled_checkpoint_matches_mlx_lm(microscaled, lily):
    """mlx-lm's logits on its own checkpoint (a global-scaled switch layer through
    mlx.core.dequantize on the CPU, where mlx's gather_qmm takes no global scale)."""
    mode, d = microscaled
    cfg = json.loads((d / "config.json").read_text())["quantization"]
    assert cfg["mode"] == mode and any(isinstance(v, dict) for v in cfg.values())  # routers: affine entries
    want = ref.mlx_logits(ref.mlx_load(d, upcast_fp32=True), cases.PROMPT)
    got = lily.Model.load(d, cpu_matmul="f32").logits(cases.PROMPT)
    assert rel_err(got, want) <= cases.TOL_MLX
    # the int8 default runs these matrices in f32 (no int8 kernels for them): same numbers
    assert rel_err(lily.Model.load(d).logits(cases.PROMPT), want) <= 1e-2
    # and without the config's mode (mlx-lm infers it from the uint8 scales and the shapes)
    bare = d.parent / f"{d.name}-no-mode"
    if not bare.exists():
        shutil.copytree(d, bare)
        _edit_config(bare, lambda c: [c[k].pop("mode") for k in ("quantization", "quantization_config")])
    np.testing.assert_array_equal(lily.Model.load(bare, cpu_matmul="f32").logits(cases.PROMPT), got)


def test_microscaled_modes_run_in_the_metal_kernels(microscaled, lily):
    """The Metal kernels (run by the MSL-on-CPU runtime) on mlx-lm's mxfp4 / mxfp8 / nvfp4 bytes:
    the embedding gather, the GEMV and tiled GEMM projections, the expert gather-GEMVs and grouped
    GEMMs (a prefill over gemm_min_rows, then decode steps), against the CPU backend and mlx-lm."""
    mode, d = microscaled
    gpu = lily.Model.load(d, backend="msl-cpu", backend_options=dict(gemm_min_rows=4, **cases.F32_KV))
    cpu = lily.Model.load(d, cpu_matmul="f32")
    want = ref.mlx_logits(ref.mlx_load(d, upcast_fp32=True), cases.PROMPT)
    n = cases.DECODE_SPLIT
    s, c = gpu.session(), cpu.session()
    got = [s.prefill(cases.PROMPT[:n], all_logits=True)] + [s.decode(t)[None] for t in cases.PROMPT[n:]]
    ref_cpu = [c.prefill(cases.PROMPT[:n], all_logits=True)] + [c.decode(t)[None] for t in cases.PROMPT[n:]]
    got, ref_cpu = np.concatenate(got), np.concatenate(ref_cpu)
    assert rel_err(got, ref_cpu) <= cases.TOL_MLX
    assert rel_err(got, want) <= cases.TOL_MLX
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_global_scale_and_config_disagreeing_are_named(store, lily):
    """config.json's entry and the tensors must agree on a global scale, as mlx-lm (which builds
    a listed module from its entry, then loads strictly) requires: the tensor named either way."""
    from mlx_lm.utils import load_model

    global_scaled = _mlx_lm_quantized(store, "nvfp4-global-scale")
    module = "language_model.model.layers.0.mlp.switch_mlp.up_proj"
    tensors = _load_all(global_scaled)

    d = store.copy(global_scaled, "gs-dropped")  # the entry says global_scale, the tensor is gone
    _save(d, {k: v for k, v in tensors.items() if k != module + ".global_scale"})
    with pytest.raises(lily.CheckpointError, match=f"'{module}.global_scale'"):
        lily.Model.load(d)
    with pytest.raises(ValueError, match=f"Missing 1 parameters: \n{module}.global_scale"):
        load_model(d)

    d = store.copy(global_scaled, "gs-unlisted")  # the tensor is there, the entry does not say so
    _edit_config(d, lambda c: [c[k][module].pop("global_scale") for k in ("quantization", "quantization_config")])
    with pytest.raises(lily.CheckpointError, match=f"'{module}.global_scale'.*without \"global_scale\": true"):
        lily.Model.load(d)
    with pytest.raises(ValueError, match=f"1 parameters not in model: \n{module}.global_scale"):
        load_model(d)

    d = store.copy(global_scaled, "gs-wrong-shape")  # one scale for the stack, not one per expert
    _save(d, {**tensors, module + ".global_scale": tensors[module + ".global_scale"][:1]})
    with pytest.raises(lily.CheckpointError, match=r"global_scale' is F32 \[1\]; a global scale is float32 \[experts\]"):
        lily.Model.load(d)


def test_unknown_quantization_mode_is_refused_by_name(store, lily):
    d = store.copy(store.mlx("qwen3_5_moe", 4), "mode-fp3")
    _edit_config(d, lambda c: [c[k].update(mode="fp3") for k in ("quantization", "quantization_config")])
    with pytest.raises(lily.ConfigError, match="'fp3'"):
        lily.Model.load(d)
