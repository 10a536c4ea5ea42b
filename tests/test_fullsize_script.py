"""scripts/make_fullsize.py: the random-weight Qwen3.6-35B-A3B checkpoint in the release layout.

- Full size, nothing written: every tensor name and shape of the spec equals what mlx-lm's own
  `qwen3_5_moe` model at the released config holds after mlx-lm's own `quantize_model` (built
  lazily, so no memory); dtypes follow mlx-lm's cast rule (bf16 except A_log); config.json's
  `quantization` equals the one quantize_model writes (8-bit router and shared-expert gate);
  the ~19.5 GB total splits into 5 GB shards as mlx-lm's make_shards does.
- Small shape (4 layers, 8 experts, vocab 4096, every per-layer matrix at its real size),
  written for real with two worker processes: the headers hold exactly the spec, the index maps
  every tensor, biases are -(2^bits - 1)/2 x scales (centred codes), and the checkpoint loads in mlx-lm and in lily,
  whose logits (prefill and decode) match mlx-lm's on these bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures.references import mlx_load, mlx_logits, rel_err

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_fullsize as mf  # noqa: E402

SMALL = dict(layers=4, experts=8, vocab=4096)


def _mlx_reference(tc: dict):
    """mlx-lm's model at this config, quantized by mlx-lm (lazy: no weights materialised)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5_moe
    from mlx_lm.utils import quantize_model

    cfg = {"model_type": "qwen3_5_moe", "text_config": tc, "tie_word_embeddings": False}
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(cfg))
    model, qcfg = quantize_model(model, cfg, group_size=64, bits=4, mode="affine")
    params = dict(tree_flatten(model.parameters()))
    cast = model.cast_predicate

    def dtype(name, arr):
        if arr.dtype == mx.uint32:
            return "U32"
        return "BF16" if cast(name) else "F32"

    return {k: (dtype(k, v), tuple(v.shape)) for k, v in params.items()}, qcfg["quantization"]


def test_full_size_spec_matches_mlx_lm():
    tc = mf.text_config()
    assert (tc["num_hidden_layers"], tc["num_experts"], tc["vocab_size"]) == (40, 256, 248_320)
    want, want_q = _mlx_reference(tc)
    got = {t.name: (t.dtype, t.shape) for t in mf.spec(tc)}
    assert set(got) == set(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    bad = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    assert not bad, list(bad.items())[:5]
    assert mf.config_json(tc)["quantization"] == want_q
    # Spot checks against the published layout (REFERENCE.md).
    assert got["language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"] == ("U32", (256, 512, 256))
    assert got["language_model.model.layers.0.mlp.gate.weight"] == ("U32", (256, 512))  # 8-bit
    assert got["language_model.model.layers.0.linear_attn.conv1d.weight"] == ("BF16", (8192, 4, 1))
    assert got["language_model.model.layers.0.linear_attn.A_log"] == ("F32", (32,))
    assert got["language_model.model.embed_tokens.weight"] == ("U32", (248_320, 256))


def test_full_size_shards():
    groups = mf.shards(mf.spec(mf.text_config()))
    sizes = [sum(t.nbytes for t in g) for g in groups]
    assert 19.3e9 < sum(sizes) < 19.7e9, sum(sizes)  # the release: 19.4 GB
    assert len(groups) == 4
    # make_shards: a shard closes only when the next tensor would not fit.
    for g, nxt in zip(groups, groups[1:], strict=False):
        assert sum(t.nbytes for t in g) <= mf.SHARD_BYTES < sum(t.nbytes for t in g) + nxt[0].nbytes


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("fullsize_small")
    info = mf.write(out, mf.text_config(**SMALL), workers=2, log=lambda *_: None)
    return out, info


def test_small_files_hold_the_spec(small):
    from safetensors import safe_open

    out, info = small
    spec = {t.name: t for t in mf.spec(mf.text_config(**SMALL))}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(spec)
    assert index["metadata"]["total_size"] == info["bytes"] == sum(t.nbytes for t in spec.values())
    seen = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, "numpy") as st:
            assert st.metadata() == {"format": "mlx"}
            for k in st.keys():
                sl = st.get_slice(k)
                seen[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    assert seen == {k: (t.dtype, t.shape) for k, t in spec.items()}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["text_config"]["model_type"] == "qwen3_5_moe_text"


def test_small_values(small):
    import mlx.core as mx

    out, _ = small
    w = {}
    for f in out.glob("*.safetensors"):
        w.update(mx.load(str(f)))
    p = "language_model.model.layers.0."
    for name, bits in (("mlp.switch_mlp.up_proj", 4), ("mlp.gate", 8), ("linear_attn.in_proj_qkv", 4)):
        s = np.array(w[p + name + ".scales"].astype(mx.float32))
        b = np.array(w[p + name + ".biases"].astype(mx.float32))
        np.testing.assert_allclose(b, -(2.0**bits - 1) / 2 * s, rtol=2**-8)  # bf16 rounding
        lo = 2.0 ** (-9 if bits == 4 else -12)
        assert s.min() >= lo and s.max() < 2 * lo
    codes = np.array(w[p + "mlp.switch_mlp.down_proj.weight"]).view(np.uint8)
    counts = np.bincount((codes & 15).ravel(), minlength=16)
    assert counts.min() > 0.9 * counts.mean(), counts  # nibbles uniformly spread
    a_log = np.array(w[p + "linear_attn.A_log"])
    assert a_log.dtype == np.float32 and (a_log >= 0).all() and (a_log < np.log(16)).all()


def test_small_runs_in_lily_like_mlx_lm(small, lily):
    out, _ = small
    ids = np.array([11, 4000, 7, 123, 999, 42], dtype=np.int32)
    model = lily.Model.load(out, threads=2, cpu_matmul="f32")
    assert model.config.num_experts == 8 and model.config.hidden_size == 2048
    ref = mlx_logits(mlx_load(out, upcast_fp32=True), ids.tolist())  # [T, vocab]
    got = model.logits(ids)
    assert np.isfinite(got).all()
    err = rel_err(got, ref)
    assert err <= 1e-3, err
    s = model.session()
    s.prefill(ids[:-1])
    last = s.decode(int(ids[-1]))
    assert rel_err(last, ref[-1]) <= 1e-3


def test_random_routing_spreads_over_experts(tmp_path):
    """A trained MoE sends a prompt to most experts; random weights must too, or the speed and
    memory figures measure a degenerate model. (Codes with a non-zero mean, or a random source
    with a stuck bit, once sent every token to the same expert.) Router choices are read from
    mlx-lm's own forward on the written checkpoint."""
    import mlx.core as mx

    mf.write(tmp_path, mf.text_config(layers=4, experts=64, vocab=1024), workers=2, log=lambda *_: None)
    model = mlx_load(tmp_path, upcast_fp32=True)
    chosen: dict[int, np.ndarray] = {}

    class Record:
        def __init__(self, i, gate):
            self.i, self.gate = i, gate

        def __call__(self, x):
            logits = self.gate(x)
            chosen[self.i] = np.array(mx.argsort(-logits, axis=-1)[..., :8]).reshape(-1, 8)
            return logits

    for i, layer in enumerate(model.language_model.model.layers):
        layer.mlp.gate = Record(i, layer.mlp.gate)
    ids = np.random.default_rng(0).integers(0, 1024, 128).tolist()
    model(mx.array(ids)[None])
    assert sorted(chosen) == [0, 1, 2, 3]
    for i, sel in chosen.items():
        counts = np.bincount(sel.ravel(), minlength=64)
        assert np.count_nonzero(counts) >= 60, (i, counts)  # 128 tokens x 8 picks over 64 experts
        assert counts.max() <= 0.4 * len(ids), (i, counts)  # no expert taken by most tokens


def test_gguf_twin_has_the_same_parameters():
    """benchmarks/fullsize/make_gguf.py (the llama.cpp side) lays out the same model: per kind of
    tensor, the GGUF's element counts equal the MLX checkpoint's unpacked ones."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "fullsize"))
    import make_gguf

    tc = mf.text_config()

    def mlx_count(t):
        n = int(np.prod(t.shape))
        return n * 32 // t.bits if t.dtype == "U32" else n

    mlx = sum(mlx_count(t) for t in mf.spec(tc) if t.kind not in ("scales", "biases"))
    gg = sum(int(np.prod(s)) for _, s, _ in make_gguf.tensors(tc))
    assert gg == mlx, (gg, mlx)
    names = [n for n, _, _ in make_gguf.tensors(tc)]
    assert len(names) == len(set(names)) == 2 + 1 + 30 * 19 + 10 * 16
    q4 = sum(make_gguf.nbytes(s, k) for _, s, k in make_gguf.tensors(tc))
    assert 19.4e9 < q4 < 19.7e9  # Q4_0 is 4.5 bits per weight, like MLX 4-bit g64 + bf16 s/b
