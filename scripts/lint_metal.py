#!/usr/bin/env python3
"""Lint MSL sources for what Apple's Metal compiler rejects but the C++ compiler that runs them
on the CPU (csrc/msl_cpu/) accepts, so a kernel that passes CI on Linux also compiles on a Mac.

    scripts/lint_metal.py [paths...]      (default: metal/ and tests/msl/kernels/)

Checks .metal files and the headers beside them (comments and strings ignored):
  - no `double` (Metal has no 64-bit float), and no unsuffixed floating literal (double in
    C++, float in Metal: the CPU run would round differently)
  - no C++ standard library (`std::`, `#include <cmath>` ...): only <metal_*> headers and
    Metal 4's <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
  - in product kernels (files in a folder named metal/, which must build on every Apple GPU
    from M1): Metal 4 tensor headers (<metal_tensor>, MetalPerformancePrimitives) only inside
    `#if defined(__HAVE_TENSOR__)` / `#ifdef __HAVE_TENSOR__`, which the compiler defines where
    tensors exist; unguarded, the whole library fails to build on M1-M4
  - no exceptions, `new` / `delete`, virtual functions or RTTI
  - no recursion (a call cycle among the functions of one file)
  - no `template [[host_name(...)]]` instantiation and no kernel-scope `threadgroup T x[N]`
    declarations: both break the CPU build; use LILY_KERNEL_INSTANTIATE / LILY_THREADGROUP
    from metal/lily_msl.h
Prints `file:line: message` per finding; exits 1 if there is any.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TOKEN_RULES = [
    (re.compile(r"\bdouble\b"), "`double` is not supported by Metal; use float"),
    (
        re.compile(r"\bstd\s*::"),
        "no C++ standard library in MSL (`std::`); use metal:: equivalents",
    ),
    (re.compile(r"\b(throw|try|catch)\b"), "exceptions are not supported by Metal"),
    (
        re.compile(r"\bnew\b|\bdelete\b"),
        "dynamic allocation (`new` / `delete`) is not supported by Metal",
    ),
    (re.compile(r"\bvirtual\b"), "virtual functions are not supported by Metal"),
    (re.compile(r"\b(dynamic_cast|typeid)\b"), "RTTI is not supported by Metal"),
    (
        re.compile(r"\btemplate\s*\[\[\s*host_name"),
        "explicit instantiation with [[host_name]] does not compile for the CPU; use LILY_KERNEL_INSTANTIATE",
    ),
    (
        re.compile(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+(?=[eE][+-]?\d))([eE][+-]?\d+)?(?![\w.])"),
        "unsuffixed floating literal: C++ evaluates it in double, Metal in float; write it with f (or h)",
    ),
    (
        re.compile(r"(?:^|(?<=[;{}]))\s*\bthreadgroup\s+[A-Za-z_][\w:<>, ]*?\s+[A-Za-z_]\w*\s*\["),
        "kernel-scope threadgroup array: declare it with LILY_THREADGROUP(type, name, [dims]) so it also runs on the CPU",
    ),
]
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
SYSTEM_HEADERS = {"MetalPerformancePrimitives/MetalPerformancePrimitives.h"}
TENSOR_HEADERS = {"metal_tensor", "MetalPerformancePrimitives/MetalPerformancePrimitives.h"}
PP_IF = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)")
HAVE_TENSOR = re.compile(r"^\s*(defined\s*\(?\s*__HAVE_TENSOR__\s*\)?|__HAVE_TENSOR__)\s*$")
KEYWORDS = {
    "if",
    "for",
    "while",
    "switch",
    "return",
    "sizeof",
    "alignof",
    "decltype",
    "static_assert",
    "catch",
    "defined",
    "static_cast",
    "reinterpret_cast",
    "const_cast",
}


def mask(text):
    """Blank comments and string/char literals, keeping newlines and offsets."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        if text.startswith("//", i):
            e = text.find("\n", i)
            e = n if e < 0 else e
            blank(i, e)
            i = e
        elif text.startswith("/*", i):
            e = text.find("*/", i + 2)
            e = n if e < 0 else e + 2
            blank(i, e)
            i = e
        elif text[i] in "\"'":
            q, e = text[i], i + 1
            while e < n and text[e] != q and text[e] != "\n":
                e += 2 if text[e] == "\\" else 1
            blank(i + 1, e)
            i = e + 1
        else:
            i += 1
    return "".join(out)


def line_at(text, pos):
    return text.count("\n", 0, pos) + 1


def functions(code):
    """Top-level function definitions: name -> (body start, body end)."""
    found = {}
    for m in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", code):
        name = m.group(1)
        if name in KEYWORDS:
            continue
        # The parameter list, then optional qualifiers/attributes, then a body.
        depth, j = 0, m.end() - 1
        while j < len(code):
            depth += code[j] == "("
            depth -= code[j] == ")"
            if depth == 0:
                break
            j += 1
        k = j + 1
        tail = re.match(r"\s*(const\s*)?(\[\[[^\]]*\]\]\s*)*\{", code[k:])
        if not tail or code[: m.start()].count("{") != code[: m.start()].count("}"):
            continue  # a call, a declaration, or a function-local construct
        start = k + tail.end() - 1
        depth, e = 0, start
        while e < len(code):
            depth += code[e] == "{"
            depth -= code[e] == "}"
            if depth == 0:
                break
            e += 1
        found.setdefault(name, []).append((start, e))
    return found


def recursion(code):
    funcs = functions(code)
    calls = {}
    for name, bodies in funcs.items():
        called = set()
        for a, b in bodies:
            called |= {
                c
                for c in re.findall(r"\b([A-Za-z_]\w*)\s*(?:<[^<>;]*>)?\s*\(", code[a:b])
                if c in funcs
            }
        calls[name] = called
    findings = []
    for start in funcs:
        # Depth-first search for a path back to `start`.
        stack, seen = [(start, [start])], set()
        while stack:
            f, path = stack.pop()
            for g in calls.get(f, ()):
                if g == start:
                    findings.append((funcs[start][0][0], " -> ".join(path + [g])))
                    stack.clear()
                    break
                if g not in seen:
                    seen.add(g)
                    stack.append((g, path + [g]))
    return findings


def lint_file(path):
    text = path.read_text()
    code = mask(text)
    problems = []
    for rx, msg in TOKEN_RULES:
        if "host_name" in rx.pattern and path.suffix != ".metal":
            continue  # metal/lily_msl.h defines the macro with it
        for m in rx.finditer(code):
            problems.append(
                (line_at(code, m.start() + len(m.group(0)) - len(m.group(0).lstrip())), msg)
            )
    product = path.resolve().parent.name == "metal"
    guards = []  # per open #if: whether its current branch is `__HAVE_TENSOR__` defined
    text_lines = text.splitlines()  # unmasked: an include names its header in a "literal"
    for i, line in enumerate(code.splitlines(), 1):
        pp = PP_IF.match(line)
        if pp:
            kind, cond = pp.group(1), pp.group(2)
            if kind in ("if", "ifdef", "ifndef"):
                guards.append(kind != "ifndef" and bool(HAVE_TENSOR.match(cond)))
            elif kind in ("elif", "else") and guards:
                guards[-1] = False
            elif kind == "endif" and guards:
                guards.pop()
        m = INCLUDE.match(text_lines[i - 1])
        if not m or m.group(1) != "<":
            continue
        header = m.group(2)
        if not header.startswith("metal_") and header not in SYSTEM_HEADERS:
            problems.append((i, f"#include <{header}>: only <metal_*> headers exist in MSL"))
        elif product and header in TENSOR_HEADERS and not any(guards):
            problems.append((i, f"#include <{header}> outside `#if defined(__HAVE_TENSOR__)`: "
                                "the library would not build on GPUs without Metal 4 tensors"))
    for pos, cycle in recursion(code):
        problems.append((line_at(code, pos), f"recursion ({cycle}) is not supported by Metal"))
    return [f"{path}:{line}: {msg}" for line, msg in sorted(set(problems))]


def main(argv):
    targets = [Path(a) for a in argv] or [ROOT / "metal", ROOT / "tests" / "msl" / "kernels"]
    files = []
    for t in targets:
        if t.is_dir():
            files += sorted(p for p in t.rglob("*") if p.suffix in (".metal", ".h"))
        elif t.is_file():
            files.append(t)
        else:
            print(f"lint_metal: {t} does not exist", file=sys.stderr)
            return 2
    problems = [p for f in files for p in lint_file(f)]
    for p in problems:
        print(p)
    print(f"lint_metal: {len(files)} files, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
