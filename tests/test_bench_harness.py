"""benchmarks/run.py's steady roofline: lily's decode timed in segments with a bandwidth
measurement between every two, and only the segments whose two measurements agree kept.

On the 2-core VM the read bandwidth switches between two states (~50 and ~82 GB/s) within
seconds; a decode bracketed by one measurement of each cannot say which it ran in. Asserted:
the segments cover every decode step exactly once, in order, with each measurement shared by the
segments on either side of it, and their time is the decode time; steady_segments keeps the
segments whose brackets agree within 10% (against the better of the two) and counts the rest.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/engines.py and run.py, imported with sys.path as they expect, and sys.path
    restored afterwards (LilyTimer puts the checkout's src/ first; other tests' child processes
    take their PYTHONPATH from sys.path)."""
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    return importlib.import_module("engines"), importlib.import_module("run")


def test_steady_segments_keep_agreeing_brackets(bench):
    _, run = bench
    samples = [
        {"segments": [[32, 0.2, 50.0, 52.0], [32, 0.3, 52.0, 82.0], [32, 0.25, 82.0, 80.0]]},
        {"segments": [[16, 0.1, 80.0, 72.5]]},  # 9.4% apart: kept
        {"decode_s": 1.0},  # another engine's run: no segments
    ]
    kept, total = run.steady_segments(samples)
    assert total == 4
    assert kept == [(32, 0.2, 52.0), (32, 0.25, 82.0), (16, 0.1, 80.0)]


def test_lily_decode_is_timed_in_bracketed_segments(bench, monkeypatch):
    engines, _ = bench
    readings = iter([50.0, 51.0, 83.0, 82.0, 49.0, 50.0])
    calls = []

    def fake_bandwidth(threads):
        calls.append(threads)
        return next(readings)

    monkeypatch.setattr(engines.roofline, "bandwidth_now", fake_bandwidth)
    timer = engines.LilyTimer(None, threads=1)  # the embedded demo model
    n = 2 * engines.LilyTimer.SEGMENT + 5
    r = timer.measure(8, n, seed=1, membw=2)
    segs = r["segments"]
    assert [s[0] for s in segs] == [engines.LilyTimer.SEGMENT, engines.LilyTimer.SEGMENT, 5]
    assert [(s[2], s[3]) for s in segs] == [(50.0, 51.0), (51.0, 83.0), (83.0, 82.0)]
    assert calls == [2, 2, 2, 2]
    assert r["bw_GBps"] == 83.0
    assert sum(s[1] for s in segs) == pytest.approx(r["decode_s"])
    # Without membw: one timed loop, no measurements.
    r = timer.measure(8, 6, seed=1)
    assert "segments" not in r and "bw_GBps" not in r and r["decode_s"] > 0
