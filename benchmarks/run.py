#!/usr/bin/env python3
"""lily against llama.cpp (and mlx-lm, transformers) on the same weights: one command.

    python benchmarks/run.py                        # medium model, 2 threads, 128/512/4096
    python benchmarks/run.py --size tiny --engines lily
    python benchmarks/run.py --prompts 128,512 --reps 5 --json out.json --markdown out.md

What it does, in one session:
1. Makes (or reuses) the checkpoints of benchmarks/checkpoints.py: a random-weight Qwen3.5/3.6
   MoE of the real architecture (medium = the real 35B-A3B per-layer dims, 4 layers, vocab
   248,320) as HF bf16, MLX 4-bit (lily, mlx-lm) and GGUF Q4_0 / Q8_0 (llama.cpp, converted by
   llama.cpp's own converter); builds llama.cpp from the llama-cpp-python sdist if needed.
2. Measures the machine's read bandwidth (benchmarks/membw.c) at 1 and N threads.
3. For each repetition, for each prompt length, runs every engine once, the engine order
   rotating from one repetition to the next (so slow drifts of a shared machine fall on every
   engine alike). An engine measurement = prefill P random prompt tokens, then N greedy decode
   steps continuing that state (see benchmarks/engines.py for how each engine is timed).
4. Prints a Markdown table of medians: prefill and decode tokens/s, the ratio to llama.cpp Q4_0,
   and decode as a percentage of the bandwidth roofline (bytes per decode token from the
   checkpoint's own tensor sizes, benchmarks/roofline.py): against the session's best membw;
   "paired", each run against the bandwidth measured just before and after it; and "steady",
   lily's decode segments of 32 steps whose bandwidth before and after agree (the state of a
   shared VM held through them), each against that bandwidth. Where the session's bandwidth
   measurements fall into two states (a shared VM switching between ~35 and ~59 GB/s), a second
   table gives each state's runs apart: decode, its ratio to llama.cpp's runs in the same state,
   and lily's steady roofline over that state's segments.

Design choices:
- Same threads for all engines (`--threads`), one worker process per Python engine, loaded once
  and warmed once (one short untimed run: faults the mmapped weights in, as llama-bench's own
  warmup does for each of its runs).
- mlx-lm and transformers are slow on this CPU (mlx-lm's CPU matmuls are single-threaded, and
  4-bit with bf16 scales is slower still), so they run only for prompts up to
  `--slow-max-prompt` (default 512), with `--slow-reps` repetitions and `--slow-decode` steps;
  tokens/s stays comparable. Set `--engines` to leave any engine out.
- Medians of the per-run rates, and the load average before/after, so noise is visible: the
  machine may be shared, a table taken on a busy machine says so in its header.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402
import engines  # noqa: E402
import roofline  # noqa: E402

# "lily": Model.load's default mode (int8 where the CPU has the integer kernels); "lily f32": the
# reference mode; "lily int8" forces int8 (the same as "lily" on such CPUs, so not in the default set).
ALL_ENGINES = ("lily", "lily f32", "llama.cpp Q4_0", "llama.cpp Q8_0", "mlx-lm", "transformers")
KNOWN_ENGINES = (*ALL_ENGINES, "lily int8")
SLOW = {"mlx-lm", "transformers"}
ALIASES = {"llama-q4_0": "llama.cpp Q4_0", "llama-q8_0": "llama.cpp Q8_0", "q4_0": "llama.cpp Q4_0",
           "q8_0": "llama.cpp Q8_0", "mlx": "mlx-lm", "hf": "transformers"}
BASELINE = "llama.cpp Q4_0"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal")) / 2**20
    except (OSError, StopIteration):
        mem = float("nan")
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_GiB": round(mem, 1),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "lily_commit": commit}


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="medium", choices=("tiny", "medium"))
    ap.add_argument("--root", type=Path, default=ROOT / "build" / "bench",
                    help="where checkpoints are made and cached")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="128,512,4096", help="comma-separated prompt lengths")
    ap.add_argument("--decode", type=int, default=128, help="decode steps after the prompt")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ALL_ENGINES),
                    help=f"comma-separated subset of: {', '.join(KNOWN_ENGINES)} (default: all but lily int8)")
    ap.add_argument("--slow-max-prompt", type=int, default=512,
                    help="longest prompt mlx-lm / transformers run (0: never)")
    ap.add_argument("--slow-reps", type=int, default=1)
    ap.add_argument("--slow-decode", type=int, default=32)
    ap.add_argument("--no-bandwidth", action="store_true")
    ap.add_argument("--from-samples", type=Path,
                    help="no measuring: summarize the samples an earlier session wrote as it went "
                         "(JSON.samples.jsonl, e.g. of a run stopped before its table); bandwidth is "
                         "measured now")
    ap.add_argument("--json", type=Path, help="write all samples and medians here")
    ap.add_argument("--markdown", type=Path, help="write the table here too")
    a = ap.parse_args(argv)
    a.prompts = [int(p) for p in a.prompts.split(",") if p]
    names = [ALIASES.get(e.strip(), e.strip()) for e in a.engines.split(",") if e.strip()]
    bad = [e for e in names if e not in KNOWN_ENGINES]
    if bad:
        ap.error(f"unknown engine(s) {bad}; choose from {', '.join(KNOWN_ENGINES)}")
    a.engines = names
    return a


def start_engines(a, paths: dict) -> dict:
    """Engine name -> handle with .measure(p, n, seed), .info, .close()."""
    handles = {}
    for name in a.engines:
        if name.startswith("llama.cpp"):
            ty = name.split()[-1].lower()
            if ty not in paths:
                print(f"[run] skipping {name}: no GGUF for this size "
                      f"(its vocab cannot hold the Qwen3.5 tokenizer)", file=sys.stderr)
                continue
            import llamacpp

            handles[name] = engines.LlamaBench(name, llamacpp.tools().bench, paths[ty], a.threads)
        else:
            path = paths["hf"] if name == "transformers" else paths["mlx4"]
            print(f"[run] loading {name} from {path}", file=sys.stderr)
            handles[name] = engines.Worker(name, path, a.threads)
    return handles


def runs_for(a, name: str, p: int, rep: int) -> int | None:
    """Decode steps for this engine/prompt/rep, or None when the engine sits this one out."""
    if name in SLOW:
        if p > a.slow_max_prompt or rep >= a.slow_reps:
            return None
        return a.slow_decode
    return a.decode


def paired_bandwidth(a) -> float | None:
    """The read bandwidth now, at the run's threads (membw: 1 GiB, best of 5; ~0.3 s)."""
    return None if a.no_bandwidth else roofline.bandwidth_now(a.threads)


def measure_all(a, handles: dict) -> list[dict]:
    samples = []
    order = list(handles)
    for name in order:  # untimed warm-up, shortest prompt, few steps
        if isinstance(handles[name], engines.Worker):
            handles[name].measure(min(a.prompts), 4, seed=999)
    # The bandwidth between every two runs: a run's own roofline is the better of the
    # measurements just before and just after it (roofline.py says why).
    bw_before = paired_bandwidth(a)
    for rep in range(a.reps):
        rot = order[rep % len(order):] + order[:rep % len(order)]
        for p in a.prompts:
            for name in rot:
                n = runs_for(a, name, p, rep)
                if n is None:
                    continue
                t0 = time.time()
                # lily's worker brackets its decode steps with membw itself (prefill left out);
                # the other engines get the measurements taken between runs.
                bracket = (not a.no_bandwidth and isinstance(handles[name], engines.Worker)
                           and name.startswith("lily"))
                kw = {"membw": a.threads} if bracket else {}
                r = handles[name].measure(p, n, seed=rep * 100003 + p, **kw)
                bw_after = paired_bandwidth(a)
                s = {"engine": name, "prompt": p, "decode": n, "rep": rep, "load": loadavg()}
                if bw_after is not None:
                    s["bw_GBps"], s["bw_low_GBps"] = max(bw_before, bw_after), min(bw_before, bw_after)
                    bw_before = bw_after
                s.update(r)  # a bracketed run's own bw_GBps (and segments) replace the between-runs ones
                if "segments" in r:
                    s.pop("bw_low_GBps", None)
                if "error" not in r:
                    s["prefill_tps"] = p / r["prefill_s"]
                    s["decode_tps"] = n / r["decode_s"] if n else float("nan")
                    msg = f"prefill {s['prefill_tps']:8.1f} tok/s  decode {s['decode_tps']:6.2f} tok/s"
                else:
                    msg = "ERROR " + r["error"][:300]
                print(f"[run] rep {rep} P={p:5d} {name:15s} {msg}  ({time.time() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
                samples.append(s)
                if a.json:  # as we go: an interrupted session keeps what it measured
                    with open(a.json.with_suffix(".samples.jsonl"), "a") as f:
                        f.write(json.dumps(s) + "\n")
    return samples


# Two measurements around a decode segment "agree" within this fraction of the higher one.
STEADY = 0.10


def steady_segments(samples: list[dict]) -> tuple[list[tuple[int, float, float]], int]:
    """The decode segments (engines.LilyTimer.SEGMENT steps each) whose bandwidth measurements
    before and after agree within STEADY: the bandwidth state held through the segment, so the
    better of the two is the roofline it ran against. A segment whose brackets disagree ran
    across a switch, at a bandwidth nobody measured, and is left out (counted in the total).
    Returns [(steps, seconds, roofline GB/s)] and the number of segments."""
    out, total = [], 0
    for s in samples:
        for steps, sec, before, after in s.get("segments", []):
            total += 1
            if abs(before - after) <= STEADY * max(before, after):
                out.append((steps, sec, max(before, after)))
    return out, total


# Two bandwidth states (a shared VM's, e.g. ~35 and ~59 GB/s on the 2-core Zen 4) are told apart
# when the agreeing measurements of a session leave a gap of at least this ratio between them.
STATE_GAP = 1.25


def run_bandwidth(s: dict) -> tuple[float, float] | None:
    """(lowest, highest) of the measurements around a run's decode: every bracket of lily's
    segments, or the two taken between runs (samples before 2026-12-05 kept only the better of
    those: both are taken to be it). None: no measurement."""
    if s.get("segments"):
        bws = [b for seg in s["segments"] for b in seg[2:4]]
        return min(bws), max(bws)
    if s.get("bw_GBps"):
        return s.get("bw_low_GBps", s["bw_GBps"]), s["bw_GBps"]
    return None


def held_bandwidth(s: dict) -> float | None:
    """The bandwidth a run's decode held (the highest measurement around it, when all of them agree
    within STEADY); None when it crossed a switch or has no measurement."""
    r = run_bandwidth(s)
    return r[1] if r and r[0] >= (1 - STEADY) * r[1] else None


def state_threshold(samples: list[dict]) -> float | None:
    """The bandwidth (GB/s) between the session's two states, or None when it saw one: the
    measurements that agree within STEADY around a run or a segment, sorted, split at their
    widest gap when that gap is at least STATE_GAP (at the geometric mean of its two ends)."""
    held = [bw for s in samples if (bw := held_bandwidth(s))]
    held += [bw for _, _, bw in steady_segments(samples)[0]]
    held.sort()
    gaps = [(held[i + 1] / held[i], i) for i in range(len(held) - 1)]
    if not gaps or max(gaps)[0] < STATE_GAP:
        return None
    i = max(gaps)[1]
    return (held[i] * held[i + 1]) ** 0.5


def by_state(a, samples: list[dict], rows: list[dict], threshold: float) -> list[dict]:
    """Per prompt, state and engine: the median decode of the runs that stayed in that state
    throughout (every measurement around the decode within STEADY of the highest, on that side
    of the threshold), its ratio to llama.cpp Q4_0's in the same state, and lily's steady
    roofline over the segments of that state."""
    out = []
    for p in a.prompts:
        for state, side in (("low", lambda bw: bw < threshold), ("high", lambda bw: bw >= threshold)):
            block = []
            for name in a.engines:
                ok = [s for s in samples if s["engine"] == name and s["prompt"] == p and "error" not in s]
                held = [s for s in ok if (bw := held_bandwidth(s)) and side(bw)]
                bpt = next((r.get("bytes_per_token") for r in rows if r["prompt"] == p and r["engine"] == name), None)
                row = {"prompt": p, "state": state, "engine": name, "runs": f"{len(held)}/{len(ok)}",
                       "decode_tps": statistics.median(s["decode_tps"] for s in held) if held else None}
                steady = [x for x in steady_segments(ok)[0] if side(x[2])]
                if steady and bpt:
                    row["steady_roofline_pct"] = statistics.median(
                        100 * steps / sec * bpt / (bw * 1e9) for steps, sec, bw in steady)
                    row["steady_segments"] = str(len(steady))
                block.append(row)
            base = next((r for r in block if r["engine"] == BASELINE and r["decode_tps"]), None)
            for r in block:
                if base and r["decode_tps"]:
                    r["decode_vs_q4_0"] = r["decode_tps"] / base["decode_tps"]
            out += block
    return out


def summarize(a, samples: list[dict], paths: dict, bw: dict | None) -> list[dict]:
    rows = []
    for p in a.prompts:
        ctx = p + a.decode / 2
        bytes_lily = roofline.decode_bytes_mlx(paths["mlx4"], ctx)
        for name in a.engines:
            ok = [s for s in samples if s["engine"] == name and s["prompt"] == p and "error" not in s]
            if not ok:
                continue
            row = {"prompt": p, "engine": name, "n": len(ok),
                   "prefill_tps": statistics.median(s["prefill_tps"] for s in ok),
                   "decode_tps": statistics.median(s["decode_tps"] for s in ok)}
            if name.startswith("llama.cpp"):
                row["bytes_per_token"] = roofline.decode_bytes_gguf(
                    paths[name.split()[-1].lower()], paths["mlx4"], ctx)["per_token"]
            else:  # lily, mlx-lm: the MLX 4-bit bytes; transformers reads bf16 (not tallied)
                row["bytes_per_token"] = bytes_lily["per_token"] if name != "transformers" else None
            if bw and row["bytes_per_token"]:
                roof = bw["best_GBps"] * 1e9 / row["bytes_per_token"]
                row["roofline_tps"] = roof
                row["roofline_pct"] = 100 * row["decode_tps"] / roof
            paired = [s for s in ok if s.get("bw_GBps")]
            if paired and row["bytes_per_token"]:
                row["paired_roofline_pct"] = statistics.median(
                    100 * s["decode_tps"] * row["bytes_per_token"] / (s["bw_GBps"] * 1e9) for s in paired)
            steady, n_segments = steady_segments(ok)
            if steady and row["bytes_per_token"]:
                row["steady_roofline_pct"] = statistics.median(
                    100 * steps / sec * row["bytes_per_token"] / (bw * 1e9) for steps, sec, bw in steady)
                row["steady_segments"] = f"{len(steady)}/{n_segments}"
            rows.append(row)
        base = next((r for r in rows if r["prompt"] == p and r["engine"] == BASELINE), None)
        for r in rows:
            if r["prompt"] == p and base:
                r["prefill_vs_q4_0"] = r["prefill_tps"] / base["prefill_tps"]
                r["decode_vs_q4_0"] = r["decode_tps"] / base["decode_tps"]
    return rows


def fmt(v, spec):
    return "–" if v is None else format(v, spec)


def markdown(a, rows, info, bw, infos, cmd, states: tuple[float, list[dict]] | None = None) -> str:
    m = info["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores visible, {m['memory_GiB']} GiB; {m['os']}; "
        f"lily {m['lily_commit']}; {info['date']}.",
        f"Model: {a.size} (random weights, qwen3_5_moe). Threads: {a.threads}. Decode: "
        f"{a.decode} steps after the prompt ({a.slow_decode} for mlx-lm / transformers). "
        f"Repetitions: {a.reps} ({a.slow_reps} for mlx-lm / transformers); medians.",
    ]
    if bw:
        lines.append("Read bandwidth (membw: best of 10 passes before and after, or of any paired "
                     "measurement): " + ", ".join(
            f"{b['threads']} thread{'s' if b['threads'] > 1 else ''} {b['best_GBps']:.1f} GB/s"
            for b in bw.values()) + ". Roofline = bandwidth at the run's threads / decode bytes "
            "per token; \"paired\": each run against the better of two membw measurements (1 GiB, "
            "best of 5) taken just before and just after it, median over runs; \"steady\": lily's "
            "decode in segments of 32 steps with a measurement after each, every segment whose two "
            "measurements agree within 10% against the better of them, median over those segments "
            "(kept / all).")
    lines.append(f"Load average (1 min) before/after: {info['load_before']:.1f} / "
                 f"{info['load_after']:.1f}.")
    lines.append("Engines: " + "; ".join(f"{k}: {v}" for k, v in infos.items()) + ".")
    lines.append(f"Command: `{cmd}`")
    lines += ["", "| prompt | engine | prefill tok/s | decode tok/s | prefill × Q4_0 | "
              "decode × Q4_0 | decode MB/token | decode % roofline | decode % paired roofline | "
              "decode % steady roofline (segments) | runs |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bpt = r.get("bytes_per_token")
        lines.append(
            f"| {r['prompt']} | {r['engine']} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
            f"{fmt(r.get('prefill_vs_q4_0'), '.2f')} | {fmt(r.get('decode_vs_q4_0'), '.2f')} | "
            f"{fmt(bpt and bpt / 1e6, '.0f')} | {fmt(r.get('roofline_pct'), '.0f')} | "
            f"{fmt(r.get('paired_roofline_pct'), '.0f')} | {fmt(r.get('steady_roofline_pct'), '.0f')}"
            f"{' (' + r['steady_segments'] + ')' if 'steady_segments' in r else ''} | {r['n']} |")
    if states:
        threshold, srows = states
        lines += ["", f"By bandwidth state: the session's measurements fell into two states, split at "
                  f"{threshold:.1f} GB/s. A run counts in a state when every measurement around its "
                  "decode agrees within 10% and lies on that side; runs that crossed a switch are "
                  "left out (runs: kept / all). Ratios are between engines' runs in the same state.",
                  "", "| prompt | state | engine | decode tok/s | decode × Q4_0 | "
                  "decode % steady roofline (segments) | runs |", "|---:|---|---|---:|---:|---:|---:|"]
        for r in srows:
            lines.append(
                f"| {r['prompt']} | {r['state']} | {r['engine']} | {fmt(r['decode_tps'], '.2f')} | "
                f"{fmt(r.get('decode_vs_q4_0'), '.2f')} | {fmt(r.get('steady_roofline_pct'), '.0f')}"
                f"{' (' + r['steady_segments'] + ')' if 'steady_segments' in r else ''} | {r['runs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    cmd = "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = {"machine": machine(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    want_gguf = any(e.startswith("llama.cpp") for e in a.engines)
    paths = checkpoints.ensure(a.size, a.root, gguf=want_gguf)
    info["load_before"] = loadavg()
    bw = None
    if not a.no_bandwidth:
        bw = {t: roofline.bandwidth(t) for t in sorted({1, a.threads})}
        print("[run] bandwidth: " + ", ".join(f"{t}T {b['best_GBps']:.1f} GB/s"
                                              for t, b in bw.items()), file=sys.stderr)
    if a.from_samples:
        samples = [json.loads(line) for line in a.from_samples.read_text().splitlines() if line.strip()]
        infos = {name: f"(samples from {a.from_samples.name})" for name in a.engines}
        cmd += "  # the table of an earlier session's samples"
    else:
        handles = start_engines(a, paths)
        try:
            samples = measure_all(a, handles)
        finally:
            for h in handles.values():
                h.close()
        infos = {k: h.info for k, h in handles.items()}
    if not a.no_bandwidth:  # again after: keep the better (less disturbed) measurement
        for t in bw:
            b = roofline.bandwidth(t)
            if b["best_GBps"] > bw[t]["best_GBps"]:
                bw[t] = b
    info["load_after"] = loadavg()
    if bw:  # the session's best: the paired measurements count too (a harder roofline)
        paired = [s["bw_GBps"] for s in samples if s.get("bw_GBps")]
        if paired and max(paired) > bw[a.threads]["best_GBps"]:
            bw[a.threads] = {**bw[a.threads], "best_GBps": max(paired), "from": "paired"}
    rows = summarize(a, samples, paths, bw[a.threads] if bw else None)
    threshold = state_threshold(samples)
    states = (threshold, by_state(a, samples, rows, threshold)) if threshold else None
    table = markdown(a, rows, info, bw, infos, cmd, states)
    print(table)
    if a.markdown:
        a.markdown.write_text(table)
    if a.json:
        a.json.write_text(json.dumps({"info": info, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                             for k, v in vars(a).items()},
                                      "bandwidth": bw, "engines": infos, "samples": samples,
                                      "rows": rows, "state_threshold_GBps": threshold,
                                      "rows_by_state": states[1] if states else []}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
