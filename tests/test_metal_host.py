"""The Objective-C++ Metal host (csrc/metal/*.mm) type-checks on Linux against GNUstep's
Foundation and our declarations of Apple's Metal API (scripts/check_metal_host.sh), and the
check does catch the mistakes it is for; our declarations exist in Apple's API (metal-cpp's
list of selectors, classes, constants and enum values, tests/metal_host/metal_api.txt)."""

import re
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


# ---- our Metal declarations against Apple's API ----------------------------------------------------

METAL_H = ROOT / "tests" / "metal_host" / "Metal" / "Metal.h"
API = ROOT / "tests" / "metal_host" / "metal_api.txt"  # scripts/metal_api_list.py, from metal-cpp


def apple_api():
    kinds = {"sel": set(), "class": set(), "const": set(), "enum": {}}
    for line in API.read_text().splitlines():
        if line and not line.startswith("#"):
            kind, name, *value = line.split()
            if kind == "enum":
                kinds[kind][name] = int(value[0])
            else:
                kinds[kind].add(name)
    return kinds


def declared(text):
    """(selectors, classes, constants, enum values) our Metal.h declares. Methods: `- (T)a:(T)x
    b:(T)y;` -> a:b:; properties: the getter (getter=...) and, unless readonly, set<Name>:."""
    code = re.sub(r"//[^\n]*", "", text)
    sels, classes, consts, enums = set(), set(), set(), {}
    for m in re.finditer(r"^[-+]\s*\([^;]*?;", code, re.M | re.S):
        decl = re.sub(r"\s+", " ", m.group(0))
        body = decl[decl.index(")") + 1:]  # after the return type
        body = re.sub(r"\((?:[^()]|\([^()]*\))*\)", " ", body)  # parameter types
        parts = re.findall(r"(\w+)\s*:", body)
        sels.add("".join(p + ":" for p in parts) if parts else body.strip(" ;").split()[0])
    for m in re.finditer(r"@property\s*\(([^)]*)\)[^;]*?(\w+)\s*;", code):
        attrs, name = m.group(1), m.group(2)
        getter = re.search(r"getter\s*=\s*(\w+)", attrs)
        sels.add(getter.group(1) if getter else name)
        if "readonly" not in attrs:
            sels.add(f"set{name[0].upper()}{name[1:]}:")
    classes |= set(re.findall(r"@interface\s+(\w+)", code))
    consts |= set(re.findall(r"MTL_EXTERN[^;]*?\b(MTL\w+)\s*(?:\(|;)", code))
    macros = {m.group(1): m.group(2) for m in re.finditer(r"#define\s+(MTL\w+)\s+(\S+)", code)}
    for block in re.findall(r"NS_(?:ENUM|OPTIONS)\([^)]*\)\s*\{(.*?)\}", code, re.S):
        for name, expr in re.findall(r"(MTL\w+)\s*=\s*([^,]+),", block):
            for known, v in {**macros, **enums}.items():
                expr = re.sub(rf"\b{known}\b", f"({v})", expr)
            assert re.fullmatch(r"[\d\s()<>+|x]+", expr), f"{name} = {expr}: not a constant expression"
            enums[name] = eval(expr)  # digits and operators only (checked above)
    return sels, classes, consts, enums


def test_metal_declarations_exist_in_apple_api():
    """Every selector, property, class, constant and enum value our Metal.h declares is one of
    Apple's (as metal-cpp lists them), so the Linux type-check cannot pass on an API that does
    not exist."""
    api = apple_api()
    sels, classes, consts, enums = declared(METAL_H.read_text())
    assert len(sels) > 60 and len(enums) > 40  # the parser read the header
    assert not sels - api["sel"], f"selectors Apple's Metal does not have: {sorted(sels - api['sel'])}"
    assert not classes - api["class"], f"classes Apple's Metal does not have: {sorted(classes - api['class'])}"
    assert not consts - api["const"], f"constants Apple's Metal does not have: {sorted(consts - api['const'])}"
    wrong = {n: v for n, v in enums.items() if api["enum"].get(n) != v}
    assert not wrong, "enum values differing from Apple's: " + ", ".join(
        f"{n} = {v} (Apple: {api['enum'].get(n)})" for n, v in sorted(wrong.items()))


def test_declaration_check_catches_a_misspelt_selector_and_value():
    api = apple_api()
    text = METAL_H.read_text()
    bad = text.replace("- (void)requestResidency;", "- (void)requestResidencyNow;").replace(
        "MTLGPUFamilyApple10 = 1010", "MTLGPUFamilyApple10 = 1011")
    sels, _, _, enums = declared(bad)
    assert sels - api["sel"] == {"requestResidencyNow"}
    assert {n for n, v in enums.items() if api["enum"].get(n) != v} == {"MTLGPUFamilyApple10"}
