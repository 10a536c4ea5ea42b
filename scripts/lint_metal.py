#!/usr/bin/env python3
"""Lint MSL sources for what Apple's Metal compiler rejects but the C++ compiler that runs them
on the CPU (csrc/msl_cpu/) accepts, so a kernel that passes CI on Linux also compiles on a Mac.

    scripts/lint_metal.py [paths...]   (default: metal/, tests/msl/kernels/, examples/add_a_kernel/)

Checks .metal files and the headers beside them (comments and strings ignored). Each finding is
printed as `file:line: message`; the exit status is 1 if there is any.

Language (MSL 3 is C++14 with restrictions; the MSL spec, "C++14 features not supported"):
  - no `double` (Metal has no 64-bit float), no unsuffixed floating literal (double in C++,
    float in Metal: the CPU run would round differently)
  - no C++ standard library (`std::`, `#include <cmath>` ...): only <metal_*> headers and Metal
    4's <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
  - no exceptions, `new` / `delete`, virtual functions, RTTI, recursion, lambdas, function
    pointers
  - every pointer and reference names its address space (device, constant, threadgroup, thread)
  - program-scope variables (and static ones anywhere) live in the `constant` address space
  - every [[attribute]] is one MSL knows (a misspelt one is silently ignored by C++); the C++17
    attributes (nodiscard, maybe_unused, fallthrough, ...) only in Metal 4 tensor files (MSL 4 is
    C++17-based); no C++20 keyword (concept, requires, consteval, coroutines, ...). Other
    constructs newer than the library's language are errors of the kernel compile itself
    (csrc/msl_cpu/compiler.cpp: clang's -Wpre-c++17-compat / -Wpre-c++20-compat as errors).
Threadgroup memory:
  - declared only in `kernel` functions (MLX's and ggml-metal's kernels all do this; Apple's
    compiler rejects it in other functions): helpers take a `threadgroup T*`
  - kernel-scope arrays through LILY_THREADGROUP (metal/lily_msl.h), and no
    `template [[host_name(...)]]` instantiation (LILY_KERNEL_INSTANTIATE): both break the CPU build
Simdgroup matrices:
  - no simdgroup_load / simdgroup_store with transpose = true: tiles are written in the layout the
    multiply needs (while dequantizing), as MLX's and ggml-metal's kernels do
Buffer order (product kernels, files in metal/; csrc/gpu/encoder.h binds in this order):
  - [[buffer(0)]] is `constant <Args>& args`, then the buffers the kernel only reads
    (`device const` / `constant`), then the ones it writes, numbered consecutively
Metal 4:
  - in product kernels (files in a folder named metal/, which must build on every Apple GPU from
    M1) the tensor headers (<metal_tensor>, MetalPerformancePrimitives) only in files named
    *_tensor.metal / *_tensor.h: those are their own libraries, compiled as MSL 4.0 only where the
    GPU has tensors, so a failure there cannot take the other kernels down
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGETS = ("metal", "tests/msl/kernels", "examples/add_a_kernel")

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
        re.compile(r"\b(concept|requires|consteval|constinit|co_await|co_yield|co_return|char8_t)\b"),
        "C++20, newer than any MSL (MSL 3 is C++14, MSL 4 C++17; clang's compatibility warnings miss these)",
    ),
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
KEYWORDS = {
    "if", "for", "while", "switch", "return", "sizeof", "alignof", "decltype", "static_assert",
    "catch", "defined", "static_cast", "reinterpret_cast", "const_cast",
}

# MSL's address spaces (and macros of lily's that expand to one on the kernel side).
ADDRESS_SPACES = {"device", "constant", "threadgroup", "thread", "threadgroup_imageblock", "ray_data",
                  "object_data"}

# Attributes MSL knows: function and argument attributes of the MSL specification (section 5),
# the thread-position builtins, and C++14's own. A name outside these is a typo C++ ignores.
MSL_ATTRIBUTES = {
    # functions
    "kernel", "vertex", "fragment", "visible", "stitchable", "host_name",
    "max_total_threads_per_threadgroup", "required_threads_per_threadgroup", "patch",
    "early_fragment_tests", "object", "mesh", "intersection",
    # arguments and resources
    "buffer", "texture", "sampler", "threadgroup", "function_constant", "id", "stage_in",
    "user", "raster_order_group", "threadgroup_imageblock", "imageblock_data", "payload",
    "color", "attribute", "position", "point_size", "clip_distance", "render_target_array_index",
    "viewport_array_index", "sample_id", "sample_mask", "front_facing", "vertex_id", "instance_id",
    "base_vertex", "base_instance", "amplification_id", "amplification_count", "flat",
    "center_perspective", "centroid_perspective", "sample_perspective", "center_no_perspective",
    "centroid_no_perspective", "sample_no_perspective", "depth", "stencil", "primitive_id",
    "barycentric_coord", "point_coord", "render_target", "patch_id", "position_in_patch",
    "origin", "alias_implicit_imageblock", "alias_implicit_imageblock_color", "shared",
    # kernel builtins
    "thread_position_in_grid", "threads_per_grid", "thread_position_in_threadgroup",
    "threads_per_threadgroup", "threadgroup_position_in_grid", "threadgroups_per_grid",
    "dispatch_threads_per_threadgroup", "thread_index_in_threadgroup", "thread_index_in_simdgroup",
    "threads_per_simdgroup", "thread_execution_width", "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup",
    "quadgroup_index_in_threadgroup", "thread_index_in_quadgroup", "quadgroups_per_threadgroup",
    "dispatch_quadgroups_per_threadgroup", "grid_origin", "grid_size",
    "thread_position_in_mesh", "threadgroup_position_in_object",
    # C++14
    "noreturn", "carries_dependency", "deprecated",
}
CXX17_ATTRIBUTES = {"nodiscard", "maybe_unused", "fallthrough", "likely", "unlikely", "no_unique_address"}

BUILTIN_TYPES = {
    "void", "bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half",
    "bfloat", "float", "size_t", "ptrdiff_t", "signed", "unsigned", "int8_t", "uint8_t", "int16_t",
    "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t", "atomic_int", "atomic_uint",
    "atomic_float", "atomic_bool", "atomic_ulong", "auto",
}
VECTOR_TYPE = re.compile(r"(?:packed_)?(?:bool|char|uchar|short|ushort|int|uint|long|ulong|half|bfloat|float)"
                         r"(?:[234]|[234]x[234])$|simdgroup_(?:float|half|bfloat)8x8$")

TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|::|->|&&|\|\||<<=|>>=|[-+*/%&|^<>=!]=|\+\+|--|\S")


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


def without_preprocessor(code):
    """The masked code with preprocessor lines (and their continuations) blanked."""
    lines = code.split("\n")
    cont = False
    for i, line in enumerate(lines):
        if cont or line.lstrip().startswith("#"):
            cont = line.rstrip().endswith("\\")
            lines[i] = " " * len(line)
    return "\n".join(lines)


def line_at(text, pos):
    return text.count("\n", 0, pos) + 1


class Tok:
    __slots__ = ("s", "pos")

    def __init__(self, s, pos):
        self.s, self.pos = s, pos

    def __repr__(self):
        return self.s


def tokenize(code):
    return [Tok(m.group(0), m.start()) for m in TOKEN.finditer(code)]


def match_forward(toks, i, open_, close):
    depth = 0
    for j in range(i, len(toks)):
        if toks[j].s == open_:
            depth += 1
        elif toks[j].s == close:
            depth -= 1
            if depth == 0:
                return j
    return len(toks) - 1


def match_back(toks, i, open_, close):
    depth = 0
    for j in range(i, -1, -1):
        if toks[j].s == close:
            depth += 1
        elif toks[j].s == open_:
            depth -= 1
            if depth == 0:
                return j
    return -1


# ---- scopes: namespaces, classes, function bodies ----------------------------------------------

class Function:
    def __init__(self, name, head, body, kernel, params):
        self.name, self.head, self.body, self.kernel, self.params = name, head, body, kernel, params


def parse_scopes(toks):
    """Functions defined at namespace or class scope, and the statements at namespace / class
    scope. Returns (functions, statements): statements are (kind, [token index...]) where kind is
    "namespace" or "class"; functions carry their head, body and parameter token ranges."""
    functions, statements = [], []
    stack = ["namespace"]  # kinds of the open braces
    start = 0  # first token of the current head / statement at this level
    i = 0
    while i < len(toks):
        s = toks[i].s
        kind = stack[-1]
        if s == "[" and i + 1 < len(toks) and toks[i + 1].s == "[":  # an attribute: opaque
            i = match_forward(toks, i, "[", "]") + 1
            continue
        if s == "{":
            if kind in ("function", "block"):
                stack.append("block")
            else:
                head = [t.s for t in toks[start:i]]
                close = _param_list_close(toks, start, i)
                if "namespace" in head:
                    stack.append("namespace")
                elif close is not None:
                    open_ = match_back(toks, close, "(", ")")
                    name = toks[open_ - 1].s if open_ > 0 else "?"
                    body_end = match_forward(toks, i, "{", "}")
                    kernel = "kernel" in head
                    functions.append(Function(name, (start, i), (i, body_end), kernel, (open_, close)))
                    stack.append("function")
                elif any(h in ("struct", "class", "union", "enum") for h in head):
                    stack.append("class")
                else:
                    stack.append("block")  # an initializer
            start = i + 1
        elif s == "}":
            if len(stack) > 1:
                stack.pop()
            start = i + 1
        elif s == ";":
            if kind in ("namespace", "class") and start < i:
                statements.append((kind, list(range(start, i))))
            start = i + 1
        elif s == ":" and kind == "class" and i > 0 and toks[i - 1].s in ("public", "private", "protected"):
            start = i + 1
        i += 1
    return functions, statements


def _param_list_close(toks, start, brace):
    """The `)` closing a function's parameter list when toks[start:brace] is a function head
    (`... name(params) const [[attr]] {`), else None."""
    j = brace - 1
    while j >= start:
        s = toks[j].s
        if s == "]":  # trailing attribute
            j = match_back(toks, j, "[", "]") - 1
            continue
        if s in ("const", "noexcept", "override", "final"):
            j -= 1
            continue
        break
    if j < start or toks[j].s != ")":
        return None
    open_ = match_back(toks, j, "(", ")")
    if open_ <= start or not re.match(r"[A-Za-z_]\w*$", toks[open_ - 1].s) or toks[open_ - 1].s in KEYWORDS:
        return None
    return j


# ---- checks ---------------------------------------------------------------------------------------

def collect_types(code, toks):
    """Names declared as types in this file: structs, classes, enums, typedefs, using aliases and
    template type parameters."""
    names = set()
    for i, t in enumerate(toks[:-1]):
        if t.s in ("struct", "class", "union", "enum", "typename") and re.match(r"[A-Za-z_]\w*$", toks[i + 1].s):
            names.add(toks[i + 1].s)
        elif t.s == "using" and i + 2 < len(toks) and toks[i + 2].s == "=":
            names.add(toks[i + 1].s)
    for m in re.finditer(r"\btypedef\b[^;]*?\b([A-Za-z_]\w*)\s*;", code):
        names.add(m.group(1))
    return names


def address_space_macros(code):
    """Macros defined (in any #if branch) to an address space, e.g. LILY_SAMPLE_THREAD."""
    out = set()
    for m in re.finditer(r"^\s*#\s*define\s+([A-Za-z_]\w*)\s+(\w+)\s*$", code, re.M):
        if m.group(2) in ADDRESS_SPACES:
            out.add(m.group(1))
    return out


def is_type(name, types):
    return name in BUILTIN_TYPES or name in types or bool(VECTOR_TYPE.match(name))


def check_address_spaces(toks, types, spaces):
    """A pointer or reference whose type names no address space."""
    found = []
    for i, t in enumerate(toks):
        if t.s not in ("*", "&") or i == 0 or i + 1 >= len(toks):
            continue
        prev, nxt = toks[i - 1].s, toks[i + 1].s
        if prev == "operator":
            continue
        end = i - 1
        if prev == "(":  # T (&name)[N] / T (*name)(...)
            end = i - 2
            if end < 0:
                continue
            prev = toks[end].s
        if prev == ">":
            open_ = match_back(toks, end, "<", ">")
            if open_ <= 0 or not is_type(toks[open_ - 1].s, types) and toks[open_ - 1].s not in ("vec", "array"):
                continue
        elif not (is_type(prev, types) or prev in ("const", "volatile")):
            continue
        if not (re.match(r"[A-Za-z_]\w*$", nxt) or nxt in (")", ",", ">", "*", "&", "[")):
            continue
        if nxt in ("*", "&") and i + 2 < len(toks) and toks[i + 2].s == "(":
            continue
        # Walk back over the type: identifiers, ::, const, template argument lists.
        j, words = end, []
        while j >= 0:
            s = toks[j].s
            if s == ">":
                j = match_back(toks, j, "<", ">") - 1
                continue
            if s == "::" or re.match(r"[A-Za-z_]\w*$", s):
                if s in ("return", "case", "else", "do"):
                    break
                words.append(s)
                j -= 1
                continue
            break
        if words and not any(w in ADDRESS_SPACES or w in spaces for w in words):
            typ = " ".join(reversed(words))
            found.append((t.pos, f"pointer or reference `{typ}{t.s}` without an address space: "
                                 "write device, constant, threadgroup or thread"))
    return found


def check_program_scope(toks, statements, functions):
    """Program-scope (and static) variables outside the constant address space."""
    found = []
    skip_first = {"typedef", "using", "template", "static_assert", "struct", "class", "union", "enum",
                  "namespace", "friend", "extern"}
    for kind, idx in statements:
        words = []
        k = 0
        while k < len(idx):  # drop [[attributes]]
            t = toks[idx[k]]
            if t.s == "[" and k + 1 < len(idx) and toks[idx[k + 1]].s == "[":
                end = match_forward(toks, idx[k], "[", "]")
                while k < len(idx) and idx[k] <= end:
                    k += 1
                continue
            words.append(t)
            k += 1
        if not words or words[0].s in skip_first:
            continue
        if kind == "class" and "static" not in [w.s for w in words]:
            continue  # a data member
        before_init = []
        for w in words:
            if w.s in ("=", "{"):
                break
            before_init.append(w.s)
        if "(" in before_init or "operator" in before_init:
            continue  # a function declaration
        if "constant" not in before_init:
            what = "static member" if kind == "class" else "program-scope variable"
            found.append((words[0].pos, f"{what} outside the constant address space: Metal allows only "
                                        "`constant` data at program scope"))
    for f in functions:
        a, b = f.body
        for i in range(a, b):
            if toks[i].s == "static" and toks[i - 1].s in (";", "{", "}"):
                stmt = []
                for j in range(i, b):
                    if toks[j].s in (";", "=", "{"):
                        break
                    stmt.append(toks[j].s)
                if "constant" not in stmt and "(" not in stmt:
                    found.append((toks[i].pos, "static local variable outside the constant address space "
                                               "(Metal has no thread-private static storage)"))
    return found


def check_lambdas_and_function_pointers(toks, function_names):
    found = []
    for i, t in enumerate(toks):
        s = t.s
        if s == "[" and i + 1 < len(toks) and toks[i + 1].s != "[" and (i == 0 or toks[i - 1].s != "["):
            prev = toks[i - 1].s if i else ";"
            if re.match(r"[\w)\]]", prev) and prev not in ("return", "case"):
                continue  # a subscript
            close = match_forward(toks, i, "[", "]")
            after = toks[close + 1].s if close + 1 < len(toks) else ""
            if after in ("(", "{", "mutable", "->"):
                found.append((t.pos, "lambda expressions are not supported by Metal"))
        elif s == "(" and i + 3 < len(toks) and toks[i + 1].s == "*":
            close = match_forward(toks, i, "(", ")")
            inner = [x.s for x in toks[i + 2:close]]
            if close + 1 < len(toks) and toks[close + 1].s == "(" and all(re.match(r"\w+$", x) for x in inner):
                found.append((t.pos, "function pointers are not supported by Metal"))
        elif s == "&" and i + 1 < len(toks) and toks[i + 1].s in function_names:
            nxt = toks[i + 2].s if i + 2 < len(toks) else ""
            prev = toks[i - 1].s if i else ""
            if nxt not in ("(", "[", ".", "->") and not re.match(r"[\w)\]]", prev):
                found.append((t.pos, f"taking the address of function `{toks[i + 1].s}`: function "
                                     "pointers are not supported by Metal"))
    return found


def check_threadgroup_in_helpers(toks, functions):
    found = []
    for f in functions:
        if f.kernel:
            continue
        a, b = f.body
        for i in range(a, b):
            s = toks[i].s
            decl = None
            if s == "LILY_THREADGROUP" and toks[i + 1].s == "(":
                close = match_forward(toks, i + 1, "(", ")")
                args = [x.s for x in toks[i + 2:close]]
                decl = args[args.index(",") + 1] if "," in args else "?"
            elif s == "threadgroup" and toks[i - 1].s in (";", "{", "}", "const"):
                j = i + 1
                while j < b and toks[j].s not in (";", "*", "&", "(", "=", "["):
                    j += 1
                if j < b and toks[j].s in ("[", ";", "="):
                    decl = toks[j - 1].s
            if decl:
                found.append((toks[i].pos, f"threadgroup memory '{decl}' declared in function '{f.name}', "
                                           "which is not a kernel: declare it in the kernel and pass a "
                                           "`threadgroup T*` down (Metal allows threadgroup variables only "
                                           "in kernel functions)"))
    return found


def check_attributes(code, tensor_file):
    found = []
    for m in re.finditer(r"\[\[(.*?)\]\]", code, re.S):
        for part in re.split(r",(?![^(]*\))", m.group(1)):
            name = re.match(r"\s*(?:(\w+)\s*::\s*)?(\w+)", part)
            if not name:
                continue
            ns, attr = name.group(1), name.group(2)
            if ns:
                if ns != "clang":
                    found.append((m.start(), f"unknown attribute [[{ns}::{attr}]]"))
                continue
            if attr in MSL_ATTRIBUTES:
                continue
            if attr in CXX17_ATTRIBUTES:
                if not tensor_file:
                    found.append((m.start(), f"[[{attr}]] is C++17, newer than the C++14 that MSL 3 is based on"))
                continue
            found.append((m.start(), f"unknown attribute [[{attr}]] (misspelt? C++ ignores it; Metal does not)"))
    return found


def split_list(toks, open_, close):
    """The comma-separated items (token lists) between toks[open_] and toks[close]."""
    items, depth, cur = [], 0, []
    for t in toks[open_ + 1:close]:
        if t.s in "([{<" and len(t.s) == 1:
            depth += 1
        elif t.s in ")]}>" and len(t.s) == 1:
            depth -= 1
        if t.s == "," and depth == 0:
            items.append(cur)
            cur = []
        else:
            cur.append(t)
    items.append(cur)
    return items


def check_simdgroup_transpose(toks):
    found = []
    for i, t in enumerate(toks):
        if t.s in ("simdgroup_load", "simdgroup_store") and i + 1 < len(toks) and toks[i + 1].s == "(":
            args = [[x.s for x in item] for item in split_list(toks, i + 1, match_forward(toks, i + 1, "(", ")"))]
            if len(args) >= 5 and args[4] != ["false"]:
                found.append((t.pos, f"{t.s} with transpose = {' '.join(args[4])}: write the tile in the "
                                     "layout the multiply needs while dequantizing (as ggml-metal's mul_mm "
                                     "kernels do)"))
    return found


def check_buffer_order(toks, functions):
    """Kernel parameters: args at 0, reads, then writes, numbered 0, 1, 2, ..."""
    found = []
    for f in functions:
        if not f.kernel:
            continue
        params = split_list(toks, *f.params)
        expect, seen_write = 0, False
        for p in params:
            words = [t.s for t in p]
            if "buffer" not in words:
                continue
            i = words.index("buffer")
            if i + 2 >= len(words) or not words[i + 2].isdigit():
                continue
            index = int(words[i + 2])
            decl = words[:max(0, words.index("[") if "[" in words else len(words))]
            name = decl[-1] if decl else "?"
            reads = "constant" in decl or ("const" in decl and "device" in decl)
            where = f"kernel '{f.name}': buffer({index}) '{name}'"
            if index != expect:
                found.append((p[0].pos, f"{where}: buffers are numbered in parameter order from 0 (expected {expect})"))
            elif index == 0 and not ("constant" in decl and name == "args"):
                found.append((p[0].pos, f"{where}: [[buffer(0)]] is the argument struct, `constant <Args>& args`"))
            elif index > 0 and reads and seen_write:
                found.append((p[0].pos, f"{where}: a buffer the kernel only reads comes before every buffer it "
                                        "writes (args, reads, writes: csrc/gpu/encoder.h)"))
            seen_write |= index > 0 and not reads
            expect = index + 1
    return found


def recursion(toks, functions):
    bodies = {}
    for f in functions:
        bodies.setdefault(f.name, []).append(f.body)
    calls = {}
    for name, spans in bodies.items():
        called = set()
        for a, b in spans:
            for i in range(a, b):
                if toks[i].s in bodies and i + 1 < b:
                    j = i + 1
                    if toks[j].s == "<":
                        j = match_forward(toks, j, "<", ">") + 1
                    if j < b and toks[j].s == "(" and toks[i - 1].s not in (".", "->"):
                        called.add(toks[i].s)
        calls[name] = called
    findings = []
    for start in bodies:
        stack, seen = [(start, [start])], set()
        while stack:
            f, path = stack.pop()
            for g in calls.get(f, ()):
                if g == start:
                    findings.append((toks[bodies[start][0][0]].pos, " -> ".join(path + [g])))
                    stack.clear()
                    break
                if g not in seen:
                    seen.add(g)
                    stack.append((g, path + [g]))
    return findings


def lint_file(path, shared_types=frozenset()):
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
    tensor_file = path.stem.endswith("_tensor")
    text_lines = text.splitlines()  # unmasked: an include names its header in a "literal"
    for i in range(1, len(code.splitlines()) + 1):
        m = INCLUDE.match(text_lines[i - 1])
        if not m or m.group(1) != "<":
            continue
        header = m.group(2)
        if not header.startswith("metal_") and header not in SYSTEM_HEADERS:
            problems.append((i, f"#include <{header}>: only <metal_*> headers exist in MSL"))
        elif product and header in TENSOR_HEADERS and not tensor_file:
            problems.append((i, f"#include <{header}> outside a *_tensor.metal / *_tensor.h file: Metal 4 "
                                "tensor kernels live in their own libraries (compiled as MSL 4.0 only where "
                                "the GPU has tensors), so the other kernels build on every GPU from M1"))

    structural = without_preprocessor(code)
    toks = tokenize(structural)
    functions, statements = parse_scopes(toks)
    types = collect_types(structural, toks) | set(shared_types)
    spaces = address_space_macros(code)
    pos_found = []
    pos_found += check_address_spaces(toks, types, spaces)
    pos_found += check_program_scope(toks, statements, functions)
    pos_found += check_lambdas_and_function_pointers(toks, {f.name for f in functions})
    pos_found += check_threadgroup_in_helpers(toks, functions)
    pos_found += check_simdgroup_transpose(toks)
    pos_found += check_attributes(structural, tensor_file)
    if product:
        pos_found += check_buffer_order(toks, functions)
    for pos, cycle in recursion(toks, functions):
        pos_found.append((pos, f"recursion ({cycle}) is not supported by Metal"))
    problems += [(line_at(code, pos), msg) for pos, msg in pos_found]
    return [f"{path}:{line}: {msg}" for line, msg in sorted(set(problems))]


def main(argv):
    targets = [Path(a) for a in argv] or [ROOT / t for t in DEFAULT_TARGETS]
    files = []
    for t in targets:
        if t.is_dir():
            files += sorted(p for p in t.rglob("*") if p.suffix in (".metal", ".h"))
        elif t.is_file():
            files.append(t)
        else:
            print(f"lint_metal: {t} does not exist", file=sys.stderr)
            return 2
    # Types declared in the headers of metal/ (argument structs, cache policies) are known to
    # every file, as their #includes make them.
    shared = set()
    for h in sorted((ROOT / "metal").glob("*.h")):
        code = without_preprocessor(mask(h.read_text()))
        shared |= collect_types(code, tokenize(code))
    problems = [p for f in files for p in lint_file(f, shared)]
    for p in problems:
        print(p)
    print(f"lint_metal: {len(files)} files, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
