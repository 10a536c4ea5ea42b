"""The docs run: every fenced Python and shell block in README.md and docs/ is classed in the
docs source by an HTML comment on the line before it, and is run or parsed accordingly:

    <!-- doc: run -->                   run (Python blocks of one page share one namespace, in order;
                                        each shell block runs on its own; both from the repository
                                        root, seen through a scratch directory of links)
    <!-- doc: parse: REASON -->         checked for syntax only (installs, servers, the test command)
    <!-- doc: skip: REASON -->          not checked, for a named reason (a hub model, a Mac, the H200)

Every fenced block names its language; blocks in other languages (text, metal, json, ...) are
not code to run. References: Python's own parser and `bash -n`, and the blocks' exit status.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import lily

ROOT = Path(__file__).resolve().parents[1]
LILY_PARENT = str(Path(lily.__file__).resolve().parent.parent)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)\s*$")
MARK = re.compile(r"^<!--\s*doc:\s*(run|parse|skip)\s*(?::\s*(.*?))?\s*-->$")
LANGUAGES = {"python": "python", "py": "python", "pycon": "python", "bash": "shell", "sh": "shell",
             "shell": "shell", "console": "shell"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str  # "python", "shell" or the fence's own tag
    kind: str | None  # run | parse | skip, None when unmarked
    reason: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        fence, tag = m.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(prev)
        out.append(Block(page, i + 1, LANGUAGES.get(tag.lower(), tag.lower()), mark.group(1) if mark else None,
                         (mark.group(2) or None) if mark else None, "\n".join(lines[i + 1:end])))
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
CODE = [b for b in ALL if b.language in ("python", "shell")]


def _workdir(tmp_path: Path) -> Path:
    """A scratch copy of the repository root (links to its entries), so blocks find examples/,
    scripts/, ... by their documented relative paths while what they write stays in tmp."""
    work = tmp_path / "repo"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (work / entry.name).symlink_to(entry)
    return work


def _env(tmp_path: Path) -> dict[str, str]:
    """`lily` and `python` on PATH run the lily under test (site-packages in CI, src/ in a dev tree)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "lily").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m lily "$@"\n')
    (bin_dir / "lily").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    pythonpath = os.pathsep.join(p for p in (LILY_PARENT, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=pythonpath)


def test_every_code_block_is_classed():
    problems = []
    for b in ALL:
        if not b.language:
            problems.append(f"{b.where}: a fenced block without a language (use text for plain listings)")
        elif b.language in ("python", "shell") and b.kind is None:
            problems.append(f"{b.where}: a {b.language} block without <!-- doc: run|parse|skip: REASON -->")
        elif b.kind == "skip" and not b.reason:
            problems.append(f"{b.where}: skipped without a reason")
    assert not problems, "\n".join(problems)
    assert sum(b.kind == "run" for b in CODE) >= 10  # the docs mostly run


@pytest.mark.parametrize("block", [b for b in CODE if b.kind == "parse"], ids=lambda b: b.where)
def test_parse_only_blocks_parse(block):
    if block.language == "python":
        ast.parse(block.code, block.where)
    else:
        p = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert p.returncode == 0, f"{block.where}: {p.stderr}"


RUNNER = """
import sys
scope = {"__name__": "__main__"}
for where, code in BLOCKS:
    try:
        exec(compile(code, where, "exec"), scope)
    except BaseException as e:
        print(f"{where}: {type(e).__name__}: {e}", file=sys.stderr)
        raise
"""


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.kind == "run" and b.language == "python"
                                                             for b in blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page, tmp_path):
    runnable = [(b.where, b.code) for b in blocks(page) if b.kind == "run" and b.language == "python"]
    p = subprocess.run([sys.executable, "-c", f"BLOCKS = {runnable!r}\n" + RUNNER], capture_output=True,
                       text=True, cwd=_workdir(tmp_path), env=_env(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.parametrize("block", [b for b in CODE if b.kind == "run" and b.language == "shell"],
                         ids=lambda b: b.where)
def test_shell_blocks_run(block, tmp_path):
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], capture_output=True, text=True,
                       cwd=_workdir(tmp_path), env=_env(tmp_path), timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{block.where}:\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}"


# -- statements the docs once got wrong ----------------------------------------------------------

TEXT_FILES = [*PAGES, *ROOT.glob("examples/**/*.py"), *ROOT.glob("src/lily/**/*.py"), ROOT / "examples" / "notebook.ipynb"]


def test_one_hub_id_for_the_35b_model():
    ids = set()
    for f in TEXT_FILES:
        ids |= set(re.findall(r"[\w.-]+/Qwen3\.6-35B-A3B[\w.-]*", f.read_text(encoding="utf-8")))
    ids.discard("to/Qwen3.6-35B-A3B")  # "path/to/Qwen3.6-35B-A3B", a local folder
    assert ids == {"mlx-community/Qwen3.6-35B-A3B-4bit"}


def test_auto_backend_is_described_as_what_it_does():
    if not lily._core.has_metal:
        assert lily.Model.load()._engine.backend == "cpu"  # no Metal in this build: "auto" is the CPU
    # "auto" takes Metal once its known-answer check passed (lily/backend_choice.py).
    stale = ["is not built yet", "Metal where it exists", "CPU everywhere today", "the CPU today", '"auto"` today',
             '"auto" today']
    for f in [*PAGES, ROOT / "src" / "lily" / "model.py", ROOT / "src" / "lily" / "cli.py"]:
        text = f.read_text(encoding="utf-8")
        for phrase in stale:
            assert phrase not in text, f"{f.relative_to(ROOT)} says {phrase!r}"
    index = (ROOT / "docs" / "index.md").read_text()
    assert "known-answer check against the CPU backend" in index


def test_user_guide_lists_every_example():
    section = (ROOT / "docs" / "index.md").read_text().split("## Examples", 1)[1]
    for entry in sorted((ROOT / "examples").iterdir()):
        if entry.name.startswith((".", "__")):
            continue
        assert f"`{entry.name}" in section, f"docs/index.md's examples list misses {entry.name}"
