"""Build step: the extension is compiled as a top-level `_core`; its generated stub is
installed as lily/_core.pyi, so references to `_core` become `lily._core`."""

import sys

src, dst = sys.argv[1], sys.argv[2]
text = open(src, encoding="utf-8").read().replace("from _core import", "from lily._core import")
open(dst, "w", encoding="utf-8").write(text)
