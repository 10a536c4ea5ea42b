"""lily is a typed package: mypy --strict passes on examples/ and on calls whose result type
depends on ``stream=`` and ``n=`` (the overloads), using lily's own annotations (py.typed) and the
native module's stub, which must import nothing a type checker cannot resolve.

Reference: mypy itself (the `test` extra), run on the lily under test.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import lily

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(lily.__file__).resolve().parent


SNIPPET = '''
import lily

model = lily.Model.load()
result: lily.GenerationResult = model.generate("x", max_tokens=1)
stream: lily.GenerationStream = model.generate("x", max_tokens=1, stream=True)
choices: list[lily.GenerationResult] = model.generate("x", max_tokens=1, n=2)
chat = model.chat()
turn: lily.GenerationResult = chat.send("hi")
chunks: lily.GenerationStream = chat.send("hi", stream=True)
text: str = lily.generate(*lily.load(), "x")
'''


def _mypy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MYPY_FORCE_COLOR="0")
    # A source checkout (PYTHONPATH=src) is put on mypy's path; an installed lily is found in
    # site-packages already, and that folder on PYTHONPATH makes mypy treat every installed
    # module as the user's own ("This file shadows library module").
    if PACKAGE.parent.resolve() not in {Path(p).resolve() for p in site.getsitepackages()}:
        env["PYTHONPATH"] = str(PACKAGE.parent)
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(cwd / ".mypy"),
                           *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_package_is_marked_typed():
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_core.pyi").is_file()


def test_examples_and_overloads_pass_mypy_strict(tmp_path):
    (tmp_path / "overloads.py").write_text(SNIPPET)
    p = _mypy("--strict", str(ROOT / "examples"), str(tmp_path / "overloads.py"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_native_stub_resolves_every_import(tmp_path):
    # A copy outside the package: checked in place, mypy would take the folder above lily (site-
    # packages, for an installed lily) as a source root and report every module there as shadowing.
    stub = tmp_path / "lily_core_stub.pyi"
    stub.write_text((PACKAGE / "_core.pyi").read_text())
    p = _mypy("--follow-imports=silent", str(stub), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
