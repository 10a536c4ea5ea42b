"""The CPU backend's quantized-matmul kernels of every instruction set, built for that
instruction set and checked bit for bit against NumPy: arm64 (NEON, run under qemu-user) and x86
(AVX2, AVX-VNNI, AVX-512 VNNI, run natively).

CI runs on x86_64, where the NEON code would otherwise never even be compiled, and where the
extension itself is built for the host's best instruction set only. Here
tests/native/linear_driver.cpp is built with lily's CPU sources once per entry of BUILDS:
- arm64 by aarch64-linux-gnu-g++ (Debian package g++-aarch64-linux-gnu), run by qemu-aarch64
  (package qemu-user): -march=armv8.2-a+dotprod (SDOT, as on every Apple M1 and later) on qemu's
  `-cpu max`, and -march=armv8-a (the VMULL/VPADAL fallback for ARMv8.0 cores) on
  `-cpu cortex-a53`, a core without SDOT, so a dot-product instruction that slipped into this
  build would trap;
- x86 by g++ for x86-64-v3 (AVX2 + FMA: VPMADDUBSW in place of VPDPBUSD; 8-bit codes fall back
  to the f32 kernels), x86-64-v3 + AVX-VNNI (256-bit VPDPBUSD) and x86-64-v4 + AVX-512 VNNI
  (the 512-bit row kernels; each build has its token-vector GEMM, 8 or 16 tokens per vector), each run natively when the host CPU has
  those instructions (it does on the machines CI runs on; a host without them builds and runs
  only the builds it can execute).
The driver calls cpu::linear (the engine's own dispatch: MatvecInput, the row kernels in passes
of two tokens, the GEMMs from 12 (int8) / 16 (f32, AVX-512) tokens, the thread pool) in int8
and in f32 mode.

Inputs are written by NumPy: random MLX affine codes (every row also holding the extreme codes
0 and 2^bits - 1), scales and biases rounded to bf16 / f16 / f32, packed as MLX packs them (the
packing is checked against mlx.core.dequantize), and x with one block scaled by 40, one all
zero and one of exact rounding ties. Asserted for each build and matrix:
- int8 mode equals fixtures.references.int8_canonical BIT FOR BIT, for every token count: the
  one order of f32 operations every int8 kernel must follow (csrc/cpu/linear_int8.h), evaluated
  by NumPy with exactly rounded FMAs. So all builds agree with each other bit for bit, and a
  token's output does not depend on how many tokens share the call (the row kernels at 1..8
  tokens; the GEMM from 12 (AVX-512: 13, 15, 20 tokens, partial vectors of 16) or from 8
  (256-bit: 8 in one vector, 15 with a partial second one, 13 and 20 with their last 5 and 4
  tokens on the row kernels)).
- int8 mode lies within the worst-case rounding bound of the exact product x @ dequantize(W).T
  (fixtures.references.int8_error_bound: each x_j moves by at most half its block's step d_j, so
  |error| <= sum_j |w_j| d_j / 2), elementwise.
- f32 mode: within 1e-5 of the exact product, and each token's outputs are bit-identical
  whatever the token count of the call (fused row kernels, the AVX-512 panel GEMM, the
  portable path: one order per build).
- quantize_activations writes exactly NumPy's int8 values and block scales, in the kernels'
  element order (for 4-bit weights, per chunk of 32 (NEON), 64 (AVX2) or 128 (AVX-512) values
  the evens, then the odds; one scale per block of 32).
- The int8 path really ran where the build has it (the driver reports int8_supported per
  matrix, and f32 mode is farther than 1e-4 from the int8 formula); where it has not (8-bit on
  plain AVX2, 4-bit rows of a length no 64-value chunk divides on x86), int8 mode equals f32 mode
  bit for bit.
Coverage: 4 and 8 bits; groups 32, 64 and 128; scales in bf16, f16 and f32; rows of an odd
number of 32-value blocks and of many blocks (half-width last steps); T = 1..8, 13, 15, 20; 37 rows
(blocks of 16 rows with a partial last one, split over two threads).

Also: every source of lily_core compiles for aarch64 without warnings (gcc), and the CPU
backend also with clang for an Apple M1 CPU.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fixtures.host import x86_flags
from fixtures.references import int8_canonical, int8_error_bound, int8_quantize, rel_err

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "native" / "linear_driver.cpp"
SYSROOT = Path("/usr/aarch64-linux-gnu")
ARM_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
CXXFLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter",
            f"-I{ROOT / 'csrc'}", f"-I{ROOT}", f'-DLILY_SOURCE_DIR="{ROOT}"']
# Built per build: the code that differs between them. The rest of what cpu::linear links
# against (Linear::row_bytes in csrc/model, the thread pool) is built once per architecture.
KERNELS = ["csrc/cpu/linear.cpp", "csrc/cpu/linear_int8.cpp", "csrc/cpu/linear_int8_neon.cpp"]
LIBRARY = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "model").glob("*.cpp")) + [
    "csrc/cpu/thread_pool.cpp"]


_AVX512_VNNI_MFLAGS = ["-march=x86-64-v4", "-mavx512vnni"]
_AVX512_VNNI_CPU = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
# name -> (architecture, -m flags, how to run, host CPU flags needed (x86), expected driver header
# fields, 4-bit chunk of the xq layout)
ALL_BUILDS = {
    "arm64-dotprod": ("arm64", ["-march=armv8.2-a+dotprod"], ["-cpu", "max"], set(),
                      dict(dotprod=1, neon_int8=1, int8=1), 32),
    "arm64-v8.0": ("arm64", ["-march=armv8-a"], ["-cpu", "cortex-a53"], set(),
                   dict(dotprod=0, neon_int8=1, int8=1), 32),
    "x86-avx2": ("x86", ["-march=x86-64-v3"], None, {"avx2", "fma", "f16c"},
                 dict(avx2=1, avx512vnni=0, avxvnni=0, int8=1), 64),
    "x86-avxvnni": ("x86", ["-march=x86-64-v3", "-mavxvnni"], None, {"avx2", "fma", "f16c", "avx_vnni"},
                    dict(avx2=1, avx512vnni=0, avxvnni=1, int8=1), 64),
    "x86-avx512vnni": ("x86", _AVX512_VNNI_MFLAGS, None, _AVX512_VNNI_CPU, dict(avx2=1, avx512vnni=1, int8=1), 128),
    # The interleaved kernel's software prefetch is chosen per CPU at run time (none on AMD family
    # 19h, else L1; L2 at build time only): these fix each, so every instantiation runs on any host.
    **{f"x86-avx512vnni-prefetch-{level}": ("x86", [*_AVX512_VNNI_MFLAGS, f"-DLILY_INTERLEAVED_PREFETCH_LOCALITY={loc}"],
                                            None, _AVX512_VNNI_CPU, dict(avx2=1, avx512vnni=1, int8=1), 128)
       for level, loc in (("l1", 3), ("l2", 2), ("none", 0))},
}
_HOST = x86_flags()
BUILDS = {k: v for k, v in ALL_BUILDS.items() if v[0] == "arm64" or v[3] <= _HOST}

# bits, group, in, dtype of scales/biases
MATRICES = [
    (4, 32, 96, "bf16"), (4, 32, 1056, "f16"), (4, 64, 192, "f32"), (4, 64, 2048, "bf16"),
    (4, 128, 384, "f16"), (4, 128, 1024, "f32"), (4, 32, 640, "bf16"),
    (8, 32, 96, "f16"), (8, 32, 224, "f32"), (8, 64, 192, "bf16"), (8, 64, 2048, "f16"),
    (8, 128, 640, "bf16"), (8, 128, 256, "f32"),
]
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 15, 20]
ROWS = 37
INTERLEAVED_ROWS = 32  # the driver's interleaved copy: the first two blocks of 16 rows


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


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Writes every matrix and its x for the driver; returns (input dir, {name: references})."""
    import mlx.core as mx

    d = tmp_path_factory.mktemp("kernel_cases")
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
                          canonical=int8_canonical(x, u, s, b, group))
    (d / "cases.txt").write_text("\n".join(lines) + "\n")
    return d, refs


def _library(arch, cxx, out):
    objs = [out / f"{arch}-{Path(src).stem}.o" for src in LIBRARY]
    flags = ["-march=armv8-a"] if arch == "arm64" else ["-march=x86-64-v3"]
    with ThreadPoolExecutor(2) as pool:  # the machines running CI may have only two cores
        for r in [pool.submit(_run, [cxx, *CXXFLAGS, *flags, "-c", str(ROOT / src), "-o", str(obj)],
                              f"compiling {src} for {arch}") for src, obj in zip(LIBRARY, objs, strict=True)]:
            r.result()
    ar = "aarch64-linux-gnu-ar" if arch == "arm64" else "ar"
    lib = out / f"libcommon-{arch}.a"
    _run([ar, "rcs", str(lib), *map(str, objs)], f"ar ({arch})")
    return lib


DRIVER_CXX = {"arm64": ARM_CXX, "x86": "g++"}
# As CMakeLists.txt builds lily (at -O2 gcc 12 flags its own AVX-512 headers falsely).
X86_OPT = ["-O3", "-Wno-maybe-uninitialized"]


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """(folder, {architecture: the library every build links}), compiled once per session."""
    out = tmp_path_factory.mktemp("kernel_builds")
    if "arm64" in {v[0] for v in BUILDS.values()}:
        _require(ARM_CXX, "g++-aarch64-linux-gnu")
        if not (SYSROOT / "include").is_dir():
            pytest.fail(f"{SYSROOT}/include missing: install the Debian package g++-aarch64-linux-gnu")
    return out, {arch: _library(arch, DRIVER_CXX[arch], out) for arch in sorted({v[0] for v in BUILDS.values()})}


@pytest.fixture(scope="module")
def binaries(libraries):
    """{build: path} of the driver built for each entry of BUILDS (compiled once per session)."""
    out, libs = libraries

    def build(name):
        arch, flags = BUILDS[name][0], BUILDS[name][1]
        if arch == "x86":
            flags = [*flags, *X86_OPT]
        exe = out / f"driver-{name}"
        r = _run([DRIVER_CXX[arch], *CXXFLAGS, *flags, str(DRIVER), *(str(ROOT / k) for k in KERNELS),
                  str(libs[arch]), "-lpthread", "-o", str(exe)], f"building the driver for {name}")
        assert "warning:" not in r.stderr, r.stderr
        return name, exe

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, BUILDS))


@pytest.fixture(scope="module", params=list(BUILDS))
def run(request, binaries, cases, tmp_path_factory):
    """One run of the driver of build `param` over every matrix: (build, stdout, outputs)."""
    name = request.param
    arch, _, qemu_cpu, _, _, _ = BUILDS[name]
    in_dir, refs = cases
    out_dir = tmp_path_factory.mktemp(f"out_{name}")
    cmd = [str(binaries[name]), str(in_dir), str(out_dir)]
    if arch == "arm64":
        _require(QEMU, "qemu-user")
        cmd = [QEMU, "-L", str(SYSROOT), *qemu_cpu, *cmd]
    r = _run(cmd, f"running the {name} driver", timeout=300)
    outputs = {}
    for m in refs:
        for mode in ("int8", "f32"):
            y = np.fromfile(out_dir / f"{m}.{mode}", dtype=np.float32)
            assert y.size == sum(TOKENS) * ROWS, f"{m}.{mode}: {y.size} values"
            split = np.split(y, np.cumsum([t * ROWS for t in TOKENS])[:-1])
            outputs[m, mode] = {t: part.reshape(t, ROWS) for t, part in zip(TOKENS, split, strict=True)}
        x = refs[m]["x"]
        outputs[m, "xq"] = np.fromfile(out_dir / f"{m}.xq", dtype=np.int8).reshape(x.shape)
        outputs[m, "dx"] = np.fromfile(out_dir / f"{m}.dx", dtype=np.float32).reshape(x.shape[0], -1)
        if (out_dir / f"{m}.int8i").exists():
            y = np.fromfile(out_dir / f"{m}.int8i", dtype=np.float32)
            assert y.size == sum(TOKENS) * INTERLEAVED_ROWS, f"{m}.int8i: {y.size} values"
            split = np.split(y, np.cumsum([t * INTERLEAVED_ROWS for t in TOKENS])[:-1])
            outputs[m, "int8i"] = {t: p.reshape(t, INTERLEAVED_ROWS) for t, p in zip(TOKENS, split, strict=True)}
    supported = dict(re.findall(r"^(\S+) int8_supported=(\d)$", r.stdout, re.M))
    return name, r.stdout, outputs, {m: v == "1" for m, v in supported.items()}


def _int8_expected(build, bits, group, n):
    """Whether the build has int8 kernels for such a matrix (csrc/cpu/linear_int8*.cpp)."""
    if build.startswith("arm64"):
        return True
    if bits == 8:
        return "vnni" in build
    return n % 64 == 0


def test_driver_is_the_build_asked_for(run, cases):
    name, stdout, _, supported = run
    header = stdout.splitlines()[0]
    fields = dict(re.findall(r"(\w+)=(\w+)", header))
    assert fields["arch"] == ("aarch64" if name.startswith("arm64") else "x86_64"), header
    for key, want in BUILDS[name][4].items():
        assert fields[key] == str(want), f"{name}: {header}"
    assert supported == {_name(*m): _int8_expected(name, *m[:3]) for m in MATRICES}, stdout


def test_every_x86_build_the_host_runs_is_tested():
    """The host-dependent selection above leaves out only builds the CPU cannot execute."""
    if platform.machine() in ("x86_64", "AMD64"):
        assert "x86-avx2" in BUILDS, f"host CPU flags lack AVX2/FMA: {sorted(_HOST)[:40]}"
        for name, spec in ALL_BUILDS.items():
            if spec[0] == "x86":
                assert (name in BUILDS) == (spec[3] <= _HOST)


@pytest.mark.parametrize("matrix", MATRICES, ids=[_name(*m) for m in MATRICES])
def test_quantize_activations_exact(run, cases, matrix):
    """quantize_activations writes exactly NumPy's q and d, in the build's layout: for 4-bit
    weights each chunk of `chunk` values (one vector register of packed nibbles) stored as its
    evens, then its odds; for 8-bit q in order; one d per block of 32."""
    name, _, outputs, _ = run
    bits, n, m = matrix[0], matrix[2], _name(*matrix)
    q, d = int8_quantize(cases[1][m]["x"])
    q = q.reshape(q.shape[0], -1)
    if bits == 4:
        chunk = BUILDS[name][5]
        parts = []
        for c0 in range(0, n, chunk):
            c = q[:, c0:c0 + chunk]
            parts += [c[:, 0::2], c[:, 1::2]]
        q = np.concatenate(parts, axis=1)
    assert np.array_equal(outputs[m, "xq"], q), f"{name} {m}: xq"
    assert np.array_equal(outputs[m, "dx"], d), f"{name} {m}: dx"


@pytest.mark.parametrize("matrix", MATRICES, ids=[_name(*m) for m in MATRICES])
def test_int8_is_the_canonical_order_bit_for_bit(run, cases, matrix):
    name, _, outputs, supported = run
    m = _name(*matrix)
    ref = cases[1][m]
    for T in TOKENS:
        got, f32 = outputs[m, "int8"][T], outputs[m, "f32"][T]
        where = f"{name} {m} T={T}"
        if not supported[m]:  # the f32 kernels serve int8 mode
            assert np.array_equal(_bits(got), _bits(f32)), f"{where}: int8 mode without int8 kernels differs from f32"
            continue
        want = ref["canonical"][:T]
        diff = np.argwhere(_bits(got) != _bits(want))
        assert diff.size == 0, (f"{where}: {len(diff)} outputs differ from the canonical order, first at "
                                f"{tuple(diff[0])}: {got[tuple(diff[0])]!r} vs {want[tuple(diff[0])]!r}")
        assert np.all(np.abs(got - ref["exact"][:T]) <= int8_error_bound(ref["x"][:T], ref["deq"])), \
            f"{where}: int8 error above the rounding bound"
        assert rel_err(f32, want) > 1e-4, f"{where}: f32 and int8 indistinguishable (the check has no power)"


def _interleavable(build, bits, n):
    """Whether the build rearranges such a matrix (linear_int8.h: int8_interleavable)."""
    return "avx512" in build and bits == 4 and n % 128 == 0


@pytest.mark.parametrize("matrix", MATRICES, ids=[_name(*m) for m in MATRICES])
def test_interleaved_rows_are_the_canonical_order_bit_for_bit(run, cases, matrix):
    """The interleaved layout (AVX-512 VNNI builds, 4-bit rows of whole 128-value chunks): the
    row kernels (1-8 tokens) and the GEMM reading rows gathered from it (13-20) give the
    canonical order's result bit for bit, and the f32 mode refuses the layout."""
    name, stdout, outputs, _ = run
    bits, _, n, _ = matrix
    m = _name(*matrix)
    assert ((m, "int8i") in outputs) == _interleavable(name, bits, n), f"{name} {m}: interleaved or not as expected"
    if (m, "int8i") not in outputs:
        return
    assert f"{m} interleaved=1 f32_refused=1" in stdout
    for T in TOKENS:
        got, want = outputs[m, "int8i"][T], cases[1][m]["canonical"][:T, :INTERLEAVED_ROWS]
        diff = np.argwhere(_bits(got) != _bits(want))
        assert diff.size == 0, f"{name} {m} T={T}: {len(diff)} outputs differ from the canonical order"


@pytest.mark.parametrize("matrix", MATRICES, ids=[_name(*m) for m in MATRICES])
def test_f32_rows_do_not_depend_on_the_token_count(run, cases, matrix):
    name, _, outputs, _ = run
    m = _name(*matrix)
    full = outputs[m, "f32"][max(TOKENS)]
    assert rel_err(full, cases[1][m]["exact"]) <= 1e-5, f"{name} {m}: f32 mode vs exact"
    for T in TOKENS:
        got = outputs[m, "f32"][T]
        assert np.array_equal(_bits(got), _bits(full[:T])), f"{name} {m}: f32 rows at T={T} differ from T={max(TOKENS)}"


# The compilers a Mac or an arm64 Linux host would use, and what each checks: gcc every source
# of lily_core (x86-only code anywhere without a fallback); clang, as Apple's compiler targets an
# M1, the CPU backend, where all the architecture-specific code is (the Debian clang-19 of the
# MSL-on-CPU tests; without Apple's SDK the target is Linux on the apple-m1 CPU, which has the
# same NEON and SDOT features).
LILY_CORE = ("model", "engine", "cpu", "gpu", "msl_cpu")
COMPILERS = {"gcc": ([ARM_CXX, "-march=armv8.2-a+dotprod"], "g++-aarch64-linux-gnu", LILY_CORE),
             "clang": (["clang++-19", "--target=aarch64-linux-gnu", "-mcpu=apple-m1"], "clang-19", ("cpu",))}


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_lily_core_compiles_for_aarch64_without_warnings(compiler):
    """The sources CMake puts into lily_core (not the Python bindings) build for arm64 with no
    warning: x86-only code without a portable fallback, or NEON code one compiler rejects,
    fails here. (The driver builds above also compile the kernels for plain armv8-a.)"""
    cmd, package, areas = COMPILERS[compiler]
    _require(cmd[0], package)
    _require(ARM_CXX, "g++-aarch64-linux-gnu")  # clang uses its aarch64 headers and libraries
    sources = sorted(p for area in areas for p in (ROOT / "csrc" / area).glob("*.cpp"))
    assert any(p.name == "linear_int8_neon.cpp" for p in sources)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda src: subprocess.run(
            [*cmd, *CXXFLAGS, "-fsyntax-only", str(src)], capture_output=True, text=True, timeout=300),
            sources))
    bad = [f"{src.relative_to(ROOT)}:\n{r.stderr}" for src, r in zip(sources, results, strict=True)
           if r.returncode != 0 or "warning:" in r.stderr]
    assert not bad, "\n".join(bad)[-6000:]


@pytest.mark.skipif("x86-avx512vnni" not in BUILDS,
                    reason="the host CPU lacks AVX-512 VNNI, the instruction set stream_ceiling measures")
def test_stream_ceiling_builds_and_runs_the_kernel(libraries):
    """benchmarks/kernels/stream_ceiling.cpp (docs/performance.md, "Fewer instructions a line,
    measured in one process") builds against the kernels without warnings, runs lily's lm_head
    kernel and a decode step's MoE calls among the synthetic streams with each kind's figure as a
    share of the plain reads', and refuses an unknown kind by name."""
    out, libs = libraries
    exe = out / "stream_ceiling"
    r = _run(["g++", *CXXFLAGS, *_AVX512_VNNI_MFLAGS, *X86_OPT, str(ROOT / "benchmarks/kernels/stream_ceiling.cpp"),
              *(str(ROOT / k) for k in KERNELS), str(libs["x86"]), "-lpthread", "-o", str(exe)],
             "building stream_ceiling")
    assert "warning:" not in r.stderr, r.stderr
    r = _run([str(exe), "1", "2", "plain,loads,kernel,moe"], "running stream_ceiling", timeout=300)
    rows = {k: (float(gbps), share) for k, gbps, share in
            re.findall(r"^(plain|loads|kernel|moe)\s+([0-9.]+)\s+\(.*\)\s+([0-9.]+)%$", r.stdout, re.M)}
    assert set(rows) == {"plain", "loads", "kernel", "moe"}, r.stdout
    assert rows["plain"][1] == "100.0", r.stdout
    assert all(gbps > 0 and float(share) > 0 for gbps, share in rows.values()), r.stdout
    outputs = re.search(r"\(y\[0\] = (\S+), ye\[0\] = (\S+)\)", r.stdout)
    assert outputs, r.stdout
    for v in outputs.groups():  # the lm_head's kernel and the experts' ran and wrote their outputs
        assert np.isfinite(float(v)) and float(v) != 0, r.stdout
    bad = subprocess.run([str(exe), "1", "2", "plain,bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown kind 'bogus'" in bad.stderr, (bad.returncode, bad.stderr)


@pytest.mark.skipif("x86-avx2" not in BUILDS, reason="the host CPU lacks AVX2")
def test_pool_bench_and_region_bench_build_and_run(libraries, tmp_path):
    """benchmarks/kernels/pool_bench.cpp (cpu::linear through the pool) and region_bench.cpp (the
    pool alone) build without warnings and run: pool_bench reads at a positive rate and its
    product is finite; region_bench runs every unit of every call exactly once (the count it
    prints). pool_bench once stopped compiling unnoticed (a name lily's headers came to share)."""
    out, libs = libraries
    pool_bench = tmp_path / "pool_bench"
    r = _run(["g++", *CXXFLAGS, "-march=x86-64-v3", *X86_OPT, str(ROOT / "benchmarks/kernels/pool_bench.cpp"),
              *(str(ROOT / k) for k in KERNELS), str(libs["x86"]), "-lpthread", "-o", str(pool_bench)],
             "building pool_bench")
    assert "warning:" not in r.stderr, r.stderr
    r = _run([str(pool_bench), "2048", "512", "2", "8", "0", "3"], "running pool_bench", timeout=120)
    m = re.search(r"GB/s ([0-9.]+) ([0-9.]+) ([0-9.]+)\s+\(y\[0\] = (\S+)\)", r.stdout)
    assert m, r.stdout
    assert all(float(v) > 0 for v in m.groups()[:3]) and np.isfinite(float(m.group(4))), r.stdout

    region_bench = tmp_path / "region_bench"
    r = _run(["g++", *CXXFLAGS, "-O3", "-pthread", str(ROOT / "benchmarks/kernels/region_bench.cpp"),
              str(ROOT / "csrc/cpu/thread_pool.cpp"), "-o", str(region_bench)], "building region_bench")
    assert "warning:" not in r.stderr, r.stderr
    r = _run([str(region_bench), "2", "16,1000", "2"], "running region_bench", timeout=120)
    rows = re.findall(r"^2 threads, (\d+) units: ([0-9.]+) us a call .*\(units run (\d+)\)$", r.stdout, re.M)
    assert [int(u) for u, _, _ in rows] == [16, 1000], r.stdout
    for units, us, ran in rows:
        assert float(us) > 0 and int(ran) == int(units) * 20000 * 2, r.stdout
