"""The MSL-on-CPU runtime finds GPU bugs that would otherwise only show on a Mac, as hangs or
wrong numbers: each kernel in tests/msl/kernels/bugs.metal has one, and each is caught with an
error that names the kernel."""

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from msl_cpu_harness import ROOT, dispatch, library, msl_cpu, read, u32

BUGS = "tests/msl/kernels/bugs.metal"


def line_of(snippet):
    """The line of bugs.metal that holds `snippet` (errors must point at it)."""
    lines = (ROOT / BUGS).read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if snippet in line]
    assert len(hits) == 1, snippet
    return hits[0]


@pytest.fixture(scope="module")
def dev():
    return msl_cpu.device()


@pytest.fixture(scope="module")
def bugs(dev):
    return library(dev, "bugs.metal")


def test_divergent_barrier(dev, bugs):
    # Threads 40..63 return early; 0..39 wait at the barrier forever on a GPU.
    out = dev.buffer_empty(4 * 64)
    with pytest.raises(ValueError) as e:
        dispatch(dev, bugs.pipeline("divergent_barrier"), (1,), (64,), {0: out, 1: u32(40)})
    msg = str(e.value)
    assert "kernel 'divergent_barrier'" in msg
    barrier = line_of("threadgroup_barrier(mem_flags::mem_threadgroup);")
    assert f"threadgroup_barrier at {BUGS}:{barrier} is not reached by every thread" in msg
    assert "threads 0-39 wait at threadgroup_barrier" in msg and "threads 40-63 returned" in msg


def test_divergent_barrier_is_fine_when_uniform(dev, bugs):
    # The same kernel is correct when no thread returns early.
    out = dev.buffer_empty(4 * 64)
    dispatch(dev, bugs.pipeline("divergent_barrier"), (1,), (64,), {0: out, 1: u32(64)})
    np.testing.assert_array_equal(read(out, np.float32), np.arange(64) ^ 1)


def test_divergent_simdgroup_collective(dev, bugs):
    out = dev.buffer_empty(4 * 32)
    with pytest.raises(ValueError) as e:
        dispatch(dev, bugs.pipeline("divergent_simd_sum"), (1,), (32,), {0: out})
    msg = str(e.value)
    assert "kernel 'divergent_simd_sum'" in msg
    assert (
        f"simd_sum at {BUGS}:{line_of('x = simd_sum(x)')} is not reached by every lane of the simdgroup"
        in msg
    )
    assert "threads 16-31 returned" in msg


def test_missing_barrier_found_by_randomized_interleaving(bugs):
    x = np.arange(256, dtype=np.float32)
    # Default order: no error is raised (the result is simply wrong, as on a GPU it might be
    # right or wrong by chance)...
    plain = msl_cpu.device()
    lib = library(plain, "bugs.metal")
    out = plain.buffer_empty(4 * 256)
    dispatch(plain, lib.pipeline("missing_barrier"), (2,), (128,), {0: plain.buffer(x), 1: out})
    # ...with randomized interleavings the dependence on thread order is reported.
    checked = msl_cpu.device(interleavings=4, seed=1)
    lib = library(checked, "bugs.metal")
    out = checked.buffer_empty(4 * 256)
    with pytest.raises(ValueError) as e:
        dispatch(
            checked, lib.pipeline("missing_barrier"), (2,), (128,), {0: checked.buffer(x), 1: out}
        )
    msg = str(e.value)
    assert "kernel 'missing_barrier': the result depends on the order its threads run in" in msg
    assert "buffer(1) 'out' differs" in msg and "threadgroup_barrier is missing" in msg


def test_interleaving_check_passes_correct_kernels():
    checked = msl_cpu.device(interleavings=3, seed=2)
    lib = library(checked, "reduce.metal")
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = checked.buffer_empty(4 * 4)
    dispatch(
        checked,
        lib.pipeline("reduce_tree"),
        (4,),
        (128,),
        {0: checked.buffer(x), 1: out, 2: u32(1000, 250)},
        {0: 4 * 128},
    )
    ref = x.astype(np.float64).reshape(4, 250).sum(1)
    np.testing.assert_allclose(read(out, np.float32), ref, rtol=1e-5, atol=1e-4)


def _produce_consume(device, barrier):
    lib = library(device, "bugs.metal")
    data = device.buffer(np.zeros(64, np.float32))
    out = device.buffer_empty(4 * 64)
    cb = device.command_buffer()
    enc = cb.compute_encoder(concurrent=True)
    enc.set_pipeline(lib.pipeline("produce"))
    enc.set_buffer(0, data, 0)
    enc.dispatch_threadgroups((2,), (32,))
    if barrier:
        enc.memory_barrier()
    enc.set_pipeline(lib.pipeline("consume"))
    enc.set_buffer(1, out, 0)
    enc.dispatch_threadgroups((2,), (32,))
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()
    return read(out, np.float32)


def test_undeclared_dependency_between_dispatches():
    checked = msl_cpu.device(check_dependencies=True)
    with pytest.raises(ValueError) as e:
        _produce_consume(checked, barrier=False)
    msg = str(e.value)
    assert "dispatches 0 (kernel 'produce') and 1 (kernel 'consume')" in msg
    assert "not independent" in msg and "Add memory_barrier()" in msg


def test_declared_dependency_passes():
    checked = msl_cpu.device(check_dependencies=True)
    np.testing.assert_array_equal(_produce_consume(checked, barrier=True), 2 * np.arange(64) + 1)


def test_asan_needs_its_runtime():
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.fail("run this test without LD_PRELOAD")
    dev = msl_cpu.device(asan=True)
    with pytest.raises(ValueError, match="asan=True needs the AddressSanitizer runtime"):
        library(dev, "bugs.metal")


def _clang_file(flag, name, package):
    out = subprocess.run(
        [msl_cpu.clang_path(), f"{flag}={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert os.path.isfile(out), f"{name} not found next to clang ({out}): apt-get install {package}"
    return out


def _asan_runtime():
    name = f"libclang_rt.asan-{platform.machine()}.so"
    return _clang_file("-print-file-name", name, "libclang-rt-19-dev")


def _run_under_asan(body):
    import lily

    lily_parent = str(Path(lily.__file__).resolve().parent.parent)  # the lily under test
    script = textwrap.dedent("""
        import numpy as np
        from msl_cpu_harness import dispatch, library, msl_cpu, read, u32
        dev = msl_cpu.device(asan=True)
        lib = library(dev, "bugs.metal")
        out = dev.buffer_empty(4 * 64)
    """) + textwrap.dedent(body)
    env = dict(
        os.environ,
        LD_PRELOAD=_asan_runtime(),
        ASAN_OPTIONS="detect_leaks=0",
        # file:line in the report needs the symbolizer (Debian: llvm-19).
        ASAN_SYMBOLIZER_PATH=_clang_file("-print-prog-name", "llvm-symbolizer", "llvm-19"),
        PYTHONPATH=os.pathsep.join([lily_parent, str(ROOT / "tests")]),
    )
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )


def test_out_of_bounds_write_caught_by_asan():
    r = _run_under_asan("""
        dispatch(dev, lib.pipeline("produce"), (2,), (32,), {0: out})  # in bounds: fine
        assert read(out, np.float32)[5] == 10
        print("in-bounds ok", flush=True)
        dispatch(dev, lib.pipeline("oob_write"), (3,), (32,), {0: out, 1: u32(64)})
        print("NOT CAUGHT", flush=True)
    """)
    assert "in-bounds ok" in r.stdout, r.stderr[-3000:]
    assert "NOT CAUGHT" not in r.stdout
    assert r.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in r.stderr
    assert f"{BUGS}:{line_of('out[gid] = 1.0f')}" in r.stderr, r.stderr[
        -3000:
    ]  # the faulting line, symbolized
    assert "[msl_cpu] AddressSanitizer stopped kernel 'oob_write'" in r.stderr
