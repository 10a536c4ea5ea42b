#!/usr/bin/env python3
"""Regenerates tests/metal_host/metal_api.txt: the names of Apple's Metal API (Objective-C
selectors, class names, constants, enum values) as metal-cpp, Apple's C++ bindings, lists them.
tests/test_metal_host.py checks our declarations of Metal (tests/metal_host/Metal/Metal.h, used
to type-check csrc/metal/device.mm on Linux) against it, so a selector or enum value Apple does
not have fails CI.

    scripts/metal_api_list.py [--wheel PATH] [--out tests/metal_host/metal_api.txt]

metal-cpp ships inside the macOS build of MLX's `mlx-metal` wheel; without --wheel this
downloads it with pip (`pip download --no-deps --platform macosx_14_0_arm64 --only-binary=:all:
mlx-metal`), which works from Linux. Only names and numbers are extracted and committed, none of
metal-cpp's code.
"""

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "metal_host" / "metal_api.txt"
METAL_CPP = "mlx/include/metal_cpp/Metal/"

SEL = re.compile(r'_MTL_PRIVATE_DEF_SEL\(\s*\w+\s*,\s*"([^"]+)"\s*\)')
CLS = re.compile(r"_MTL_PRIVATE_DEF_CLS\(\s*(\w+)\s*\)")
CONST = re.compile(r"_MTL_PRIVATE_DEF_(?:CONST|STR|WEAK_CONST)\(\s*[\w:]+\s*,\s*(\w+)\s*\)")
FUNCTION = re.compile(r'extern\s+"C"\s+[\w:*\s]+?\b(MTL\w+)\s*\(')
ENUM_BLOCK = re.compile(r"_MTL_(?:ENUM|OPTIONS)\(\s*[\w:]+\s*,\s*(\w+)\s*\)\s*\{(.*?)\}", re.S)
ENUM_ENTRY = re.compile(r"^\s*(\w+)\s*=\s*([^,\n]+?)\s*,?\s*(?://.*)?$", re.M)


def literal(expr):
    """The value of an integer literal or a shift of two (`1 << 4`), else None."""
    expr = expr.strip().rstrip(",").strip()
    m = re.fullmatch(r"\(?\s*(\d+|0x[0-9a-fA-F]+)\s*<<\s*(\d+)\s*\)?", expr)
    if m:
        return int(m.group(1), 0) << int(m.group(2))
    if re.fullmatch(r"-?\d+|0x[0-9a-fA-F]+", expr):
        return int(expr, 0)
    return None


def extract(wheel):
    z = zipfile.ZipFile(wheel)
    headers = {n: z.read(n).decode() for n in z.namelist() if n.startswith(METAL_CPP) and n.endswith(".hpp")}
    if not headers:
        raise SystemExit(f"metal_api_list: no metal-cpp headers under {METAL_CPP} in {wheel}")
    sels, classes, consts, enums = set(), set(), set(), {}
    for text in headers.values():
        sels |= set(SEL.findall(text))
        classes |= set(CLS.findall(text))
        consts |= {"MTL" + c for c in CONST.findall(text)}
        consts |= set(FUNCTION.findall(text))
        for _, body in ENUM_BLOCK.findall(text):
            for name, value in ENUM_ENTRY.findall(body):
                v = literal(value)
                if v is not None:
                    enums["MTL" + name] = v
    lines = [f"# Apple's Metal API as metal-cpp lists it ({Path(wheel).name}); regenerate with "
             "scripts/metal_api_list.py. Names and values only: sel <selector>, class <name>, "
             "const <name>, enum <name> <value>."]
    lines += [f"sel {s}" for s in sorted(sels)]
    lines += [f"class {c}" for c in sorted(classes)]
    lines += [f"const {c}" for c in sorted(consts)]
    lines += [f"enum {n} {v}" for n, v in sorted(enums.items())]
    return lines


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, help="a macOS mlx-metal wheel (default: download it with pip)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--platform", "macosx_14_0_arm64",
                            "--only-binary=:all:", "mlx-metal", "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("mlx_metal-*.whl"))
        lines = extract(wheel)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"metal_api_list: {len(lines) - 1} names from {Path(wheel).name} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
