"""The CPU backend's thread pool (csrc/cpu/thread_pool.cpp) under stress, natively.

tests/native/thread_pool_stress.cpp makes back-to-back parallel_for calls of varying sizes on a
pool with more threads than this machine has cores, so the OS preempts workers anywhere,
including between a late worker's reading of one call's ticket and the next call's job. It
checks that every index of every call runs exactly once; a lost or double-counted chunk shows
as a wrong count or as a hang (the timeout).

The pool once hung here: a worker holding call k's ticket read call k+1's chunk count (the
caller rewrites the job fields before publishing the next ticket), claimed a chunk past call
k's end, and left call k+1's completion count one too high. With the old pool the 8-thread
stress below hung within seconds, and ThreadSanitizer reported the race on the count; the
ticket now carries the count itself. The second test keeps ThreadSanitizer on the pool.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "native" / "thread_pool_stress.cpp"
POOL = ROOT / "csrc" / "cpu" / "thread_pool.cpp"


def _compiler() -> str:
    for cxx in ("c++", "g++", "clang++-19", "clang++"):
        if shutil.which(cxx):
            return cxx
    raise AssertionError("no C++ compiler on PATH (install g++ or clang-19: scripts/test.sh does)")


def _build(tmp_path: Path, name: str, flags: list[str]) -> Path:
    exe = tmp_path / name
    cmd = [_compiler(), "-std=c++17", "-pthread", *flags, f"-I{ROOT / 'csrc'}", str(DRIVER), str(POOL),
           "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"building the stress driver failed: {' '.join(cmd)}\n{r.stderr[-3000:]}"
    return exe


def _run(exe: Path, threads: int, calls: int, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(exe), str(threads), str(calls)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{threads}-thread pool hung: {calls} parallel_for calls did not finish in {timeout:.0f} s")


@pytest.mark.parametrize("threads", [2, 8])
def test_every_chunk_runs_once_under_preemption(tmp_path, threads):
    exe = _build(tmp_path, "stress", ["-O2"])
    r = _run(exe, threads, 100_000, timeout=90)
    assert r.returncode == 0 and r.stdout.strip() == "ok 100000", r.stdout + r.stderr


def test_thread_sanitizer_finds_no_race(tmp_path):
    exe = _build(tmp_path, "stress_tsan", ["-O1", "-g", "-fsanitize=thread"])
    r = _run(exe, 4, 10_000, timeout=120)
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0 and r.stdout.strip() == "ok 10000", r.stdout + r.stderr[-2000:]
