"""Helpers for the MSL-on-CPU tests: load a kernel file into a library and run one dispatch
through the same encoder calls the Metal backend makes (lily._core.msl_cpu).

$LILY_TEST_MSL_RUNTIME picks the runtime behind `msl_cpu.device(...)` in the kernel tests:
  unset or "cpu"   the MSL-on-CPU runtime (CI);
  "cuda"           an MSL-on-CUDA device (the GPU machine, scripts/h200/): `interleavings`
                   becomes threadgroups launched in a seeded permuted order, dispatches are
                   synchronous (a fault names its kernel); asan, metal4 and check_dependencies
                   are msl_cpu's own checks, so a test asking for one is skipped, saying so;
  "cuda-compile"   the CPU runtime runs the tests, and every library and function-constant
                   specialization they make is also compiled to PTX into the kernel cache
                   ($LILY_MSL_CUDA_CACHE), which the GPU machine (no clang) then loads.
"""

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from lily._core import msl_cpu as _msl_cpu
from lily._core import msl_cuda

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "msl" / "kernels"
# Kernels include the prelude (csrc/msl_cpu/prelude) and metal/ from this checkout, also when
# lily was installed from it by pip.
os.environ.setdefault("LILY_SOURCE_DIR", str(ROOT))
RUNTIME = os.environ.get("LILY_TEST_MSL_RUNTIME", "cpu")


class _OnCuda:
    """msl_cpu's module with device() made by lily._core.msl_cuda."""

    def device(self, asan=False, interleavings=0, check_dependencies=False, seed=0, include_dirs=(),
               metal4=False):
        for name, on in (("asan", asan), ("metal4", metal4), ("check_dependencies", check_dependencies)):
            if on:
                pytest.skip(f"{name}=True is an msl_cpu check with no msl-cuda counterpart")
        return msl_cuda.device(permute_threadgroups=interleavings > 0, seed=seed, synchronous=True,
                               include_dirs=list(include_dirs))

    def __getattr__(self, name):
        return getattr(_msl_cpu, name)


class _CompilingDevice:
    """An msl_cpu device whose libraries (and their specializations) are also compiled to PTX."""

    def __init__(self, device, include_dirs):
        self._device, self._include_dirs = device, list(include_dirs)

    def library(self, source, file_name):
        lib = self._device.library(source, file_name)
        msl_cuda.compile(source, file_name, self._include_dirs)
        return _CompilingLibrary(lib, source, file_name, self._include_dirs)

    def __getattr__(self, name):
        return getattr(self._device, name)


class _CompilingLibrary:
    def __init__(self, lib, source, file_name, include_dirs):
        self._lib, self._args = lib, (source, file_name, include_dirs)

    def pipeline(self, name, constants=None):
        pipeline = self._lib.pipeline(name, constants or {})
        if constants:
            msl_cuda.compile(*self._args, constants)
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


__all__ = ["msl_cpu", "library", "u32", "dispatch", "run", "read", "KERNELS", "ROOT", "RUNTIME"]
