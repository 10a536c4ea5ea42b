"""Helpers for the MSL-on-CPU tests: load a kernel file into a library and run one dispatch
through the same encoder calls the Metal backend makes (lily._core.msl_cpu)."""

import os
import struct
from pathlib import Path

import numpy as np

from lily._core import msl_cpu

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "msl" / "kernels"
# Kernels include the prelude (csrc/msl_cpu/prelude) and metal/ from this checkout, also when
# lily was installed from it by pip.
os.environ.setdefault("LILY_SOURCE_DIR", str(ROOT))


def library(device, name):
    path = KERNELS / name
    return device.library(path.read_text(), str(path.relative_to(ROOT)))


def u32(*values):
    return struct.pack(f"{len(values)}I", *values)


def dispatch(device, pipeline, grid, threads, buffers, threadgroup_memory=None):
    """Encode and run one dispatch. buffers: {index: msl_cpu.Buffer | bytes}."""
    run(device, [(pipeline, grid, threads, buffers, threadgroup_memory)])


def run(device, steps):
    """Encode every step (pipeline, grid, threads, buffers[, threadgroup_memory]) into one
    serial encoder of one command buffer, commit and wait once (as a forward pass does)."""
    cb = device.command_buffer()
    enc = cb.compute_encoder()
    for pipeline, grid, threads, buffers, *tgmem in steps:
        enc.set_pipeline(pipeline)
        for index, b in buffers.items():
            if isinstance(b, bytes):
                enc.set_bytes(index, b)
            else:
                enc.set_buffer(index, b, 0)
        for index, length in ((tgmem[0] if tgmem else None) or {}).items():
            enc.set_threadgroup_memory_length(index, length)
        enc.dispatch_threadgroups(grid, threads)
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()


def read(buffer, dtype, shape=None):
    a = np.frombuffer(buffer.read(), dtype=dtype).copy()
    return a.reshape(shape) if shape is not None else a


__all__ = ["msl_cpu", "library", "u32", "dispatch", "run", "read", "KERNELS", "ROOT"]
