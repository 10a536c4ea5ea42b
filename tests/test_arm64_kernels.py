"""The CPU backend's arm64 int8 kernels (csrc/cpu/linear_int8_neon.cpp), cross-compiled for
aarch64 and run under qemu-user, against NumPy.

CI runs on x86_64, where the NEON code would otherwise never even be compiled. Here
tests/native/arm64_int8_driver.cpp is built with lily's CPU sources by aarch64-linux-gnu-g++
(Debian package g++-aarch64-linux-gnu) and run by qemu-aarch64 (package qemu-user), twice:
- -march=armv8.2-a+dotprod (SDOT, as on every Apple M1 and later), run on qemu's `-cpu max`;
- -march=armv8-a (the VMULL/VPADAL fallback for ARMv8.0 cores), run on `-cpu cortex-a53`, a core
  without SDOT, so a dot-product instruction that slipped into this build would trap.
The driver calls cpu::linear (the engine's own dispatch: MatvecInput, int8_rows in passes of up
to 8 tokens, the thread pool) in int8 and in f32 mode.

Inputs are written by NumPy: random MLX affine codes (every row also holding the extreme codes
0 and 2^bits - 1), scales and biases rounded to bf16 / f16 / f32, packed as MLX packs them (the
packing is checked against mlx.core.dequantize), and x with one block scaled by 40, one all
zero and one of exact rounding ties. Asserted for each build and matrix:
- int8 mode equals the int8 formula evaluated in float64 by NumPy
  (fixtures.references.int8_matmul_reference: x rounded per block of 32, exact integer dot
  products) to a relative 1e-5 per token: the integer sums are exact, so only the f32 summation
  order may differ; a wrong nibble order, block scale or 8-bit offset is off by >= 1e-3.
- int8 mode lies within the worst-case rounding bound of the exact product x @ dequantize(W).T
  (fixtures.references.int8_error_bound: each x_j moves by at most half its block's step d_j, so
  |error| <= sum_j |w_j| d_j / 2), elementwise, as the x86 tests assert.
- quantize_activations writes exactly NumPy's int8 values and block scales, in the kernels'
  element order (the NEON layout: per 32 values the evens, then the odds, for 4-bit weights).
- The int8 path really ran: the driver reports int8_supported for every matrix, and f32 mode
  (the portable arm64 path, itself checked against the exact product to 1e-5) is farther than
  1e-4 from the int8 formula, so the 1e-5 match cannot come from f32 kernels.
Coverage: 4 and 8 bits; groups 32, 64 and 128; scales in bf16, f16 and f32; rows of an odd
number of 32-value blocks (the kernels step two blocks at a time) and of many blocks; T = 1..8
(one weight pass per token count) and 13, 20 (passes of 8 tokens plus a remainder); 37 rows
(split over two threads in blocks of 16).

Also: every source of lily_core compiles for aarch64 without warnings (gcc), and the CPU
backend also with clang for an Apple M1 CPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fixtures.references import int8_error_bound, int8_matmul_reference, int8_quantize, rel_err

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "native" / "arm64_int8_driver.cpp"
SYSROOT = Path("/usr/aarch64-linux-gnu")
CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
CXXFLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter",
            f"-I{ROOT / 'csrc'}", f"-I{ROOT}", f'-DLILY_SOURCE_DIR="{ROOT}"']
# Built per -march: the code that differs between the builds. The rest of what cpu::linear
# links against (Linear::row_bytes in csrc/model, the thread pool) is built once, as a library.
KERNELS = ["csrc/cpu/linear.cpp", "csrc/cpu/linear_int8.cpp", "csrc/cpu/linear_int8_neon.cpp"]
LIBRARY = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "model").glob("*.cpp")) + [
    "csrc/cpu/thread_pool.cpp"]
# -march -> (qemu CPU model, SDOT expected)
BUILDS = {"armv8.2-a+dotprod": ("max", True), "armv8-a": ("cortex-a53", False)}

# bits, group, in, dtype of scales/biases
MATRICES = [
    (4, 32, 96, "bf16"), (4, 32, 1056, "f16"), (4, 64, 192, "f32"), (4, 64, 2048, "bf16"),
    (4, 128, 384, "f16"), (4, 128, 1024, "f32"),
    (8, 32, 96, "f16"), (8, 32, 224, "f32"), (8, 64, 192, "bf16"), (8, 64, 2048, "f16"),
    (8, 128, 640, "bf16"), (8, 128, 256, "f32"),
]
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 20]
ROWS = 37


def _name(bits, group, n, dtype):
    return f"b{bits}_g{group}_in{n}_{dtype}"


def _require(tool, package):
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} not found: install the Debian package {package} "
                    f"(apt-get install g++-aarch64-linux-gnu qemu-user; scripts/test.sh does)")


def _run(cmd, what, timeout=300):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        pytest.fail(f"{what} failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}"[-6000:])
    return r


def _to_bf16(a):
    """f32 -> the nearest bf16 (ties to even), as f32 values and as the stored 16-bit words."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    words = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return (words.astype(np.uint32) << 16).view(np.float32), words


def _store(a, dtype):
    """(values as f32, raw bytes) of a rounded to dtype."""
    if dtype == "bf16":
        vals, words = _to_bf16(a)
        return vals, words.tobytes()
    if dtype == "f16":
        h = a.astype(np.float16)
        return h.astype(np.float32), h.tobytes()
    f = a.astype(np.float32)
    return f, f.tobytes()


def _pack(u, bits):
    """MLX's packing: value j of a row in uint32 word j * bits / 32, at bit (j * bits) % 32
    (little-endian, so for 4 bits byte j / 2 holds value j in its low nibble if j is even)."""
    u = u.astype(np.uint8)
    if bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    return np.ascontiguousarray(u).view(np.uint32)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Writes every matrix and its x for the driver; returns (input dir, {name: references})."""
    import mlx.core as mx

    d = tmp_path_factory.mktemp("arm64_cases")
    lines, refs = [], {}
    for i, (bits, group, n, dtype) in enumerate(MATRICES):
        rng = np.random.default_rng(100 + i)
        name, G = _name(bits, group, n, dtype), n // group
        u = rng.integers(0, 2**bits, size=(ROWS, n))
        u[0], u[1] = 2**bits - 1, 0  # the extreme codes (8-bit: +127 and -128 after the offset)
        s, s_raw = _store(rng.uniform(0.002, 0.02, (ROWS, G)) * rng.choice([-1, 1], (ROWS, G)), dtype)
        b, b_raw = _store(rng.normal(0, 0.05, (ROWS, G)), dtype)
        packed = _pack(u, bits)
        deq = np.repeat(s.astype(np.float64), group, 1) * u + np.repeat(b.astype(np.float64), group, 1)
        # The packing is MLX's: mlx dequantizes it to the same weights.
        mlx_deq = np.array(mx.dequantize(mx.array(packed), mx.array(s), mx.array(b), group_size=group, bits=bits))
        assert rel_err(mlx_deq, deq) <= 1e-6, f"{name}: packing differs from MLX's"
        x = rng.standard_normal((max(TOKENS), n)).astype(np.float32)
        x[0, :32] *= 40.0  # one block with a large max, one all-zero block
        x[-1, 32:64] = 0.0
        # A block of exact ties: max 127, so x * (127 / max) = x, half-integers of both signs
        # (rounded half to even, as nearbyint: 2.5 -> 2, -1.5 -> -2).
        x[2, 64:96] = np.concatenate([[127.0], np.arange(31) - 15.5])
        (d / f"{name}.w").write_bytes(packed.tobytes())
        (d / f"{name}.s").write_bytes(s_raw)
        (d / f"{name}.b").write_bytes(b_raw)
        (d / f"{name}.x").write_bytes(x.tobytes())
        lines.append(f"{name} {bits} {group} {ROWS} {n} {dtype} {','.join(map(str, TOKENS))}")
        # Row t of y does not depend on T (x for T tokens is the first T rows), so one reference
        # of max(TOKENS) rows serves every T.
        refs[name] = dict(x=x, deq=deq, exact=x.astype(np.float64) @ deq.T,
                          int8=int8_matmul_reference(x, deq, s, b, group))
    (d / "cases.txt").write_text("\n".join(lines) + "\n")
    return d, refs


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    """{-march: path} of the driver built for each entry of BUILDS (compiled once per session)."""
    _require(CXX, "g++-aarch64-linux-gnu")
    if not (SYSROOT / "include").is_dir():
        pytest.fail(f"{SYSROOT}/include missing: install the Debian package g++-aarch64-linux-gnu")
    out = tmp_path_factory.mktemp("arm64_build")
    objs = [out / (Path(src).stem + ".o") for src in LIBRARY]
    # Two compilers at a time (the machines running CI may have only two cores).
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_run, [CXX, *CXXFLAGS, "-march=armv8-a", "-c", str(ROOT / src), "-o", str(obj)],
                            f"compiling {src}") for src, obj in zip(LIBRARY, objs, strict=True)]
        for r in runs:
            r.result()
        _run(["aarch64-linux-gnu-ar", "rcs", str(out / "libcommon.a"), *map(str, objs)], "ar")

        def build(march):
            exe = out / f"driver-{march}"
            r = _run([CXX, *CXXFLAGS, f"-march={march}", str(DRIVER), *(str(ROOT / k) for k in KERNELS),
                      str(out / "libcommon.a"), "-lpthread", "-o", str(exe)], f"building the driver for {march}")
            assert "warning:" not in r.stderr, r.stderr
            return march, exe

        return dict(pool.map(build, BUILDS))


@pytest.fixture(scope="module", params=list(BUILDS))
def run(request, binaries, cases, tmp_path_factory):
    """One qemu run of the driver built for -march=param over every matrix: (stdout, outputs)."""
    _require(QEMU, "qemu-user")
    march = request.param
    cpu, _ = BUILDS[march]
    in_dir, refs = cases
    out_dir = tmp_path_factory.mktemp("arm64_out")
    r = _run([QEMU, "-L", str(SYSROOT), "-cpu", cpu, str(binaries[march]), str(in_dir), str(out_dir)],
             f"running the {march} driver under qemu ({cpu})", timeout=300)
    outputs = {}
    for name in refs:
        for mode in ("int8", "f32"):
            y = np.fromfile(out_dir / f"{name}.{mode}", dtype=np.float32)
            assert y.size == sum(TOKENS) * ROWS, f"{name}.{mode}: {y.size} values"
            split = np.split(y, np.cumsum([t * ROWS for t in TOKENS])[:-1])
            outputs[name, mode] = {t: part.reshape(t, ROWS) for t, part in zip(TOKENS, split, strict=True)}
        x = refs[name]["x"]
        outputs[name, "xq"] = np.fromfile(out_dir / f"{name}.xq", dtype=np.int8).reshape(x.shape)
        outputs[name, "dx"] = np.fromfile(out_dir / f"{name}.dx", dtype=np.float32).reshape(x.shape[0], -1)
    return march, r.stdout, outputs


def test_driver_is_the_arm64_int8_build(run, cases):
    march, stdout, _ = run
    _, sdot = BUILDS[march]
    header = stdout.splitlines()[0]
    assert header == f"arch=aarch64 dotprod={int(sdot)} neon_int8=1", header
    supported = dict(re.findall(r"^(\S+) int8_supported=(\d)$", stdout, re.M))
    assert supported == {name: "1" for name in cases[1]}, stdout


@pytest.mark.parametrize("matrix", MATRICES, ids=[_name(*m) for m in MATRICES])
def test_neon_quantize_activations_exact(run, cases, matrix):
    """quantize_activations (the NEON fast path) writes exactly NumPy's q and d, in the NEON
    layout: for 4-bit weights each 32 values (one 16-byte register of nibbles) stored as
    [x0 x2 .. x30 | x1 x3 .. x31] and d once per 32-bit lane (4 per block); for 8-bit q in order
    and d once per block."""
    march, _, outputs = run
    bits, name = matrix[0], _name(*matrix)
    q, d = int8_quantize(cases[1][name]["x"])
    if bits == 4:
        q = np.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
        d = np.repeat(d, 4, axis=1)
    assert np.array_equal(outputs[name, "xq"], q.reshape(q.shape[0], -1)), f"{march} {name}: xq"
    assert np.array_equal(outputs[name, "dx"], d), f"{march} {name}: dx"


@pytest.mark.parametrize("matrix", MATRICES, ids=[_name(*m) for m in MATRICES])
def test_neon_int8_matches_numpy(run, cases, matrix):
    march, _, outputs = run
    name = _name(*matrix)
    ref = cases[1][name]
    for T in TOKENS:
        got, f32 = outputs[name, "int8"][T], outputs[name, "f32"][T]
        want, exact = ref["int8"][:T], ref["exact"][:T]
        where = f"{march} {name} T={T}"
        assert rel_err(f32, exact) <= 1e-5, f"{where}: f32 mode vs exact {rel_err(f32, exact):.2e}"
        for t in range(T):  # per token: token 0's large block would dominate a joint max
            err = rel_err(got[t], want[t])
            assert err <= 1e-5, f"{where} token {t}: int8 vs the NumPy int8 formula, rel err {err:.2e}"
        assert np.all(np.abs(got - exact) <= int8_error_bound(ref["x"][:T], ref["deq"])), \
            f"{where}: int8 error above the rounding bound"
        assert rel_err(f32, want) > 1e-4, f"{where}: f32 and int8 indistinguishable (the check has no power)"


# The compilers a Mac or an arm64 Linux host would use, and what each checks: gcc every source
# of lily_core (x86-only code anywhere without a fallback); clang, as Apple's compiler targets an
# M1, the CPU backend, where all the architecture-specific code is (the Debian clang-19 of the
# MSL-on-CPU tests; without Apple's SDK the target is Linux on the apple-m1 CPU, which has the
# same NEON and SDOT features).
LILY_CORE = ("model", "engine", "cpu", "gpu", "msl_cpu")
COMPILERS = {"gcc": ([CXX, "-march=armv8.2-a+dotprod"], "g++-aarch64-linux-gnu", LILY_CORE),
             "clang": (["clang++-19", "--target=aarch64-linux-gnu", "-mcpu=apple-m1"], "clang-19", ("cpu",))}


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_lily_core_compiles_for_aarch64_without_warnings(compiler):
    """The sources CMake puts into lily_core (not the Python bindings) build for arm64 with no
    warning: x86-only code without a portable fallback, or NEON code one compiler rejects,
    fails here. (The driver builds above also compile the kernels for plain armv8-a.)"""
    cmd, package, areas = COMPILERS[compiler]
    _require(cmd[0], package)
    _require(CXX, "g++-aarch64-linux-gnu")  # clang uses its aarch64 headers and libraries
    sources = sorted(p for area in areas for p in (ROOT / "csrc" / area).glob("*.cpp"))
    assert any(p.name == "linear_int8_neon.cpp" for p in sources)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda src: subprocess.run(
            [*cmd, *CXXFLAGS, "-fsyntax-only", str(src)], capture_output=True, text=True, timeout=300),
            sources))
    bad = [f"{src.relative_to(ROOT)}:\n{r.stderr}" for src, r in zip(sources, results, strict=True)
           if r.returncode != 0 or "warning:" in r.stderr]
    assert not bad, "\n".join(bad)[-6000:]
