"""Every example runs as it is, on the demo model (the notebook's code cells in order)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["quickstart.py", "streaming.py", "chat.py", "tool_call.py"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_script_runs(name):
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip(), "the example printed nothing"


def test_notebook_cells_run_in_order():
    nb = json.loads((EXAMPLES / "notebook.ipynb").read_text())
    scope: dict = {}
    ran = 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"notebook cell {ran}", "exec"), scope)
            ran += 1
    assert ran >= 4
    assert scope["second"].cached_tokens > 0
