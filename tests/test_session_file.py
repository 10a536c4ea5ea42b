"""Session.save / Model.load_session: a sequence state in a file that outlives the process.

References: the uninterrupted session on the same model (a saved and reloaded state must go on
exactly as if it had never left memory: bit-identical logits and tokens), and mlx-lm's logits
for the same prompt on the same 4-bit bytes (f32 mode, at cases.TOL_MLX). Refusals: each way a
file can belong to something else, and each way it can be damaged.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import lily
from fixtures import cases
from fixtures import safetensors_edit as st_edit
from fixtures.references import rel_err
from lily import session_file

SPLIT = 40  # LONG_PROMPT[:SPLIT] is prefilled and saved; the rest goes on after the reload
DECODE_STEPS = 8


@pytest.fixture(scope="module")
def checkpoint(store):
    return store.mlx("qwen3_5_moe", 4)


def _load(path, **kw):
    return lily.Model.load(path, prefill_chunk=cases.PREFILL_CHUNK, **kw)


def _greedy(session, logits, steps):
    tokens = []
    for _ in range(steps):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        logits = session.decode(tok)
    return tokens, logits


@pytest.mark.parametrize("cpu_matmul", ["auto", "f32"])
def test_reloaded_session_continues_bit_identically(checkpoint, store, tmp_path, cpu_matmul):
    prompt = np.asarray(cases.LONG_PROMPT, np.int32)
    model = _load(checkpoint, cpu_matmul=cpu_matmul)
    whole = model.session()
    whole.prefill(prompt[:SPLIT])
    rest = whole.prefill(prompt[SPLIT:], all_logits=True)
    tokens, last = _greedy(whole, rest[-1], DECODE_STEPS)

    saved = model.session()
    saved.prefill(prompt[:SPLIT])
    saved.take_snapshot()  # save() writes the state, not its snapshots (the server's disk tier does)
    path = tmp_path / "prefix.safetensors"
    assert saved.save(path) == path.stat().st_size
    assert session_file.peek(path, model) == (cases.LONG_PROMPT[:SPLIT], [])
    del model, saved

    fresh = _load(checkpoint, cpu_matmul=cpu_matmul)  # a new engine, as in a new process
    loaded = fresh.load_session(path)
    assert loaded.position == SPLIT and loaded.tokens == cases.LONG_PROMPT[:SPLIT]
    got = loaded.prefill(prompt[SPLIT:], all_logits=True)
    np.testing.assert_array_equal(got, rest)
    got_tokens, got_last = _greedy(loaded, got[-1], DECODE_STEPS)
    assert got_tokens == tokens
    np.testing.assert_array_equal(got_last, last)
    if cpu_matmul == "f32":  # and it is the model mlx-lm runs, not merely self-consistent
        ref = store.mlx_reference(checkpoint).long
        assert rel_err(got, ref[SPLIT:]) < cases.TOL_MLX


def test_generate_continues_from_a_prompt_cache(checkpoint, tmp_path):
    model = _load(checkpoint, cpu_matmul="f32")
    prompt = cases.LONG_PROMPT[:50]
    expected = model.generate(prompt, max_tokens=6, temperature=0)
    s = model.session()
    s.prefill(np.asarray(prompt[:30], np.int32))
    s.save(tmp_path / "p.safetensors")
    cache = _load(checkpoint, cpu_matmul="f32").load_session(tmp_path / "p.safetensors")
    got = cache._model.generate(prompt, max_tokens=6, temperature=0, prompt_cache=cache)
    assert got.tokens == expected.tokens and len(got.tokens) == 6
    assert got.cached_tokens == 30 and cache.position == 30  # the cache itself is untouched
    with pytest.raises(lily.RequestError, match="differ at token 3"):
        cache._model.generate(prompt[:3] + [prompt[3] + 1] + prompt[4:], prompt_cache=cache)
    with pytest.raises(lily.RequestError, match="at least one token"):
        cache._model.generate(prompt[:30], prompt_cache=cache)


@pytest.fixture(scope="module")
def saved(checkpoint, tmp_path_factory):
    """A session file of `checkpoint` made with cpu_matmul='f32'."""
    path = tmp_path_factory.mktemp("sessions") / "s.safetensors"
    s = _load(checkpoint, cpu_matmul="f32").session()
    s.prefill(np.asarray(cases.PROMPT, np.int32))
    s.save(path)
    return path


def test_refuses_another_model(store, saved):
    other = _load(store.mlx("qwen3_5", 4), cpu_matmul="f32")
    with pytest.raises(lily.ConfigError, match="different config.json"):
        other.load_session(saved)


def test_refuses_a_changed_checkpoint(store, checkpoint, saved, request):
    # The same config, a shard re-written with one tensor's header entry changed: a
    # re-quantized or re-converted checkpoint under the same name.
    d = store.copy(checkpoint, request.node.name)
    shard = sorted(d.glob("*.safetensors"))[0]
    header, data = st_edit.read(shard)
    header.setdefault("__metadata__", {})["edited"] = "yes"
    st_edit.write(shard, header, data)
    with pytest.raises(lily.ConfigError, match=rf"shard {shard.name} has changed"):
        _load(d, cpu_matmul="f32").load_session(saved)


def test_refuses_a_changed_config(store, checkpoint, saved, request):
    d = store.copy(checkpoint, request.node.name)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(lily.ConfigError, match="different config.json"):
        _load(d, cpu_matmul="f32").load_session(saved)


def test_refuses_another_engine_setting(checkpoint, saved):
    if lily._core.cpu_int8_supported(4, 64, 64):
        with pytest.raises(lily.ConfigError, match="cpu_matmul mode 'f32', this model runs 'int8'"):
            _load(checkpoint, cpu_matmul="int8").load_session(saved)
    with pytest.raises(lily.ConfigError, match="backend 'cpu', this model runs 'msl-cpu'"):
        _load(checkpoint, backend="msl-cpu").load_session(saved)


def test_refuses_another_kv_dtype(checkpoint, saved, tmp_path):
    # The CPU backend keeps float32 KV only; a file stamped float16 (as a GPU backend with
    # kv_dtype="float16" would make) is refused by name.
    header, data = st_edit.read(saved)
    header["__metadata__"]["kv_dtype"] = "float16"
    f = tmp_path / "f16.safetensors"
    st_edit.write(f, header, data)
    with pytest.raises(lily.ConfigError, match="KV cache dtype 'float16', this model runs 'float32'"):
        _load(checkpoint, cpu_matmul="f32").load_session(f)


def test_refuses_damaged_files(checkpoint, saved, tmp_path):
    model = _load(checkpoint, cpu_matmul="f32")
    raw = saved.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(lily.CheckpointError, match="truncated or corrupted"):
        model.load_session(truncated)
    flipped = tmp_path / "flipped.safetensors"
    b = bytearray(raw)
    b[-5] ^= 0x40  # a bit of the last tensor's data
    flipped.write_bytes(bytes(b))
    with pytest.raises(lily.CheckpointError, match="corrupted: its tensor bytes do not match"):
        model.load_session(flipped)
    shard = sorted(checkpoint.glob("*.safetensors"))[0]  # a safetensors file, not a session
    with pytest.raises(lily.CheckpointError, match="not a lily session file"):
        model.load_session(shard)
    with pytest.raises(lily.CheckpointError, match="does not exist"):
        model.load_session(tmp_path / "missing.safetensors")
    # A shape lie that passes the checksum (re-stamped): the native import names the tensor.
    header, data = st_edit.read(saved)
    name = next(k for k in header if k.startswith("state.gdn.") and k.endswith(".S"))
    header[name]["shape"] = [header[name]["shape"][0] * header[name]["shape"][1]] + header[name]["shape"][2:]
    bad = tmp_path / "shape.safetensors"
    st_edit.write(bad, header, data)
    with pytest.raises(lily.RequestError, match=rf"tensor '{name[len('state.'):]}' has shape"):
        model.load_session(bad)



@pytest.mark.parametrize("options", [
    {"kv_dtype": "float32"},                             # contiguous f32 KV cache
    {},                                                  # the default f16 elements, f32 in the file
    {"block_threshold": 20, "block_len": 8},             # the fixed-block layout of long contexts
], ids=["f32", "f16", "blocks"])
def test_gpu_backend_sessions_continue_bit_identically(checkpoint, tmp_path, options):
    """The Metal kernels' backend run by the MSL-on-CPU runtime: the state read back from the
    device buffers (and written into a fresh engine's) goes on as the uninterrupted one."""
    prompt = np.asarray(cases.LONG_PROMPT, np.int32)
    model = _load(checkpoint, backend="msl-cpu", backend_options=options)
    whole = model.session()
    whole.prefill(prompt[:SPLIT])
    rest = whole.prefill(prompt[SPLIT:], all_logits=True)
    saved = model.session()
    saved.prefill(prompt[:SPLIT])
    saved.save(tmp_path / "gpu.safetensors")

    fresh = _load(checkpoint, backend="msl-cpu", backend_options=options)
    loaded = fresh.load_session(tmp_path / "gpu.safetensors")
    np.testing.assert_array_equal(loaded.prefill(prompt[SPLIT:], all_logits=True), rest)
    if not options:
        with pytest.raises(lily.ConfigError, match="KV cache dtype 'float16', this model runs 'float32'"):
            _load(checkpoint, backend="msl-cpu", backend_options=cases.F32_KV).load_session(tmp_path / "gpu.safetensors")


def test_state_tensors_follow_the_config(checkpoint):
    """export_tensors names and shapes, against the checkpoint's own config.json (the layer
    types and head sizes transformers reads), and import_tensors' refusals."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    model = _load(checkpoint, cpu_matmul="f32")
    s = model.session()
    s.prefill(np.asarray(cases.PROMPT, np.int32))
    tensors = s._state.export_tensors()
    expected = {}
    for layer, kind in enumerate(cfg["layer_types"]):
        if kind == "full_attention":
            shape = (cfg["num_key_value_heads"], len(cases.PROMPT), cfg["head_dim"])
            expected[f"kv.{layer}.k"] = expected[f"kv.{layer}.v"] = shape
        else:
            channels = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + \
                cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            expected[f"gdn.{layer}.conv"] = (cfg["linear_conv_kernel_dim"] - 1, channels)
            expected[f"gdn.{layer}.S"] = (cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                                          cfg["linear_value_head_dim"])
    assert {k: v.shape for k, v in tensors.items()} == expected

    fresh = model.session()
    with pytest.raises(lily.RequestError, match="unknown tensor 'kv.99.k'"):
        fresh._state.import_tensors(len(cases.PROMPT), {**tensors, "kv.99.k": tensors[next(iter(tensors))]})
    with pytest.raises(lily.RequestError, match="is missing"):
        fresh._state.import_tensors(len(cases.PROMPT), {k: v for k, v in tensors.items() if not k.endswith(".S")})
    with pytest.raises(lily.RequestError, match="does not fit this sequence's context of 8"):
        model.session(8)._state.import_tensors(len(cases.PROMPT), tensors)
    assert fresh.position == 0  # every refusal changed nothing

    # An import moves the sequence like a restore: a snapshot taken past its position is stale.
    snap = s._state.snapshot()
    early = model.session()
    early.prefill(np.asarray(cases.PROMPT[:5], np.int32))
    s._state.import_tensors(5, early._state.export_tensors())
    with pytest.raises(lily.RequestError, match="stale"):
        s._state.restore(snap)
