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


def test_tensor_headers_guarded_in_product_kernels(tmp_path):
    """Metal 4 headers are allowed, but a product kernel (metal/) must include them under
    __HAVE_TENSOR__, or the library stops building on M1-M4; test kernels may include them as is."""
    (tmp_path / "metal").mkdir()
    src = ("#include <metal_stdlib>\n#include <metal_tensor>\n"
           "#if defined(__HAVE_TENSOR__)\n#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"
           "#else\n#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n#endif\n"
           "#ifdef __HAVE_TENSOR__\n#include <metal_tensor>\n#endif\n")
    product, test_kernel = tmp_path / "metal" / "k.metal", tmp_path / "k.metal"
    product.write_text(src)
    test_kernel.write_text(src)
    r = lint(product)
    flagged = sorted(int(line.split(":")[1]) for line in r.stdout.splitlines())
    assert flagged == [2, 6] and "outside `#if defined(__HAVE_TENSOR__)`" in r.stdout, r.stdout
    assert lint(test_kernel).returncode == 0
