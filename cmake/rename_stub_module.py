"""Build step: the extension is compiled as a top-level `_core`; its generated stub is
installed as lily/_core.pyi, so references to `_core` become `lily._core`.

The submodule `msl_cpu` (the MSL-on-CPU runtime, for tests) gets no stub file of its own (a
stub package `lily/_core/` beside the extension would shadow nothing but confuse tools), so
the stub types it as a module whose attributes are untyped, rather than importing a
`lily._core.msl_cpu` that no stub defines: a type checker then sees no unresolved import.
"""

import sys

src, dst = sys.argv[1], sys.argv[2]
text = open(src, encoding="utf-8").read().replace("from _core import", "from lily._core import")
submodule = "from lily._core import msl_cpu as msl_cpu\n"
if submodule in text:
    text = text.replace(submodule, "")
    text = text.replace("\nimport numpy\n", "\nimport types\n\nimport numpy\n", 1)
    text = text.rstrip("\n") + "\n\nmsl_cpu: types.ModuleType\n"
open(dst, "w", encoding="utf-8").write(text)
