"""The MSL-on-CUDA runtime (csrc/msl_cuda/, docs/msl-on-cuda.md) on a machine without a GPU:

- every kernel of metal/ and tests/msl/kernels/ compiles to PTX through the CUDA prelude and
  assembles for sm_90 with NVIDIA's ptxas (the nvidia-cuda-nvcc wheel), with the same kernels
  as the MSL-on-CPU runtime registers and no register spills;
- the kernel cache's key is computed without a compiler, so a machine with no clang (the GPU
  machine) finds the PTX that a machine with clang made, and says how to make it when absent;
- without an NVIDIA driver the runtime raises lily's error naming the library, not a crash;
- the launch arithmetic (threadgroup memory layout, threadgroup ids, permutations);
- over a stand-in driver (tests/msl_cuda/fake_libcuda.c): argument marshalling, set_bytes
  staging, launch order, timing, the order-checking permutation, encode-time checks, faults.
What only a GPU can tell (that the kernels compute the right numbers there) is the kernel suite
run with LILY_TEST_MSL_RUNTIME=cuda on the H200 machine (scripts/h200/).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily._core import LilyError, msl_cuda
from lily.msl_cuda import (
    cuda_kernel_files,
    ptxas_report,
    register_limited_threads,
    use_wheel_toolchain,
)
from msl_cpu_harness import KERNELS, ROOT, msl_cpu

TESTS = Path(__file__).resolve().parent
use_wheel_toolchain()

# Metal 4 tensor ops (<metal_tensor>, MetalPerformancePrimitives) are emulated on the CPU only;
# on CUDA the simdgroup_matrix GEMMs run instead (docs/msl-on-cuda.md).
CUDA_KERNEL_TESTS = sorted(p.name for p in KERNELS.glob("*.metal") if p.name != "tensor_ops.metal")


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    old = os.environ.get("LILY_MSL_CUDA_CACHE")
    os.environ["LILY_MSL_CUDA_CACHE"] = str(tmp_path_factory.mktemp("ptx"))
    yield Path(os.environ["LILY_MSL_CUDA_CACHE"])
    if old is None:
        del os.environ["LILY_MSL_CUDA_CACHE"]
    else:
        os.environ["LILY_MSL_CUDA_CACHE"] = old


def cpu_kernel_names(source: str, file_name: str) -> list[str]:
    """The host names the MSL-on-CPU runtime registers for a source (from its error listing)."""
    lib = msl_cpu.device().library(source, file_name)
    with pytest.raises(ValueError, match="it has: ") as e:
        lib.pipeline("no_such_kernel")
    return sorted(re.search(r"\(it has: (.*)\)", str(e.value)).group(1).split(", "))


# Spills ptxas needs to keep a kernel's [[max_total_threads_per_threadgroup]] promise, in bytes
# (stores, loads): a bound, so a kernel that spills more, or a new spill, fails. gdn_scan at
# Dk = 128 keeps 32 state floats a thread and 512 threads may hold 128 registers each; its fix is
# a state layout with fewer floats a thread (docs/msl-on-cuda.md, "Open").
KNOWN_SPILLS = {"gdn_scan_dk128": 96}


def declared_limits(ptx: str) -> dict[str, int]:
    """{entry: N} of the `.maxntid N, 1, 1` that msl_cuda writes after each entry whose kernel
    declares [[max_total_threads_per_threadgroup(N)]]."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"\.entry (\w+)\([^)]*\)[^\n]*\n\.maxntid (\d+), 1, 1", ptx)}


def check_ptxas(path: str, entries) -> None:
    report = ptxas_report(path)
    assert sorted(k["kernel"] for k in report) == sorted(e[0] for e in entries)
    spills = [(k["kernel"], k["spill_stores"], k["spill_loads"]) for k in report
              if max(k["spill_stores"], k["spill_loads"]) > KNOWN_SPILLS.get(k["kernel"], 0)]
    assert not spills, f"register spills (bytes stored, loaded) in sm_90 code: {spills}"
    # Each declared maximum is launchable: ptxas fitted the kernel's registers to it.
    limits = declared_limits(Path(path).read_text())
    short = {k["kernel"]: (limits[k["kernel"]], register_limited_threads(k["registers"]))
             for k in report if k["kernel"] in limits
             and register_limited_threads(k["registers"]) < limits[k["kernel"]]}
    assert not short, f"declared threads per threadgroup that the registers do not allow: {short}"


def test_declared_thread_limits_reach_ptx():
    # gdn_scan declares LILY_GDN_SCAN_MAX_THREADS (512), which clang's PTX cannot say: msl_cuda
    # writes it as .maxntid, else ptxas gives the Dk = 128 scan 168 registers (384 threads).
    path, _, entries = msl_cuda.compile(msl_cuda.kernel_source("gdn_prefill.metal"), "metal/gdn_prefill.metal")
    limits = declared_limits(Path(path).read_text())
    scans = sorted(e[0] for e in entries if e[0].startswith("gdn_scan_"))
    assert scans and {k: limits.get(k) for k in scans} == dict.fromkeys(scans, 512)
    assert not any(k.startswith("gdn_prepare") for k in limits)  # declares none: gets none


def child(case: str, env: dict, drop=(), timeout=300) -> subprocess.CompletedProcess:
    """Runs `case` in a fresh Python (a driver, once loaded, stays for the process) from the
    checkout's root, with the tests' helpers importable and `env` over this process's."""
    paths = [str(TESTS), str(TESTS / "msl_cuda"), *sys.path]
    full = {k: v for k, v in os.environ.items() if k not in ("LILY_TEST_MSL_RUNTIME", *drop)}
    full.update(env, PYTHONPATH=os.pathsep.join(paths))
    return subprocess.run([sys.executable, "-c", case], env=full, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("name,safe_math", cuda_kernel_files())
def test_every_backend_kernel_compiles_and_assembles_for_sm_90(name, safe_math):
    # The text the GPU backend and the kernel tests compile (local includes inlined, so the
    # kernel templates of metal/*.h with it), with the backend's options (every library but the
    # Metal 4 tensor ones, which msl_cuda lacks).
    source = msl_cuda.kernel_source(name)
    path, _, entries = msl_cuda.compile(source, f"metal/{name}", safe_math=safe_math)
    assert sorted(e[0] for e in entries) == cpu_kernel_names(source, f"metal/{name}")
    check_ptxas(path, entries)


@pytest.mark.parametrize("name", CUDA_KERNEL_TESTS)
def test_every_test_kernel_compiles_and_assembles_for_sm_90(name):
    file_name = f"tests/msl/kernels/{name}"
    source = (KERNELS / name).read_text()
    path, _, entries = msl_cuda.compile(source, file_name)
    assert sorted(e[0] for e in entries) == cpu_kernel_names(source, file_name)
    check_ptxas(path, entries)


def test_entry_metadata_names_the_kernel_and_reference_sizes():
    # reduce.metal's reduce_tree(in, partial, constant ReduceArgs& args [8 bytes], shared, ...)
    # and its template reduce_simd instantiated as reduce_simd_float / _half.
    _, _, entries = msl_cuda.compile((KERNELS / "reduce.metal").read_text(), "tests/msl/kernels/reduce.metal")
    by_name = {host: (kernel, sizes) for host, kernel, sizes in entries}
    assert by_name["reduce_tree"][0] == "reduce_tree"
    assert by_name["reduce_simd_half"][0] == by_name["reduce_simd_float"][0] == "reduce_simd"
    assert by_name["reduce_tree"][1][:3] == [0, 0, 8]


def test_safe_math_compiles_without_fma_contraction():
    # Metal's safe math (the sampling library's) forbids contracting a * b + c into one FMA;
    # the default (Metal's fast math) allows it. Each is its own cache entry.
    source = """#include <metal_stdlib>
using namespace metal;
kernel void madd(device const float* a [[buffer(0)]], device float* out [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  out[i] = a[i] * a[i + 1] + a[i + 2];
}
"""
    fast, fast_key, _ = msl_cuda.compile(source, "madd.metal")
    safe, safe_key, _ = msl_cuda.compile(source, "madd.metal", safe_math=True)
    assert fast_key != safe_key == msl_cuda.cache_key(source, "madd.metal", safe_math=True)
    assert "fma.rn.f32" in Path(fast).read_text()
    safe_ptx = Path(safe).read_text()
    assert "fma.rn.f32" not in safe_ptx and "mul.rn.f32" in safe_ptx and "add.rn.f32" in safe_ptx


def test_language_level_and_max_threads_hold_on_cuda():
    # The unit is msl_cpu's: a C++17 construct in an MSL 3 library is an error here too, naming
    # the kernel's file:line (the preludes, system headers, may use what they need), and a
    # [[max_total_threads_per_threadgroup(N)]] written as a macro of the source reaches the PTX
    # metadata, for a kernel template as for a plain kernel.
    head = '#include <metal_stdlib>\n#include "lily_msl.h"\nusing namespace metal;\n'
    cxx17 = head + ("kernel void k(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
                    "  if constexpr (sizeof(float) == 4) out[gid] = 1.0f;\n}\n")
    with pytest.raises(LilyError, match=r"(?s)lang\.metal:5:.*incompatible with C\+\+ standards before C\+\+17"):
        msl_cuda.compile(cxx17, "lang.metal")
    limits = head + ("#define THREADS (2 * 384)\n"
                     "[[max_total_threads_per_threadgroup(THREADS)]]\n"
                     "kernel void plain(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
                     "  out[gid] = 1.0f;\n}\n"
                     "template <typename T>\n[[max_total_threads_per_threadgroup(THREADS / 2)]]\n"
                     "kernel void tmpl(device T* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
                     "  out[gid] = T(1);\n}\n"
                     'LILY_KERNEL_INSTANTIATE("tmpl_float", tmpl, float)\n'
                     "kernel void none(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
                     "  out[gid] = 1.0f;\n}\n")
    path, _, entries = msl_cuda.compile(limits, "limits.metal")
    ptx = Path(path).read_text()
    declared = {}
    for kernel in ("plain", "tmpl", "none"):
        m = re.search(rf"lily_msl_kernel_{kernel}\[16\] = \{{([^}}]*)\}}", ptx)
        values = [int(v) for v in m.group(1).split(",")] + [0] * 16
        declared[kernel] = int.from_bytes(bytes(values[8:16]), "little")
    assert declared == {"plain": 768, "tmpl": 384, "none": 0}
    assert sorted(e[0] for e in entries) == ["none", "plain", "tmpl_float"]


def test_constant_specializations_are_separate_modules():
    source, file_name = (KERNELS / "matmul.metal").read_text(), "tests/msl/kernels/matmul.metal"
    keys = {msl_cuda.cache_key(source, file_name, constants=c) for c in
            ({}, {0: ("bool", True), 1: ("bool", False)}, {0: ("bool", False), 1: ("bool", False)})}
    assert len(keys) == 3
    path, key, _ = msl_cuda.compile(source, file_name, constants={0: ("bool", True), 1: ("bool", True)})
    assert key == msl_cuda.cache_key(source, file_name, constants={0: ("bool", True), 1: ("bool", True)})
    assert Path(path).name == f"{key}.ptx"


def test_kernel_cache_needs_no_clang(tmp_path, kernel_cache):
    """A process that has no clang on PATH computes the same key, loads the cached PTX, and for a
    source nobody compiled says how to compile and carry the kernels."""
    source, file_name = (KERNELS / "scan.metal").read_text(), "tests/msl/kernels/scan.metal"
    path, key, entries = msl_cuda.compile(source, file_name)
    script = f"""
from msl_cpu_harness import KERNELS
from lily._core import LilyError, msl_cuda
source = (KERNELS / "scan.metal").read_text()
assert msl_cuda.cache_key(source, {file_name!r}) == {key!r}
path, key, entries = msl_cuda.compile(source, {file_name!r})
assert path == {path!r} and [e[0] for e in entries] == {[e[0] for e in entries]!r}
try:
    msl_cuda.compile(source + "\\n// edited\\n", {file_name!r})
except LilyError as e:
    assert "no clang here" in str(e) and "python -m lily.msl_cuda compile" in str(e), str(e)
    print("ok")
"""
    r = child(script, {"PATH": str(tmp_path)}, drop=("LILY_CLANG",))  # a PATH without clang
    assert r.stdout.strip() == "ok", r.stderr[-3000:]


def test_launch_arithmetic():
    offsets, total = msl_cuda.threadgroup_layout([16, 0, 48, 32])
    assert offsets == [0, 16, 16, 64] and total == 96
    offsets, total = msl_cuda.threadgroup_layout([20, 16])  # (Metal's lengths are 16-multiples)
    assert offsets == [0, 32] and total == 48
    grid = (5, 3, 2)
    for linear in range(30):
        z, y, x = np.unravel_index(linear, grid[::-1])
        assert msl_cuda.threadgroup_position(linear, grid) == (x, y, z)
    order = msl_cuda.threadgroup_permutation(1000, 3)
    assert sorted(order) == list(range(1000)) and order != list(range(1000))
    assert order == msl_cuda.threadgroup_permutation(1000, 3) != msl_cuda.threadgroup_permutation(1000, 4)
    assert msl_cuda.threadgroup_permutation(1, 3) == [0] and msl_cuda.threadgroup_permutation(0, 3) == []


def test_register_limited_threads():
    # sm_90: 64K registers per SM, allocated per warp in units of 256 (NVIDIA's occupancy rules).
    assert [register_limited_threads(r) for r in (32, 64, 65, 128, 168, 255)] == [1024, 1024, 896, 512, 384, 256]


def test_no_driver_is_a_clear_error():
    # What a machine without an NVIDIA driver sees (named explicitly, so the test means the same
    # on a machine that has one), and a library that is not a CUDA driver.
    for lib, message in (("libcuda-missing.so.1", "cannot load the NVIDIA driver library libcuda-missing.so.1"),
                         ("libm.so.6", "the driver library libm.so.6 has no cuInit")):
        r = child(f"""
import lily
from lily._core import msl_cuda
for make in (msl_cuda.device, lambda: lily.Model.load(backend="msl-cuda")):
    try:
        make()
    except lily.LilyError as e:
        assert {message!r} in str(e), str(e)
    else:
        raise AssertionError("no error")
print("ok")
""", {"LILY_LIBCUDA": lib})
        assert r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc) to build the stand-in driver")
    out = tmp_path_factory.mktemp("fake_cuda") / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(TESTS / "msl_cuda" / "fake_libcuda.c")],
                   check=True)
    return out


@pytest.mark.parametrize("case,knobs", [
    ("marshalling", {}),
    ("permutation", {}),
    ("errors", {}),
    ("static_shared_counts", {"FAKE_LIBCUDA_STATIC_SHARED": "32768", "FAKE_LIBCUDA_MAX_THREADS": "256"}),
    ("fault", {"FAKE_LIBCUDA_FAULT": "1"}),
])
def test_runtime_over_a_stand_in_driver(fake_driver, tmp_path, case, knobs):
    log = tmp_path / "calls.jsonl"
    env = {"LILY_LIBCUDA": str(fake_driver), "FAKE_LIBCUDA_LOG": str(log), **knobs}
    r = child(f"import fake_driver_checks as c; c.{case}(); print('ok')", env)
    assert r.stdout.strip().endswith("ok"), r.stderr[-4000:]


def test_whole_model_over_a_stand_in_driver(fake_driver, tmp_path, store):
    """backend="msl-cuda" loads and drives a whole model: weights uploaded once, the dispatch
    sequence msl-cpu runs, tokens up and logits down around each pass, state copies on the device
    (fake_driver_checks.whole_model)."""
    model = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    env = {"LILY_LIBCUDA": str(fake_driver), "FAKE_LIBCUDA_LOG": str(tmp_path / "calls.jsonl"),
           "FAKE_MODEL": str(model)}
    r = child("import fake_driver_checks as c; c.whole_model(); print('ok')", env, timeout=900)
    assert r.stdout.strip().endswith("ok"), r.stderr[-4000:]


def test_model_backend_refuses_msl_cpu_options():
    import lily

    for option in ("check_dependencies", "asan"):
        with pytest.raises(LilyError, match=f"{option} is an option of the msl-cpu backend, not msl-cuda"):
            lily.Model.load(backend="msl-cuda", backend_options={option: True})
