"""The Objective-C++ Metal host (csrc/metal/*.mm) type-checks on Linux against GNUstep's
Foundation and our declarations of Apple's Metal API (scripts/check_metal_host.sh), and the
check does catch the mistakes it is for."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_metal_host.sh"
DEVICE_MM = ROOT / "csrc" / "metal" / "device.mm"


def check(*files):
    return subprocess.run(
        ["bash", str(SCRIPT), *map(str, files)], capture_output=True, text=True, timeout=120
    )


def test_metal_host_type_checks():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "device.mm OK" in r.stdout


@pytest.mark.parametrize(
    "before,after,error",
    [
        # A selector Metal does not have (Apple's is setBuffer:offset:atIndex:).
        (
            "setBuffer:b->buffer() offset:offset atIndex:index",
            "setBuffer:b->buffer() offset:offset index:index",
            "instance method '-setBuffer:offset:index:' not found",
        ),
        # Our struct where Metal takes an MTLSize.
        (
            "dispatchThreadgroups:MTLSizeMake(grid.width, grid.height, grid.depth)",
            "dispatchThreadgroups:grid",
            "no viable conversion from 'gpu::Size3' to 'MTLSize'",
        ),
        # A C++ string where Metal takes an NSString.
        (
            "newFunctionWithName:ns(function)",
            "newFunctionWithName:function",
            "no viable conversion from 'const std::string'",
        ),
    ],
)
def test_check_catches_api_misuse(tmp_path, before, after, error):
    src = DEVICE_MM.read_text()
    assert before in src
    bad = tmp_path / "device.mm"
    bad.write_text(src.replace(before, after))
    r = check(bad)
    assert r.returncode != 0
    assert error in r.stderr, r.stderr[-2000:]
