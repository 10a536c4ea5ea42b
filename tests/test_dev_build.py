"""scripts/dev_build.sh survives switching virtual environments: each interpreter gets its own
build folder, configured for that interpreter (CMake caches the Python it found, and a stale
cache would build the extension for the old one). Only the configure step runs here (seconds);
the build itself is what every developer runs.

Reference: CMake's own cache (CMakeCache.txt) and the interpreters' sys.prefix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _configure(python: str, build_root: Path) -> Path:
    env = dict(os.environ, PYTHON=python, LILY_BUILD_ROOT=str(build_root))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "dev_build.sh"), "--configure-only"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (folder,) = [d for d in build_root.iterdir() if (d / "CMakeCache.txt").is_file()
                 and python_of(d) == _executable(python)]
    return folder


def _executable(python: str) -> str:
    return subprocess.run([python, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                          check=True).stdout.strip()


def python_of(build: Path) -> str:
    for line in (build / "CMakeCache.txt").read_text().splitlines():
        if line.startswith("Python_EXECUTABLE:"):
            return line.split("=", 1)[1]
    raise AssertionError(f"{build} has no Python_EXECUTABLE")


def test_each_virtual_environment_gets_its_own_configured_build(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    other = str(venv / "bin" / "python")
    builds = tmp_path / "build"
    first = _configure(sys.executable, builds)
    second = _configure(other, builds)  # the "switched" environment
    assert first != second
    assert python_of(first) == _executable(sys.executable)
    assert python_of(second) == _executable(other)
    again = _configure(sys.executable, builds)  # switching back reuses the first folder
    assert again == first and python_of(first) == _executable(sys.executable)
