"""The CPU backend's element-wise maps through exp (cpu::map_elementwise in csrc/cpu/simd.h:
the DeltaNet conv's SiLU, its gated norm, the attention's output gate, SwiGLU), built once per
instruction set and checked against NumPy.

tests/native/elementwise_driver.cpp is built for plain x86-64 (libm's exp per value), x86-64-v3
(AVX2: exp_ps on 8 lanes, the tail copied into a padded vector), x86-64-v4 (AVX-512: 16 lanes,
a masked tail) and arm64 (run under qemu-user). Asserted for each build:
- silu(x), sigmoid(x) and silu(x) * u agree with NumPy in float64 to within 1e-6 relative (plus
  1e-30 absolute, for values below float32's normal range), over random values and the edges:
  0, -0, tiny, and +-10, 87, 88, 89, 100, 1e30 (where exp(-x) overflows: 0, not a small value),
  and NaN (NaN out, as libm gives);
- a value's result does not depend on where it sits: every sub-range of length 1..40 at offsets
  0..3 gives, bit for bit, the whole-array call's values (the driver checks it and fails), and
  writes nothing past its end; in place equals out of place;
- scale_max (attention's scaled scores and their running maximum, 16 lanes at a time) gives the
  scalar loop's products bit for bit and its maximum, NaN and signed zeros among the inputs,
  over every sub-range of length 0..40 (the driver checks it and fails).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fixtures.host import x86_flags

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "native" / "elementwise_driver.cpp"
FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", f"-I{ROOT / 'csrc'}"]


# name -> (compiler, flags, runner prefix, host CPU flags needed)
BUILDS = {
    "x86-64": ("g++", ["-march=x86-64"], [], set()),
    "x86-avx2": ("g++", ["-march=x86-64-v3"], [], {"avx2", "fma"}),
    # -Wno-maybe-uninitialized: GCC 12 warns inside its own avx512fintrin.h (the `__Y = __Y` of
    # _mm512_undefined_ps, which the masked intrinsics use), a false positive.
    "x86-avx512": ("g++", ["-march=x86-64-v4", "-Wno-maybe-uninitialized"], [],
                   {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "arm64": ("aarch64-linux-gnu-g++", ["-march=armv8.2-a+dotprod", "-static"], ["qemu-aarch64", "-cpu", "max"], set()),
}


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    edges = [0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, np.nan]
    for v in (10.0, 87.0, 88.0, 89.0, 100.0):
        edges += [v, -v]
    x = np.concatenate([np.array(edges), rng.normal(0, 4, 301)]).astype(np.float32)
    u = rng.normal(0, 2, x.size).astype(np.float32)
    return x, u


@pytest.mark.parametrize("build", list(BUILDS))
def test_map_elementwise_matches_numpy_and_is_position_invariant(build, tmp_path):
    cxx, flags, runner, needs = BUILDS[build]
    if runner:
        for tool, package in ((cxx, "g++-aarch64-linux-gnu"), (runner[0], "qemu-user")):
            if shutil.which(tool) is None:
                pytest.fail(f"{tool} not found: install the Debian package {package} (scripts/test.sh does)")
    elif platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 build: this host runs only the arm64 one")
    missing = needs - x86_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    exe = tmp_path / "driver"
    r = subprocess.run([cxx, *FLAGS, *flags, str(DRIVER), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr, r.stderr[-4000:]

    x, u = _inputs()
    (tmp_path / "in.bin").write_bytes(np.uint32(x.size).tobytes() + x.tobytes() + u.tobytes())
    r = subprocess.run([*runner, str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"driver exit {r.returncode}: {r.stderr[-4000:]}"
    silu, sigmoid, swiglu = np.fromfile(tmp_path / "out.bin", np.float32).reshape(3, x.size).astype(np.float64)

    xd, ud = x.astype(np.float64), u.astype(np.float64)
    with np.errstate(over="ignore"):
        ref_sigmoid = 1.0 / (1.0 + np.exp(-xd))
    ref = {"silu": xd * ref_sigmoid, "sigmoid": ref_sigmoid, "swiglu": xd * ref_sigmoid * ud}
    for name, got in (("silu", silu), ("sigmoid", sigmoid), ("swiglu", swiglu)):
        nan = np.isnan(ref[name])
        assert np.array_equal(np.isnan(got), nan), f"{build} {name}: NaN where NumPy has none, or none where it has"
        got, want = got[~nan], ref[name][~nan]
        err = np.abs(got - want)
        bound = 1e-6 * np.abs(want) + 1e-30
        bad = np.flatnonzero(err > bound)
        assert bad.size == 0, (f"{build} {name}: {bad.size} values off, e.g. x={x[~nan][bad[:4]]} "
                               f"got {got[bad[:4]]} want {want[bad[:4]]}")
