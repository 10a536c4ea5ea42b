"""Run examples/add_a_kernel/swiglu.metal on the MSL-on-CPU runtime and compare it with NumPy.

    python examples/add_a_kernel/run.py

This is the loop docs/add-a-kernel.md walks through: a reference in Python, the kernel in MSL,
the dispatch exactly as the Metal host encodes it, and a comparison with per-dtype tolerances.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
# The runtime compiles kernels against the prelude and metal/ of this checkout.
os.environ.setdefault("LILY_SOURCE_DIR", str(HERE.parent.parent))

from lily._core import msl_cpu  # noqa: E402

THREADS = 256  # threads per threadgroup
TOLERANCE = {"float": 1e-6, "half": 1e-3}


def reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU in float64, the ground truth."""
    g = gate.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * up.astype(np.float64)


def run_kernel(device: Any, library: Any, gate: np.ndarray, up: np.ndarray, dtype: str) -> np.ndarray:
    n = gate.size
    out = device.buffer_empty(gate.nbytes)
    cb = device.command_buffer()
    enc = cb.compute_encoder()
    enc.set_pipeline(library.pipeline(f"swiglu_{dtype}"))
    enc.set_bytes(0, struct.pack("I", n))
    enc.set_buffer(1, device.buffer(gate), 0)
    enc.set_buffer(2, device.buffer(up), 0)
    enc.set_buffer(3, out, 0)
    enc.dispatch_threadgroups(((n + THREADS - 1) // THREADS, 1, 1), (THREADS, 1, 1))
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()
    return np.frombuffer(out.read(), dtype=gate.dtype).copy()


def check(n: int, dtype: str, device: Any = None) -> float:
    """Runs one size and dtype; returns the max relative error (raises if over tolerance)."""
    device = device or msl_cpu.device()
    library = device.library((HERE / "swiglu.metal").read_text(), "examples/add_a_kernel/swiglu.metal")
    rng = np.random.default_rng(n)
    np_dtype = np.float32 if dtype == "float" else np.float16
    gate = rng.standard_normal(n).astype(np_dtype) * 3
    up = rng.standard_normal(n).astype(np_dtype)
    got = run_kernel(device, library, gate, up, dtype).astype(np.float64)
    want = reference(gate, up)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    if err > TOLERANCE[dtype]:
        raise AssertionError(f"swiglu_{dtype} n={n}: max relative error {err:.2e} > {TOLERANCE[dtype]}")
    return err


if __name__ == "__main__":
    for dtype in ("float", "half"):
        for n in (31, 32, 33, 1000):
            print(f"swiglu_{dtype:5s} n={n:5d}  max rel err {check(n, dtype):.1e}")
