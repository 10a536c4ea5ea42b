"""The GPU host fails safe and fits memory (issue 16, section 3), on the MSL-on-CPU runtime with
its fault injection and a device that reports a small working set (backend_options):

- an exception while a pass is encoded (a failing dispatch, as a pipeline limit or a bad shape
  would raise) discards that command buffer: nothing of it runs, the sequence keeps its
  position and recurrent state, and the next request gives the CPU backend's results; also
  when the failure is in a step of the device decode loop;
- the weights plus the KV cache and recurrent state of the context a sequence is created with
  must fit the GPU's recommended working set: the default context is capped to what fits (the
  sizes computed here from config.json and the checkpoint files), an explicit larger one is
  refused naming the sizes;
- opaque buffers (msl_cpu's `opaque_buffers`, standing in for msl-cuda's device memory): bytes
  move only through Buffer read / write / fill and Device.copy, checked against their ranges,
  and kernels still see them (the whole-model runs on such buffers are scripts/test.sh's
  LILY_TEST_OPAQUE_BUFFERS pass).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fixtures import cases
from lily._core import msl_cpu
from msl_cpu_harness import library, u32
from test_gpu_alignment import gpu_weight_bytes
from test_metal_decode import _check

MODEL = ("qwen3_5_moe", 4, 64, "bfloat16")  # head_dim 96, float KV: attn_decode_float_d96
F32_KV = cases.F32_KV  # the steps are compared with the CPU backend at TOL_MLX


def test_failure_while_encoding_a_decode_step(store, lily):
    """The decode kernel of attention fails on its first dispatch, after the DeltaNet layers
    before it were encoded: were that pass not discarded (or the state's copies not put back),
    the next step would read a DeltaNet state the failed step never wrote."""
    path = store.mlx(*MODEL)
    gpu = lily.Model.load(path, backend="msl-cpu", backend_options=dict(fail_dispatch="attn_decode_float_d96", **F32_KV))
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32")
    prompt = cases.PROMPT[:8]
    s, c = gpu.session(), cpu.session()
    _check(s.prefill(prompt), c.prefill(prompt), "prefill (flash attention: no decode kernel)")
    with pytest.raises(lily.LilyError, match=r"kernel 'attn_decode_float_d96': injected failure while encoding"):
        s.decode(cases.PROMPT[8])
    assert s.position == len(prompt)
    # The retried step is one command buffer and one wait: the failed one was dropped, not
    # committed along with it.
    _, _, cb0, w0, _ = gpu._engine.gpu_stats
    _check(s.decode(cases.PROMPT[8]), c.decode(cases.PROMPT[8]), "the retried decode step")
    _, _, cb1, w1, _ = gpu._engine.gpu_stats
    assert (cb1 - cb0, w1 - w0) == (1, 1)
    for i in range(9, 11):
        _check(s.decode(cases.PROMPT[i]), c.decode(cases.PROMPT[i]), f"decode at {i} after the failed step")
    assert gpu.generate(cases.GEN_PROMPT, max_tokens=4).tokens == cpu.generate(cases.GEN_PROMPT, max_tokens=4).tokens


def test_failure_while_encoding_a_device_loop_step(store, lily):
    """The device decode loop's first sample dispatch fails: the generation raises, and the next
    one (on a fresh and on the same session) gives the CPU backend's tokens."""
    path = store.mlx(*MODEL)
    gpu = lily.Model.load(path, backend="msl-cpu", backend_options=dict(fail_dispatch="sample", **F32_KV),
                          max_batch=1)  # one generation at a time: its own device loop
    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32")
    with pytest.raises(lily.LilyError, match="kernel 'sample': injected failure"):
        gpu.generate(cases.GEN_PROMPT, max_tokens=4)
    want = cpu.generate(cases.GEN_PROMPT, max_tokens=4).tokens
    assert gpu.generate(cases.GEN_PROMPT, max_tokens=4).tokens == want


def _sizes(path):
    """(weight bytes the GPU wraps, state bytes per context position, state bytes independent
    of the context), from config.json and the checkpoint's files."""
    cfg = json.loads((path / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    kinds = t["layer_types"]
    attn, gdn = kinds.count("full_attention"), kinds.count("linear_attention")
    per_token = attn * 2 * t["num_key_value_heads"] * t["head_dim"] * 4  # K and V, f32
    hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    conv_channels = 2 * hk * dk + hv * dv
    fixed = gdn * 2 * 4 * ((t["linear_conv_kernel_dim"] - 1) * conv_channels + hv * dk * dv)  # two copies
    page = os.sysconf("SC_PAGESIZE")
    # Aligned files wrapped whole, misaligned ones (mlx's unpadded header) copied: test_gpu_alignment.py.
    weights = sum(gpu_weight_bytes(f, page) for f in path.glob("*.safetensors"))
    return weights, per_token, fixed


def test_context_must_fit_the_working_set(store, lily):
    path = store.mlx(*MODEL)
    weights, per_token, fixed = _sizes(path)
    ws = weights + fixed + 100 * per_token + per_token // 2  # room for 100 positions, not 101
    opts = dict(working_set=ws, **F32_KV)  # (_sizes counts f32 K and V)
    m = lily.Model.load(path, backend="msl-cpu", backend_options=opts)
    assert m._engine.max_fitting_context == 100
    assert m.max_context == 100 and m.session().max_context == 100  # the default, capped
    with pytest.raises(lily.ConfigError) as e:
        m.session(101)
    msg = str(e.value)
    assert "a context of 101 tokens needs" in msg and "more than the GPU's recommended working set" in msg
    assert "at most 100 tokens fit" in msg and "weights" in msg and "KV cache and recurrent state" in msg
    with pytest.raises(lily.ConfigError, match="a context of 101 tokens needs"):
        lily.Model.load(path, backend="msl-cpu", max_context=101, backend_options=opts)
    assert lily.Model.load(path, backend="msl-cpu", max_context=60, backend_options=opts).max_context == 60
    with pytest.raises(lily.ConfigError, match="the weights alone do not fit"):
        lily.Model.load(path, backend="msl-cpu", backend_options=dict(working_set=weights // 2))
    # The CPU backend and a device without a reported limit keep the model's full context.
    full = json.loads((path / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert lily.Model.load(path, backend="msl-cpu").max_context == full


def test_opaque_buffers_move_bytes_without_host_storage():
    dev = msl_cpu.device(opaque_buffers=True)
    assert not dev.unified_memory and "opaque buffers" in dev.name and msl_cpu.device().unified_memory
    x = np.arange(64, dtype=np.float32)
    a, b = dev.buffer(x), dev.buffer_empty(4 * 64)
    a.fill(8, 0xFF, 8)  # x[2], x[3] -> NaN bit patterns
    dev.copy(b, 4, a, 0, 4 * 63)  # b[1:] = a[:63]
    got = np.frombuffer(b.read(), np.float32)
    want = np.concatenate([[0], x[:63]]).astype(np.float32)
    want.view(np.uint32)[3:5] = 0xFFFFFFFF
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    for bad in (lambda: dev.copy(b, 8, a, 0, 4 * 63), lambda: a.fill(250, 0, 7),
                lambda: b.write(np.zeros(2, np.float32), 4 * 63)):
        with pytest.raises(ValueError, match="do not fit in a buffer of 256"):
            bad()
    # A kernel reads and writes them as any buffer (reduce_tree: per-threadgroup sums of `in`).
    lib = library(dev, "reduce.metal")
    out = dev.buffer_empty(4)
    cb = dev.command_buffer()
    enc = cb.compute_encoder()
    enc.set_pipeline(lib.pipeline("reduce_tree"))
    enc.set_buffer(0, dev.buffer(x), 0)
    enc.set_buffer(1, out, 0)
    enc.set_bytes(2, u32(64, 64))
    enc.set_threadgroup_memory_length(0, 256)
    enc.dispatch_threadgroups((1,), (64,))
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()
    assert np.frombuffer(out.read(), np.float32)[0] == x.sum()
