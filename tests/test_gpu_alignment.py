"""Weights at misaligned addresses (found on an H200 via msl-cuda): mlx's safetensors writer does
not pad the JSON header, so a file's data section, and every tensor in it, may start at any byte
(the demo model's at 2 mod 16, its tensors at 2 mod 4). Kernels read those buffers as 32-bit
words, bfloat and float: CUDA faults ("misaligned address"), Metal's setBuffer:offset: requires
offsets aligned to the data the kernel consumes, and x86 (msl-cpu) reads them silently.

- The check: the MSL runtimes' encoder (msl_cpu/encoder.cpp, shared by msl-cpu and msl-cuda)
  rejects a dispatch whose device buffer is bound at an address not a multiple of
  max(4, alignof the parameter's element type), naming the kernel, the buffer index and
  parameter, and the offset; so every whole-model test on msl-cpu runs under it.
- The fix: DeviceWeights copies a misaligned file's data section into an aligned device buffer
  (gpu_weight_bytes reports the bytes copied); aligned files stay zero-copy.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from fixtures import cases
from msl_cpu_harness import RUNTIME, library, msl_cpu, u32
from test_metal_decode import _check


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


_SIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def _tensors(path: Path):
    """(data section start, [(begin, nbytes, alignment the GPU needs)]) of a safetensors file."""
    data, header = _header(path)
    return data, [(t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0], max(4, _SIZE.get(t["dtype"], 1)))
                  for name, t in header.items() if name != "__metadata__"]


def _misaligned(path: Path) -> bool:
    """Whether any tensor of the file is not at a multiple of max(4, its element size)."""
    data, tensors = _tensors(path)
    return any((data + begin) % align for begin, _, align in tensors)


def gpu_weight_bytes(path: Path, page: int) -> int:
    """The bytes DeviceWeights holds of a file: an aligned one wrapped whole (page-rounded); a
    misaligned one's data section copied, plus a copy of each tensor still misaligned in it."""
    if not _misaligned(path):
        return -(-path.stat().st_size // page) * page
    data, tensors = _tensors(path)
    return path.stat().st_size - data + sum(n for begin, n, align in tensors if begin % align)


def _demo(lily) -> Path:
    return Path(lily.__file__).resolve().parent / "demo"


@pytest.fixture(scope="module")
def dev():
    return msl_cpu.device()


# ---- the check -------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [1, 2, 6])
def test_misaligned_binding_is_rejected_naming_it(dev, offset):
    """A `device uint*` bound at an offset that is not a multiple of 4."""
    lib = library(dev, "scan.metal")
    enc = dev.command_buffer().compute_encoder()
    enc.set_pipeline(lib.pipeline("add_offsets"))
    enc.set_buffer(0, dev.buffer_empty(64), 0)
    enc.set_buffer(1, dev.buffer_empty(64), offset)
    enc.set_bytes(2, u32(4))
    with pytest.raises(ValueError, match=(
            rf"kernel 'add_offsets': buffer\(1\) \(block_offsets\) is bound at offset {offset} "
            rf"\(address {offset % 4} mod 4\): misaligned, it needs 4-byte alignment")):
        enc.dispatch_threadgroups((1,), (4,))
    enc.set_buffer(1, dev.buffer_empty(64), 8)  # aligned: the same dispatch encodes
    enc.dispatch_threadgroups((1,), (4,))


@pytest.mark.skipif(RUNTIME != "cpu", reason="msl_cuda's parameter tables carry no element alignment")
def test_vector_parameter_needs_its_alignment(dev):
    """A `device const float4*` bound at 8: aligned for words, not for its 16-byte element."""
    lib = library(dev, "arithmetic.metal")
    enc = dev.command_buffer().compute_encoder()
    enc.set_pipeline(lib.pipeline("vector_semantics"))
    for i in range(8):
        enc.set_buffer(i, dev.buffer_empty(4096), 0)
    enc.set_buffer(0, dev.buffer_empty(4096), 8)
    with pytest.raises(ValueError, match=(
            r"kernel 'vector_semantics': buffer\(0\) \(in\) is bound at offset 8 \(address 8 mod 16\): "
            r"misaligned, it needs 16-byte alignment \(alignof its element type\)")):
        enc.dispatch_threadgroups((1,), (32,))


# ---- the fix ---------------------------------------------------------------------------------


def test_demo_model_is_misaligned_and_copied(lily):
    """The demo (mlx-written) loads on msl-cpu under the check, its tensors copied to an aligned
    buffer, and matches the CPU backend."""
    path = _demo(lily) / "model.safetensors"
    data, _ = _header(path)
    assert data % 4 == 2 and _misaligned(path)  # the file as mlx_lm.convert wrote it
    gpu = lily.Model.load(_demo(lily), backend="msl-cpu", backend_options=cases.F32_KV)
    cpu = lily.Model.load(_demo(lily), backend="cpu", cpu_matmul="f32")
    total, copied = gpu._engine.gpu_weight_bytes
    assert copied == path.stat().st_size - data == total  # one copy of the data section
    prompt = cases.PROMPT[:12]
    s, c = gpu.session(), cpu.session()
    _check(s.prefill(prompt, all_logits=True), c.prefill(prompt, all_logits=True), "demo prefill vs cpu backend")
    _check(s.decode(prompt[0]), c.decode(prompt[0]), "demo decode vs cpu backend")
    # Greedy (the demo's generation_config samples): the device decode loop too.
    want = cpu.generate(cases.GEN_PROMPT, max_tokens=6, temperature=0).tokens
    assert gpu.generate(cases.GEN_PROMPT, max_tokens=6, temperature=0).tokens == want


def _pad_header(src: Path, dst: Path, to: int) -> None:
    """src with its JSON header padded with spaces so the data section starts at a multiple of `to`."""
    data, _ = _header(src)
    raw = src.read_bytes()
    blob = raw[8:data]
    blob += b" " * (-(8 + len(blob)) % to)
    dst.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[data:])


def test_aligned_file_stays_zero_copy(lily, tmp_path):
    """The same demo with a padded header: every tensor aligned, nothing copied, same logits."""
    demo = _demo(lily)
    for f in demo.iterdir():
        if f.suffix == ".safetensors":
            _pad_header(f, tmp_path / f.name, 16)
        elif f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    assert not _misaligned(tmp_path / "model.safetensors")
    gpu = lily.Model.load(tmp_path, backend="msl-cpu", backend_options=cases.F32_KV)
    total, copied = gpu._engine.gpu_weight_bytes
    assert copied == 0 and total >= (tmp_path / "model.safetensors").stat().st_size
    copy = lily.Model.load(demo, backend="msl-cpu", backend_options=cases.F32_KV)
    prompt = cases.PROMPT[:8]
    got = gpu.session().prefill(prompt, all_logits=True)
    np.testing.assert_array_equal(got, copy.session().prefill(prompt, all_logits=True))
