"""Helpers for the MSL-on-CPU tests: load a kernel file into a library and run dispatches
through the same encoder calls the Metal backend makes (lily._core.msl_cpu).

Buffers are bound by the kernel's parameter names ({"x": buf, "args": kernel_args.GemvArgs(...)}),
or by [[buffer(i)]] index for the small test kernels; argument structs are the host's own
(lily._core.kernel_args, filled by field name)."""

import os
import struct
from pathlib import Path

import numpy as np

from lily._core import kernel_args, msl_cpu

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "msl" / "kernels"
# Kernels include the prelude (csrc/msl_cpu/prelude) and metal/ from this checkout, also when
# lily was installed from it by pip.
os.environ.setdefault("LILY_SOURCE_DIR", str(ROOT))


def library(device, name, language="3.1"):
    """A test kernel file of tests/msl/kernels/."""
    path = KERNELS / name
    return device.library(path.read_text(), str(path.relative_to(ROOT)), language=language)


def kernels(device, name):
    """metal/<name> compiled as the backend compiles it: local #includes inlined (the kernel
    templates of its headers with it), the *_tensor libraries as MSL 4.0, sampling with safe math."""
    language = "4.0" if name.endswith("_tensor.metal") else "3.1"
    return device.library(msl_cpu.kernel_source(name), f"metal/{name}", language=language,
                          safe_math=name == "sampling.metal")


def u32(*values):
    return struct.pack(f"{len(values)}I", *values)


def dispatch(device, pipeline, grid, threads, buffers, threadgroup_memory=None):
    """Encode and run one dispatch. buffers: {parameter name or index: msl_cpu.Buffer | bytes |
    kernel_args struct}."""
    run(device, [(pipeline, grid, threads, buffers, threadgroup_memory)])


def bind(encoder, pipeline, buffers):
    """Binds buffers by the kernel's parameter names (or indices) to an encoder."""
    names = pipeline.buffers
    for key, b in buffers.items():
        if isinstance(key, str):
            if key not in names:
                raise KeyError(f"kernel '{pipeline.name}' has no buffer parameter '{key}' (it has: "
                               f"{', '.join(sorted(names, key=names.get))})")
            index = names[key]
        else:
            index = key
        if isinstance(b, (bytes, bytearray)):
            encoder.set_bytes(index, bytes(b))
        elif hasattr(type(b), "nbytes") and hasattr(b, "__bytes__"):  # a kernel_args struct
            encoder.set_bytes(index, bytes(b))
        else:
            encoder.set_buffer(index, b, 0)


def run(device, steps):
    """Encode every step (pipeline, grid, threads, buffers[, threadgroup_memory]) into one
    serial encoder of one command buffer, commit and wait once (as a forward pass does)."""
    cb = device.command_buffer()
    enc = cb.compute_encoder()
    for pipeline, grid, threads, buffers, *tgmem in steps:
        enc.set_pipeline(pipeline)
        bind(enc, pipeline, buffers)
        for index, length in ((tgmem[0] if tgmem else None) or {}).items():
            enc.set_threadgroup_memory_length(index, length)
        enc.dispatch_threadgroups(grid, threads)
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()


def read(buffer, dtype, shape=None):
    a = np.frombuffer(buffer.read(), dtype=dtype).copy()
    return a.reshape(shape) if shape is not None else a


__all__ = ["msl_cpu", "kernel_args", "library", "kernels", "u32", "dispatch", "bind", "run", "read", "KERNELS",
           "ROOT"]
