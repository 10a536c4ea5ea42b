"""benchmarks/run.py's steady roofline: lily's decode timed in segments with a bandwidth
measurement between every two, and only the segments whose two measurements agree kept.

On the 2-core VM the read bandwidth switches between two states (~50 and ~82 GB/s) within
seconds; a decode bracketed by one measurement of each cannot say which it ran in. Asserted:
the segments cover every decode step exactly once, in order, with each measurement shared by the
segments on either side of it, and their time is the decode time; steady_segments keeps the
segments whose brackets agree within 10% (against the better of the two) and counts the rest;
and where the measurements fall into two states, each run is counted in the state it stayed in
(none if it crossed a switch) and ratios pair runs of one state.

benchmarks/interleaved_roofline.py's measurement too: membw's serve mode reads its buffer once
per request and refuses a request it does not know; the decode alternates with those passes,
covering every step once; and the share is the decode's bytes/s over the better read mode's
mean (bytes over seconds of its passes), as worked by hand below.
"""

from __future__ import annotations

import importlib
import subprocess
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


def test_bandwidth_states_split_runs_and_ratios(bench):
    """Two bandwidth states (a shared VM's ~35 and ~59 GB/s) are found at the widest gap of the
    held measurements; each run counts in the state it stayed in, a run across a switch in
    neither, and ratios pair runs of one state."""
    _, run = bench
    lily = "lily"

    def lily_run(rep, tps, brackets):
        segs = [[32, 32 / tps, a, b] for a, b in zip(brackets[:-1], brackets[1:], strict=True)]
        return {"engine": lily, "prompt": 512, "rep": rep, "decode_tps": tps, "segments": segs,
                "bw_GBps": max(brackets)}

    def llama_run(rep, tps, lo, hi):
        return {"engine": run.BASELINE, "prompt": 512, "rep": rep, "decode_tps": tps, "bw_GBps": hi, "bw_low_GBps": lo}

    samples = [
        lily_run(0, 110.0, [58.0, 59.0, 57.5]), llama_run(0, 46.0, 57.0, 59.0),
        lily_run(1, 66.0, [35.0, 35.5, 36.0]), llama_run(1, 44.0, 35.5, 36.0),
        lily_run(2, 90.0, [35.0, 58.0, 58.5]),  # crossed a switch: in neither state
        llama_run(2, 45.0, 36.0, 58.0),         # likewise
    ]
    threshold = run.state_threshold(samples)
    assert 36.0 < threshold < 57.0
    # One state (10% noise, no gap of 25%): no split.
    assert run.state_threshold([lily_run(0, 100.0, [50.0, 54.0, 52.0]), llama_run(0, 45.0, 51.0, 55.0)]) is None

    class A:
        prompts, engines = [512], [lily, run.BASELINE]

    rows = [{"prompt": 512, "engine": lily, "bytes_per_token": 433e6},
            {"prompt": 512, "engine": run.BASELINE, "bytes_per_token": 570e6}]
    got = {(r["state"], r["engine"]): r for r in run.by_state(A, samples, rows, threshold)}
    assert got["low", lily]["decode_tps"] == 66.0 and got["low", lily]["runs"] == "1/3"
    assert got["high", lily]["decode_tps"] == 110.0
    assert got["low", lily]["decode_vs_q4_0"] == 66.0 / 44.0
    assert got["high", lily]["decode_vs_q4_0"] == 110.0 / 46.0
    assert got["high", run.BASELINE]["runs"] == "1/3"
    # lily's steady roofline per state: its segments of that state, run 2's included.
    low_pct = 100 * 66.0 * 433e6 / (35.5e9), 100 * 66.0 * 433e6 / (36.0e9)
    assert got["low", lily]["steady_segments"] == "2"
    assert got["low", lily]["steady_roofline_pct"] == (low_pct[0] + low_pct[1]) / 2
    assert got["high", lily]["steady_segments"] == "3"  # run 0's two and run 2's 58.0 -> 58.5


def test_membw_serve_reads_once_per_request(bench):
    engines, _ = bench
    roofline = engines.roofline
    with roofline.MembwServer(2, mib=64, source="anon") as server:
        got = [server.read(m) for m in ("plain", "prefetch", "plain")]
    assert [b for _, b in got] == [64 << 20] * 3
    assert all(0 < sec < 10 for sec, _ in got)
    assert server.proc.returncode == 0
    # An unknown request: a named refusal and a failing exit, not a pass.
    r = subprocess.run([str(roofline.membw_binary()), "1", "8", "serve"], input="fast\n", capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and 'expected "plain" or "prefetch", got fast' in r.stderr
    assert "seconds=" not in r.stdout


def test_lily_decode_alternates_with_membw_passes(bench):
    engines, _ = bench

    class FakeServer:
        MODES = ("plain", "prefetch")

        def __init__(self):
            self.asked = []

        def read(self, mode):
            self.asked.append(mode)
            return 0.01 * len(self.asked), 1000

    server = FakeServer()
    timer = engines.LilyTimer(None, threads=1)  # the embedded demo model
    n = 2 * engines.LilyTimer.INTERLEAVE + 3
    r = timer.measure(8, n, seed=1, interleave=server)
    rounds = r["rounds"]
    assert [x[0] for x in rounds] == [engines.LilyTimer.INTERLEAVE] * 2 + [3]
    assert [x[2] for x in rounds] == server.asked == ["plain", "prefetch", "plain"]
    assert [x[3:] for x in rounds] == [[0.01, 1000], [0.02, 1000], [0.03, 1000]]
    assert sum(x[1] for x in rounds) == pytest.approx(r["decode_s"])
    assert "segments" not in r and "bw_GBps" not in r
    with pytest.raises(ValueError, match="not both"):
        timer.measure(8, 2, seed=1, membw=1, interleave=server)


def test_interleaved_share_takes_the_better_modes_mean(bench):
    engines, _ = bench
    rounds = [
        [5, 0.10, "plain", 0.10, 3e9],     # 30 GB/s
        [5, 0.12, "prefetch", 0.12, 3e9],  # 25
        [5, 0.08, "plain", 0.05, 1.6e9],   # 32 (the best pass)
        [5, 0.10, "prefetch", 0.10, 2.6e9],
    ]
    share = engines.roofline.interleaved_share(rounds, bytes_per_token=400e6)
    decode = 20 * 400e6 / 0.40 / 1e9  # 20 GB/s
    plain = 4.6e9 / 0.15 / 1e9         # 30.67: the plain passes' bytes over their seconds
    assert share["decode_GBps"] == pytest.approx(decode)
    assert share["membw_mean_GBps"] == pytest.approx(plain)  # prefetch's mean is 5.6 / 0.22 = 25.5
    assert share["membw_best_pass_GBps"] == pytest.approx(32.0)
    assert share["pct_of_mean"] == pytest.approx(100 * decode / plain)
    assert share["pct_of_best_pass"] == pytest.approx(100 * decode / 32.0)
    assert (share["passes"], share["steps"]) == (4, 20)
