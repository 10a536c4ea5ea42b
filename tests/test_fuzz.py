"""Short runs of every fuzz target (tests/fuzz/): each runs from its seed corpus for a few
seconds and must finish without a crash, having executed a real number of inputs. Long runs
and their figures are in docs/reliability.md; `tests/fuzz/run.sh TARGET SECONDS` runs one.

Native targets need clang-19 with libFuzzer (libclang-rt-19-dev); Python targets need atheris.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "fuzz" / "run.sh"

# target -> (seconds, minimum executions expected in that time on a loaded 2-core machine)
TARGETS = {
    "safetensors": (15, 100),
    "json": (10, 1000),
    "config": (10, 100),
    "tokenizer": (10, 50),
    "template": (10, 100),
    "server": (10, 100),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_target_short_run(target):
    seconds, min_execs = TARGETS[target]
    art = ROOT / "build" / "fuzz" / "artifacts" / target
    before = set(art.glob("*")) if art.is_dir() else set()
    proc = subprocess.run([str(RUN), target, str(seconds)], capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    new = sorted(set(art.glob("*")) - before) if art.is_dir() else []
    assert proc.returncode == 0 and not new, f"{target}: exit {proc.returncode}, new artifacts {new}\n{out[-4000:]}"
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    assert m, f"{target}: no libFuzzer stats in the output\n{out[-2000:]}"
    assert int(m.group(1)) >= min_execs, f"{target}: only {m.group(1)} executions in {seconds} s"
