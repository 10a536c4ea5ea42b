"""Build step: the extension is compiled as a top-level `_core`; its generated stub is
installed as lily/_core.pyi, so references to `_core` become `lily._core`.

The extension's submodules (`msl_cpu`, `msl_cuda`: the GPU runtimes, and `kernel_args`, for tests) get no stub
files of their own (a stub package `lily/_core/` beside the extension would shadow nothing but
confuse tools), so the stub types each as a module whose attributes are untyped, instead of the
`from lily._core import msl_cpu as msl_cpu, ...` that nanobind writes and no stub resolves: a
type checker then meets no unresolved import.
"""

import re
import sys

src, dst = sys.argv[1], sys.argv[2]
text = open(src, encoding="utf-8").read().replace("from _core import", "from lily._core import")
submodules: list[str] = []


def _drop(m: re.Match) -> str:
    names = m.group(1) if m.group(1) is not None else m.group(2)
    submodules.extend(name.split(" as ")[0].strip() for name in names.split(",") if name.strip())
    return ""


# One line, or (from three submodules on) a parenthesized list over several lines.
text = re.sub(r"^from lily\._core import (?:\(([\w ,\n]+)\)|([\w ,]+))\n", _drop, text, flags=re.M)
if submodules:
    text = text.replace("\nimport numpy\n", "\nimport types\n\nimport numpy\n", 1)
    text = text.rstrip("\n") + "\n\n" + "".join(f"{name}: types.ModuleType\n" for name in submodules)
open(dst, "w", encoding="utf-8").write(text)
