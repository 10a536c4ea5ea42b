"""The worked example of docs/add-a-kernel.md runs as documented: the SwiGLU kernel matches
its NumPy reference on sizes around the SIMD width, passes the Metal lint, and the runtime's
AddressSanitizer mode catches the bug the page shows (a kernel without its bounds check)."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "add_a_kernel"


def _example():
    spec = importlib.util.spec_from_file_location("add_a_kernel_run", EXAMPLE / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", ["float", "half"])
@pytest.mark.parametrize("n", [31, 32, 33, 1000])
def test_swiglu_kernel_matches_numpy(n, dtype):
    assert _example().check(n, dtype) <= _example().TOLERANCE[dtype]


def test_swiglu_kernel_passes_the_metal_lint():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_metal.py"), str(EXAMPLE / "swiglu.metal")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_missing_bounds_check_is_caught_by_asan():
    """The page's bug: drop the bounds check and the grid's extra threads write past `out`.
    ASan needs its runtime loaded first, hence a fresh interpreter (as tests/test_msl_cpu_bugs.py)."""
    import lily

    clang = "clang-19"
    runtime = subprocess.run([clang, f"-print-file-name=libclang_rt.asan-{platform.machine()}.so"],
                             capture_output=True, text=True).stdout.strip()
    assert Path(runtime).is_file(), f"no ASan runtime from {clang} (Debian: libclang-rt-19-dev)"
    script = textwrap.dedent(f"""
        import importlib.util, numpy as np
        spec = importlib.util.spec_from_file_location("run", {str(EXAMPLE / "run.py")!r})
        ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)
        broken = open({str(EXAMPLE / "swiglu.metal")!r}).read().replace("if (gid >= n) return;", "")
        dev = ex.msl_cpu.device(asan=True)
        lib = dev.library(broken, "swiglu_without_bounds_check.metal")
        x = np.ones(33, np.float32)  # two threadgroups of 256 threads for 33 elements
        ex.run_kernel(dev, lib, x, x, "float")
        print("NOT CAUGHT", flush=True)
    """)
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0",
               PYTHONPATH=str(Path(lily.__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "NOT CAUGHT" not in r.stdout
    assert r.returncode != 0
    assert "AddressSanitizer" in r.stderr, r.stderr[-3000:]
