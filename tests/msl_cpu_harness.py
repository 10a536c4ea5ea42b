"""Helpers for the MSL-on-CPU tests: load a kernel file into a library and run dispatches
through the same encoder calls the Metal backend makes (lily._core.msl_cpu).

Buffers are bound by the kernel's parameter names ({"x": buf, "args": kernel_args.GemvArgs(...)}),
or by [[buffer(i)]] index for the small test kernels; argument structs are the host's own
(lily._core.kernel_args, filled by field name).

$LILY_TEST_MSL_RUNTIME picks the runtime behind `msl_cpu.device(...)` in the kernel tests:
  unset or "cpu"   the MSL-on-CPU runtime (CI);
  "cuda"           an MSL-on-CUDA device (the GPU machine, scripts/h200/): `interleavings`
                   becomes threadgroups launched in a seeded permuted order, dispatches are
                   synchronous (a fault names its kernel); asan, metal4, check_dependencies and
                   the fault injection and reported sizes of msl_cpu's device are msl_cpu's own,
                   so a test asking for one is skipped, saying so;
  "cuda-compile"   the CPU runtime runs the tests, and every library and function-constant
                   specialization they make is also compiled to PTX into the kernel cache
                   ($LILY_MSL_CUDA_CACHE), which the GPU machine (no clang) then loads (MSL 4.0
                   libraries excepted: msl_cuda has no Metal 4 tensors).
"""

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from lily._core import kernel_args, msl_cuda
from lily._core import msl_cpu as _msl_cpu

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "msl" / "kernels"
# Kernels include the prelude (csrc/msl_cpu/prelude) and metal/ from this checkout, also when
# lily was installed from it by pip.
os.environ.setdefault("LILY_SOURCE_DIR", str(ROOT))
RUNTIME = os.environ.get("LILY_TEST_MSL_RUNTIME", "cpu")


class _OnCuda:
    """msl_cpu's module with device() made by lily._core.msl_cuda."""

    # msl_cpu.device's own options and their defaults (a test that sets one is skipped).
    _CPU_ONLY = {"asan": False, "metal4": False, "check_dependencies": False, "apple_gpu_family": 7,
                 "working_set": 0, "fail_dispatch": "", "fail_dispatch_count": 1, "fail_library": ""}

    def device(self, interleavings=0, seed=0, include_dirs=(), **options):
        for name, value in options.items():
            if name not in self._CPU_ONLY:
                raise TypeError(f"device() got an unexpected keyword argument {name!r}")
            if value != self._CPU_ONLY[name]:
                pytest.skip(f"{name}={value!r} is an msl_cpu option with no msl-cuda counterpart")
        return msl_cuda.device(permute_threadgroups=interleavings > 0, seed=seed, synchronous=True,
                               include_dirs=list(include_dirs))

    def __getattr__(self, name):
        return getattr(_msl_cpu, name)


class _CompilingDevice:
    """An msl_cpu device whose libraries (and their specializations) are also compiled to PTX."""

    def __init__(self, device, include_dirs):
        self._device, self._include_dirs = device, list(include_dirs)

    def library(self, source, file_name, language="3.1", safe_math=False):
        lib = self._device.library(source, file_name, language=language, safe_math=safe_math)
        if language == "4.0":  # Metal 4 tensors: msl_cuda runs the simdgroup_matrix GEMMs instead
            return lib
        msl_cuda.compile(source, file_name, self._include_dirs, safe_math=safe_math)
        return _CompilingLibrary(lib, source, file_name, self._include_dirs, safe_math)

    def __getattr__(self, name):
        return getattr(self._device, name)


class _CompilingLibrary:
    def __init__(self, lib, source, file_name, include_dirs, safe_math):
        self._lib, self._args, self._safe_math = lib, (source, file_name, include_dirs), safe_math

    def pipeline(self, name, constants=None):
        pipeline = self._lib.pipeline(name, constants or {})
        if constants:
            msl_cuda.compile(*self._args, constants, safe_math=self._safe_math)
        return pipeline


class _CompilingForCuda:
    def device(self, include_dirs=(), **options):
        return _CompilingDevice(_msl_cpu.device(include_dirs=list(include_dirs), **options), include_dirs)

    def __getattr__(self, name):
        return getattr(_msl_cpu, name)


if RUNTIME == "cuda":
    msl_cpu = _OnCuda()
elif RUNTIME == "cuda-compile":
    from lily.msl_cuda import use_wheel_toolchain

    use_wheel_toolchain()
    msl_cpu = _CompilingForCuda()
elif RUNTIME == "cpu":
    msl_cpu = _msl_cpu
else:
    raise ValueError(f"LILY_TEST_MSL_RUNTIME={RUNTIME!r}: expected cpu, cuda or cuda-compile")


def library(device, name, language="3.1"):
    """A test kernel file of tests/msl/kernels/."""
    path = KERNELS / name
    return device.library(path.read_text(), str(path.relative_to(ROOT)), language=language)


def kernels(device, name):
    """metal/<name> compiled as the backend compiles it: local #includes inlined (the kernel
    templates of its headers with it), with the backend's options (the *_tensor libraries as
    MSL 4.0, sampling with safe math: msl_cpu.library_options)."""
    language, safe_math = msl_cpu.library_options(name)
    return device.library(msl_cpu.kernel_source(name), f"metal/{name}", language=language, safe_math=safe_math)


def u32(*values):
    return struct.pack(f"{len(values)}I", *values)


def dispatch(device, pipeline, grid, threads, buffers, threadgroup_memory=None):
    """Encode and run one dispatch. buffers: {parameter name or index: msl_cpu.Buffer | bytes |
    kernel_args struct}."""
    run(device, [(pipeline, grid, threads, buffers, threadgroup_memory)])


class Table:
    """A table of argument structs (kernel_args.AttnSeq / GdnSeq: one per sequence) sent with
    set_bytes, and the buffers its entries hold the addresses of (`uses`: (buffer, written)
    pairs), declared to the encoder with use_resource as the host declares them."""

    def __init__(self, entries, uses=()):
        self.entries, self.uses = list(entries), list(uses)


def bind(encoder, pipeline, buffers):
    """Binds buffers by the kernel's parameter names (or indices) to an encoder: msl_cpu.Buffer,
    bytes, a kernel_args struct or a Table."""
    names = pipeline.buffers
    for key, b in buffers.items():
        if isinstance(key, str):
            if key not in names:
                raise KeyError(f"kernel '{pipeline.name}' has no buffer parameter '{key}' (it has: "
                               f"{', '.join(sorted(names, key=names.get))})")
            index = names[key]
        else:
            index = key
        if isinstance(b, Table):
            encoder.set_bytes(index, b"".join(bytes(e) for e in b.entries))
            for buf, written in b.uses:
                encoder.use_resource(buf, written)
        elif isinstance(b, (bytes, bytearray)):
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


__all__ = ["msl_cpu", "kernel_args", "library", "kernels", "u32", "dispatch", "bind", "run", "read", "Table", "KERNELS",
           "ROOT", "RUNTIME"]
