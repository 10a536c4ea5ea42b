"""`lily convert` against `mlx_lm.convert`, and `lily eval` against mlx-lm.

Tiny random checkpoints of the real architectures come from scripts/make_checkpoint.py
(transformers' own save_pretrained). mlx_lm.convert turns them into MLX 4/8-bit checkpoints (affine,
and the mxfp4 / mxfp8 / nvfp4 modes); lily convert (NumPy only) must write the same tensors byte for
byte, with the same names, shapes, dtypes and quantization config.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import lily
from lily.convert import quantize, quantize_microscaled

ROOT = Path(__file__).resolve().parents[1]
# Where the lily under test was imported from (site-packages in CI, src/ in a dev tree):
# subprocesses must see the same one.
LILY_PARENT = str(Path(lily.__file__).resolve().parent.parent)
DEMO = ROOT / "src" / "lily" / "demo"
VOCAB = 4096  # the demo tokenizer's, so mlx_lm can load a tokenizer with the checkpoint


def _make_checkpoint_module():
    spec = importlib.util.spec_from_file_location("make_checkpoint", ROOT / "scripts" / "make_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _with_tokenizer(path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, path / name)
    return path


def _mlx_convert(src: Path, dst: Path, bits: int | None, group_size: int | None, mode: str = "affine") -> Path:
    from mlx_lm.convert import convert

    convert(str(src), str(dst), quantize=True, q_bits=bits, q_group_size=group_size, q_mode=mode)
    return dst


def _lily_convert(src: Path, dst: Path, bits: int | None, group_size: int | None, mode: str = "affine") -> Path:
    env = dict(os.environ, PYTHONPATH=LILY_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    quant = ["--q-bits", str(bits), "--q-group-size", str(group_size)] if mode == "affine" else ["--mode", mode]
    p = subprocess.run([sys.executable, "-m", "lily", "convert", str(src), "--out", str(dst), *quant],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    mc = _make_checkpoint_module()
    root = tmp_path_factory.mktemp("convert")
    made = {}
    for name, mtype, dtype, layout in [
        ("moe_bf16_fused", "qwen3_5_moe", "bfloat16", "fused"),
        ("moe_f32_fused", "qwen3_5_moe", "float32", "fused"),
        ("moe_f32_per_expert", "qwen3_5_moe", "float32", "per_expert"),
        ("next_bf16", "qwen3_next", "bfloat16", "per_expert"),
        ("dense_bf16", "qwen3_5", "bfloat16", None),
    ]:
        made[name] = _with_tokenizer(mc.make_checkpoint(mtype, root / name, vocab_size=VOCAB, dtype=dtype,
                                                        expert_layout=layout, seed=3))
    made["root"] = root
    return made


def _tensors(path: Path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _assert_identical(ours: Path, ref: Path):
    a, b = _tensors(ours), _tensors(ref)
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        x = np.array(a[k].view(mx.uint16) if a[k].dtype == mx.bfloat16 else a[k])
        y = np.array(b[k].view(mx.uint16) if b[k].dtype == mx.bfloat16 else b[k])
        assert x.tobytes() == y.tobytes(), f"{k} differs"
    ca = json.loads((ours / "config.json").read_text())
    cb = json.loads((ref / "config.json").read_text())
    assert ca == cb
    return b


@pytest.mark.parametrize("name,bits,gs", [("moe_bf16_fused", 4, 64), ("next_bf16", 4, 64),
                                          ("moe_f32_fused", 8, 32), ("dense_bf16", 4, 32)])
def test_convert_is_byte_identical_to_mlx_lm(checkpoints, name, bits, gs):
    root = checkpoints["root"]
    ref = _mlx_convert(checkpoints[name], root / f"{name}-mlx{bits}", bits, gs)
    ours = _lily_convert(checkpoints[name], root / f"{name}-lily{bits}", bits, gs)
    tensors = _assert_identical(ours, ref)
    # The per-tensor choices are really there: routers at 8-bit g64, conv / norms unquantized.
    assert not any(k.endswith("conv1d.scales") or k.endswith("norm.scales") for k in tensors)
    if name.startswith("dense"):
        assert not any("switch_mlp" in k or k.endswith("mlp.gate.weight") for k in tensors)
        return
    router = next(k for k in tensors if k.endswith("mlp.gate.weight"))
    h = tensors[router.replace(".weight", ".scales")].shape[-1] * 64
    assert tensors[router].shape[-1] == h * 8 // 32
    assert any(".switch_mlp.gate_proj.scales" in k for k in tensors)


@pytest.mark.parametrize("name,mode", [("moe_bf16_fused", "mxfp4"), ("moe_bf16_fused", "mxfp8"),
                                       ("moe_bf16_fused", "nvfp4"), ("moe_f32_fused", "mxfp4"),
                                       ("dense_bf16", "nvfp4"), ("next_bf16", "mxfp8")])
def test_convert_modes_are_byte_identical_to_mlx_lm(checkpoints, name, mode):
    # mlx_lm.convert(..., quantize=True, q_mode=mode) and `lily convert --mode` on the same input
    root = checkpoints["root"]
    ref = _mlx_convert(checkpoints[name], root / f"{name}-mlx-{mode}", None, None, mode)
    ours = _lily_convert(checkpoints[name], root / f"{name}-lily-{mode}", None, None, mode)
    tensors = _assert_identical(ours, ref)
    config = json.loads((ours / "config.json").read_text())["quantization"]
    assert config["mode"] == mode
    scales = [k for k in tensors if k.endswith(".scales")]
    assert scales and not any(k.endswith(".biases") and "mlp.gate" not in k and "shared_expert_gate" not in k
                              for k in tensors)
    assert any(tensors[k].dtype == mx.uint8 for k in scales)  # the mode's byte scales are really there
    # and lily runs the result like mlx-lm's own (the same bytes): identical logits
    ids = np.arange(1, 40, dtype=np.int32)
    np.testing.assert_array_equal(lily.Model.load(ours, cpu_matmul="f32").logits(ids),
                                  lily.Model.load(ref, cpu_matmul="f32").logits(ids))


def test_convert_mode_refuses_bits_it_does_not_have(tmp_path, checkpoints):
    with pytest.raises(lily.ConfigError, match="mxfp4.*4 bits in groups of 32"):
        lily.convert.convert(checkpoints["dense_bf16"], tmp_path / "out", mode="mxfp4", bits=8)
    with pytest.raises(lily.ConfigError, match="'fp3'"):
        lily.convert.convert(checkpoints["dense_bf16"], tmp_path / "out2", mode="fp3")


def test_per_expert_layout_converts_like_the_fused_one(checkpoints):
    # Same seed, same numbers: the per-expert HF layout (what transformers writes) must give
    # exactly mlx_lm's conversion of the fused layout (which mlx_lm needs for this family).
    root = checkpoints["root"]
    ref = root / "moe_f32_fused-mlx4-g64"
    if not ref.exists():
        _mlx_convert(checkpoints["moe_f32_fused"], ref, 4, 64)
    ours = _lily_convert(checkpoints["moe_f32_per_expert"], root / "moe_per_expert-lily4", 4, 64)
    _assert_identical(ours, ref)
    # and lily runs it: same logits as the mlx_lm-converted checkpoint
    ids = np.arange(1, 40, dtype=np.int32)
    np.testing.assert_array_equal(lily.Model.load(ours).logits(ids), lily.Model.load(ref).logits(ids))


@pytest.mark.parametrize("bits,gs", [(2, 32), (3, 64), (4, 128), (5, 64), (6, 32), (8, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_quantize_matches_mx_quantize(bits, gs, dtype):
    rng = np.random.default_rng(bits * 1000 + gs)
    w = rng.standard_normal((24, 256)).astype(np.float32) * rng.uniform(0.01, 3, size=(24, 1)).astype(np.float32)
    w[3, :gs] = 0.0  # an all-zero group (q0 == 0 branch)
    w[5, :gs] = 0.25  # a constant group
    wm = mx.array(w).astype(dtype)
    q_ref, s_ref, b_ref = mx.quantize(wm, group_size=gs, bits=bits)
    q, s, b = quantize(np.array(wm.astype(mx.float32)), bits, gs)
    np.testing.assert_array_equal(q, np.array(q_ref))
    np.testing.assert_array_equal(mx.array(s).astype(dtype).astype(mx.float32), s_ref.astype(mx.float32))
    np.testing.assert_array_equal(mx.array(b).astype(dtype).astype(mx.float32), b_ref.astype(mx.float32))


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_quantize_microscaled_matches_mx_quantize(mode, dtype):
    rng = np.random.default_rng(len(mode) * 7 + dtype.size)
    w = rng.standard_normal((48, 256)).astype(np.float32) * (10.0 ** rng.integers(-4, 3, (48, 1))).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero group
    w[5, :32] = 0.25  # a constant group
    w[9, :32] = 6 * 2.0 ** rng.integers(-5, 5, 32)  # maxima on the e2m1 grid: log2 of an exact power of two
    w[10, :32] = 448 * 2.0 ** rng.integers(-5, 5, 32)  # and on the e4m3 one
    w[11, :32] = np.linspace(-7, 7, 32)  # halfway values between e2m1 codes (ties)
    wm = mx.array(w).astype(dtype)
    q_ref, s_ref = mx.quantize(wm, mode=mode)[:2]
    name = {mx.float32: "F32", mx.bfloat16: "BF16", mx.float16: "F16"}[dtype]
    q, s = quantize_microscaled(np.array(wm.astype(mx.float32)), mode, name)
    np.testing.assert_array_equal(q, np.array(q_ref))
    np.testing.assert_array_equal(s, np.array(s_ref))


def test_convert_refuses_bad_input(tmp_path, checkpoints):
    with pytest.raises(FileExistsError):
        lily.convert.convert(checkpoints["moe_bf16_fused"], checkpoints["moe_bf16_fused"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(lily.ConfigError, match="llama"):
        lily.convert.convert(tmp_path / "bad", tmp_path / "out")


def test_eval_against_mlx_lm_reports_figures(checkpoints):
    # fp32 source, so scales are fp32 and mlx-lm computes in fp32 like lily (from a bf16 source
    # mlx-lm computes in bf16 and the random tiny model's top-1 margins drown in that rounding).
    ckpt = checkpoints["root"] / "moe_f32_fused-mlx4-g64"
    if not ckpt.exists():
        _mlx_convert(checkpoints["moe_f32_fused"], ckpt, 4, 64)
    env = dict(os.environ, PYTHONPATH=LILY_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The f32 mode: the figures below pin lily's numerics to mlx-lm's (int8 mode adds its own rounding).
    p = subprocess.run([sys.executable, "-m", "lily", "eval", "--model", str(ckpt), "--reference", "mlx", "-N", "96",
                        "--cpu-matmul", "f32", "--json", "-"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "top-1 agreement" in p.stderr  # with --json -, the table goes to stderr, the JSON alone to stdout
    report = json.loads(p.stdout)
    print(f"\n[eval] {report}")
    assert report["positions"] == 96 and report["reference"] == "mlx-lm" and report["reference_dtype"] == "float32"
    # Same 4-bit weights in both: the next-token distributions must agree closely.
    assert report["top1_agreement"] >= 0.97
    assert report["perplexity"] == pytest.approx(report["reference_perplexity"], rel=1e-3)
    assert report["mean_kl"] < 1e-4
