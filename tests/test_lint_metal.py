"""scripts/lint_metal.py: every kernel file passes, and each rule fires on what Apple's
compiler rejects but clang's C++ accepts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = ROOT / "scripts" / "lint_metal.py"


def lint(*paths):
    return subprocess.run(
        [sys.executable, str(LINT), *map(str, paths)], capture_output=True, text=True, timeout=60
    )


def test_project_kernels_pass():
    r = lint()  # metal/ and tests/msl/kernels/
    assert r.returncode == 0, r.stdout
    assert "problems" in r.stderr and " 0 problems" in r.stderr
    n_files = int(r.stderr.split("lint_metal: ")[1].split(" files")[0])
    assert n_files >= 6  # the test kernels and metal/lily_msl.h were all read


BAD = """\
#include <metal_stdlib>
#include <cmath>
using namespace metal;
// double and std:: in a comment are fine; so is "new" in a string
float twice(float x) { return 2.0 * x; }
int fact(int n) { return n <= 1 ? 1 : n * fact(n - 1); }
int ping(int n);
int pong(int n) { return n ? ping(n - 1) : 0; }
int ping(int n) { return n ? pong(n - 1) : 1; }
kernel void k(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  threadgroup float tile[32];
  double d = std::sqrt(2.0f);
  float* p = new float[4];
  try { out[gid] = twice(float(d)) + fact(3) + ping(2) + tile[0] + p[0]; } catch (...) {}
}
template [[host_name("k2")]] [[kernel]] decltype(k2<float>) k2<float>;
"""


def test_each_rule_fires(tmp_path):
    bad = tmp_path / "bad.metal"
    bad.write_text(BAD)
    r = lint(bad)
    assert r.returncode == 1
    found = {
        (int(line.split(":")[1]), line.split(": ", 1)[1].split(" ")[0])
        for line in r.stdout.splitlines()
    }
    expected = {
        (2, "#include"),
        (5, "unsuffixed"),
        (6, "recursion"),
        (8, "recursion"),
        (9, "recursion"),
        (11, "kernel-scope"),
        (12, "`double`"),
        (12, "no"),  # std::
        (13, "dynamic"),
        (13, "pointer"),  # float* without an address space
        (14, "exceptions"),
        (16, "explicit"),
    }
    assert found == expected, r.stdout


def test_clean_kernel_passes(tmp_path):
    good = tmp_path / "good.metal"
    good.write_text(
        '#include <metal_stdlib>\n#include "lily_msl.h"\nusing namespace metal;\n'
        "kernel void k(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {\n"
        "  LILY_THREADGROUP(float, tile, [32]);\n  tile[gid % 32] = 0.5f * float(gid) + 1e-3f;\n"
        "  out[gid] = tile[gid % 32] + 2.h;\n}\n"
    )
    r = lint(good)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize(
    "expr,flagged",
    [
        ("0.5", True),
        ("1.", True),
        (".25", True),
        ("1e-3", True),
        ("2.5e3", True),
        ("0.5f", False),
        ("1.f", False),
        ("1e-3f", False),
        ("0.5h", False),
        ("2.h", False),
        ("0x1e5", False),
        ("7", False),
        ("v1e5", False),
        ("a.x", False),
    ],
)
def test_unsuffixed_float_literals(tmp_path, expr, flagged):
    f = tmp_path / "lit.metal"
    f.write_text(f"constant float k = {expr};\n")
    r = lint(f)
    assert (r.returncode == 1 and "unsuffixed floating literal" in r.stdout) == flagged, r.stdout


def test_tensor_headers_only_in_tensor_files(tmp_path):
    """Metal 4 headers are allowed in a product kernel (metal/) only in its own *_tensor file (a
    library compiled as MSL 4.0 where the GPU has tensors), even under __HAVE_TENSOR__; test
    kernels may include them as is."""
    (tmp_path / "metal").mkdir()
    src = ("#include <metal_stdlib>\n#include <metal_tensor>\n"
           "#if defined(__HAVE_TENSOR__)\n#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"
           "#endif\n")
    product, tensor_file, test_kernel = (tmp_path / "metal" / "k.metal", tmp_path / "metal" / "k_tensor.metal",
                                         tmp_path / "k.metal")
    for f in (product, tensor_file, test_kernel):
        f.write_text(src)
    r = lint(product)
    flagged = sorted(int(line.split(":")[1]) for line in r.stdout.splitlines())
    assert flagged == [2, 4] and "outside a *_tensor.metal / *_tensor.h file" in r.stdout, r.stdout
    assert lint(tensor_file).returncode == 0
    assert lint(test_kernel).returncode == 0


# Section 1 of issue 16: each rule on a small bad kernel, with the line it must name.
RULES = [
    ("threadgroup memory in a helper",
     "inline float helper(threadgroup float* ok) {\n  LILY_THREADGROUP(float, tmp, [32]);\n  return ok[0];\n}\n",
     2, "threadgroup memory 'tmp' declared in function 'helper', which is not a kernel"),
    ("threadgroup variable in a helper",
     "inline void helper() {\n  threadgroup float tmp[4];\n}\n",
     2, "threadgroup memory 'tmp' declared in function 'helper'"),
    ("pointer without an address space",
     "inline float first(\n    const float* p) { return p[0]; }\n",
     2, "pointer or reference `const float*` without an address space"),
    ("reference without an address space",
     "struct Args { uint n; };\ninline uint count(Args& a) { return a.n; }\n",
     2, "pointer or reference `Args&` without an address space"),
    ("cast to a pointer without an address space",
     "kernel void k(device float* out [[buffer(0)]]) {\n  out[0] = ((float*)out)[1];\n}\n",
     2, "pointer or reference `float*` without an address space"),
    ("non-constant program-scope variable", "float scale = 2.0f;\n", 1,
     "program-scope variable outside the constant address space"),
    ("static local", "inline float f() {\n  static float s = 0.0f;\n  return s;\n}\n", 2,
     "static local variable outside the constant address space"),
    ("lambda", "inline float f(float x) {\n  return [&](float y) { return y + x; }(1.0f);\n}\n", 2,
     "lambda expressions are not supported by Metal"),
    ("function pointer", "inline float g(float x) { return x; }\ninline float f(float x) {\n"
     "  float (*p)(float) = g;\n  return p(x);\n}\n", 3, "function pointers are not supported by Metal"),
    ("misspelt attribute",
     "[[max_total_threads_per_thread_group(64)]] kernel void k(device float* o [[buffer(0)]]) {}\n", 1,
     "unknown attribute [[max_total_threads_per_thread_group]]"),
    ("misspelt argument attribute", "kernel void k(device float* o [[bufer(0)]]) {}\n", 1,
     "unknown attribute [[bufer]]"),
    ("C++17 attribute", "inline float f(float x) {\n  [[maybe_unused]] float y = x;\n  return x;\n}\n", 2,
     "[[maybe_unused]] is C++17, newer than the C++14 that MSL 3 is based on"),
    ("C++20 keyword", "template <typename T>\nconcept Small = sizeof(T) <= 4;\n", 2,
     "C++20, newer than any MSL"),
    ("transposed simdgroup_load",
     "kernel void k(threadgroup float* t [[threadgroup(0)]]) {\n  simdgroup_float8x8 m;\n"
     "  simdgroup_load(m, t, 8, ulong2(0, 0), true);\n}\n", 3, "simdgroup_load with transpose = true"),
]


@pytest.mark.parametrize("what,body,line,message", RULES, ids=[r[0] for r in RULES])
def test_rule_names_file_and_line(tmp_path, what, body, line, message):
    bad = tmp_path / "bad.metal"
    bad.write_text(body)
    r = lint(bad)
    assert r.returncode == 1, r.stdout
    assert f"{bad}:{line}: {message}" in r.stdout, r.stdout


def test_allowed_forms_pass(tmp_path):
    """What the rules must not flag: address-spaced pointers and references (also through a
    macro), casts, products and bitwise ands, subscripts, constant program-scope data, threadgroup
    pointers passed to helpers, simdgroup_load without transpose."""
    good = tmp_path / "good.metal"
    good.write_text(
        '#include <metal_stdlib>\n#include "lily_msl.h"\nusing namespace metal;\n'
        "#define MY_THREAD thread\n"
        "constant float kScale = 2.0f;\nconstant uint kTable[2] = {1u, 2u};\n"
        "struct Args { uint n; };\n"
        "template <typename T>\ninline T load(device const T* p, thread uint& i, MY_THREAD float& f) "
        "{ return p[i] * T(f); }\n"
        "inline void fill(threadgroup float* t, uint i) { t[i] = 0.0f; }\n"
        "kernel void k(device float* out [[buffer(0)]], constant Args& a [[buffer(1)]],\n"
        "              uint gid [[thread_position_in_grid]]) {\n"
        "  LILY_THREADGROUP(float, tile, [64]);\n  fill(tile, gid % 64);\n"
        "  uint i = gid & 3u;\n  float f = out[i] * kScale;\n"
        "  device const uint* w = (device const uint*)out;\n"
        "  simdgroup_float8x8 m;\n  simdgroup_load(m, tile, 8, ulong2(0, 0), false);\n"
        "  out[gid] = load(out, i, f) + float(w[kTable[i & 1u]] & a.n);\n}\n"
    )
    r = lint(good)
    assert r.returncode == 0, r.stdout


def test_product_kernels_bind_args_then_reads_then_writes(tmp_path):
    """metal/ kernels number their buffers args, reads, writes (the order the host binds them
    in, csrc/gpu/encoder.h); test kernels may use any order."""
    (tmp_path / "metal").mkdir()
    bad = tmp_path / "metal" / "k.metal"
    bad.write_text(
        "struct Args { uint n; };\n"
        "kernel void late_args(device const float* x [[buffer(0)]],\n"
        "                      constant Args& args [[buffer(1)]]) {}\n"
        "kernel void read_after_write(constant Args& args [[buffer(0)]], device float* y [[buffer(1)]],\n"
        "                             device const float* x [[buffer(2)]]) {}\n"
        "kernel void gap(constant Args& args [[buffer(0)]], device float* y [[buffer(2)]]) {}\n"
        "kernel void good(constant Args& args [[buffer(0)]], device const float* x [[buffer(1)]],\n"
        "                 device float* y [[buffer(2)]], uint i [[thread_position_in_grid]]) {}\n"
    )
    r = lint(bad)
    assert r.returncode == 1
    assert f"{bad}:2: kernel 'late_args': buffer(0) 'x': [[buffer(0)]] is the argument struct" in r.stdout, r.stdout
    assert f"{bad}:5: kernel 'read_after_write': buffer(2) 'x': a buffer the kernel only reads comes before" in r.stdout
    assert f"{bad}:6: kernel 'gap': buffer(2) 'y': buffers are numbered in parameter order from 0 (expected 1)" in r.stdout
    assert "'good'" not in r.stdout
