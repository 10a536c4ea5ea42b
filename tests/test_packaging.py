"""What a new user installs: the distribution's name (the PyPI name `lily` belongs to an
unrelated project, so no page may tell anyone to `pip install lily`), and the pinned versions a
fresh machine's test command installs (scripts/constraints.txt).

References: pyproject.toml, the installed packages' own metadata (importlib.metadata).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# `pip install lily`, `pip install "lily[server]"`, `lily[server]` anywhere: all name the
# unrelated PyPI project. `pip install .` / `".[server]"` (a checkout) are what we say.
FORBIDDEN = [
    re.compile(r"pip3?\s+install\s+(-\S+\s+)*[\"']?lily(?![\w.-])"),
    re.compile(r"(?<![\w.\-/])lily\[\w[\w,]*\]"),
]


def _user_facing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/*"),
             *ROOT.glob("src/lily/**/*.py"), *ROOT.glob("scripts/**/*.sh"), *ROOT.glob("scripts/**/*.py"),
             *ROOT.glob("benchmarks/**/*.md")]
    return [f for f in files if f.is_file() and f.suffix in (".md", ".py", ".sh", ".toml", ".ipynb")]


def test_distribution_has_a_name_we_own():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "lily-llm"
    assert project["scripts"]["lily"] == "lily.cli:main"


def test_no_page_tells_users_to_install_the_unrelated_lily():
    hits = []
    for f in _user_facing_files():
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(p.search(line) for p in FORBIDDEN):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_constraints_pin_every_package_ci_installs():
    spec = importlib.util.spec_from_file_location("update_constraints", ROOT / "scripts" / "update_constraints.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    needed = mod.closure()  # from pyproject.toml and the installed packages' metadata
    pinned = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name] = version
    assert not set(needed) - set(pinned), f"not pinned: {sorted(set(needed) - set(pinned))}"
    assert needed["torch"] == pinned["torch"] == "2.13.0"
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert '-c scripts/constraints.txt ".[test,server,structured]"' in test_sh
