#!/usr/bin/env python3
"""lily's decode as a share of the read bandwidth given in the same minutes: decode steps
alternating with single membw passes.

    python benchmarks/interleaved_roofline.py                    # medium model, 2 threads
    python benchmarks/interleaved_roofline.py --prompt 4096 --runs 5 --json out.json

run.py's rooflines set a decode's bytes/s against the best of a few short membw passes taken
around it. On a shared VM whose bandwidth moves from pass to pass (the 2-core Xeon VM: 27-33
GB/s within a minute) that best is an upper envelope, which no stream of seconds holds, and the
decode's share of it reads low. Here membw stays running (its "serve" mode, one setup) and reads
its buffer once after every LilyTimer.INTERLEAVE decode steps, plain and prefetched reads in
turn, so the passes sample the same minutes as the decode; the roofline is the better mode's
mean over its passes (roofline.interleaved_share). Each run prints both percentages: of that
mean, and of the best single pass (run.py's kind of ceiling).

What it does not measure: llama.cpp (llama-bench runs its own loop), prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402
import engines  # noqa: E402
import roofline  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium", choices=("tiny", "medium"))
    ap.add_argument("--root", type=Path, default=HERE.parent / "build" / "bench",
                    help="where benchmarks/checkpoints.py keeps the checkpoints")
    ap.add_argument("--model", type=Path, help="an MLX checkpoint folder instead of --size's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=200, help="decode steps per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    model = a.model or checkpoints.ensure(a.size, a.root, gguf=False)["mlx4"]
    timer = engines.LilyTimer(str(model), a.threads)
    print(f"[interleaved] {timer.info}", file=sys.stderr)
    bpt = roofline.decode_bytes_mlx(model, a.prompt + a.decode / 2)["per_token"]
    timer.measure(min(a.prompt, 64), 4, seed=999)  # untimed warm-up, as run.py's
    runs = []
    with roofline.MembwServer(a.threads) as server:
        for i in range(a.runs):
            r = timer.measure(a.prompt, a.decode, seed=i, interleave=server)
            share = roofline.interleaved_share(r["rounds"], bpt)
            runs.append({**share, "decode_tps": a.decode / r["decode_s"], "rounds": r["rounds"]})
            print(f"run {i}: decode {runs[-1]['decode_tps']:.1f} tok/s = {share['decode_GBps']:.2f} GB/s; "
                  f"membw over {share['passes']} passes between its steps: mean {share['membw_mean_GBps']:.2f}, "
                  f"best {share['membw_best_pass_GBps']:.2f} GB/s -> {share['pct_of_mean']:.1f}% of the mean, "
                  f"{share['pct_of_best_pass']:.1f}% of the best pass")
    print(f"median of {a.runs} runs: {statistics.median(r['pct_of_mean'] for r in runs):.1f}% of the interleaved "
          f"mean, {statistics.median(r['pct_of_best_pass'] for r in runs):.1f}% of the best pass "
          f"({bpt / 1e6:.0f} MB per token, {a.threads} threads, prompt {a.prompt})")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "engine": timer.info,
                                      "bytes_per_token": bpt, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
