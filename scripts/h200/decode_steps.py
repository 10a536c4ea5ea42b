"""Decode tokens/s of the CPU backend's default mode at one thread count: a short prompt, a few
warm-up steps (the first touch of every weight page), then --steps timed decode steps of one
session. Phase L's probe (scripts/h200/phase_l.sh): what one build of the int8 row kernels
streams on this host, without the prefill a side-by-side run spends its minutes on.

    PYTHONPATH=src python3 scripts/h200/decode_steps.py CKPT --threads 16 [--steps 32] [--ready FILE]

--ready FILE: the file is written once the warm-up steps are done, so that a profiler started
when it appears (phase Q, scripts/h200/phase_q.sh) samples the timed decode steps only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import lily


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--ready", type=Path, default=None)
    a = ap.parse_args(argv)
    t_load = time.perf_counter()
    model = lily.Model.load(a.ckpt, threads=a.threads)
    load_s = time.perf_counter() - t_load
    s = model.session()
    logits = s.prefill(np.random.default_rng(0).integers(0, model.config.vocab_size, a.prompt).tolist())
    for _ in range(a.warmup):
        logits = s.decode(int(np.argmax(logits)))
    if a.ready is not None:
        a.ready.write_text("warm\n")
    t0 = time.perf_counter()
    for _ in range(a.steps):
        logits = s.decode(int(np.argmax(logits)))
    dt = time.perf_counter() - t0
    print(json.dumps({"threads": a.threads, "cpu_matmul": model._engine.cpu_matmul, "steps": a.steps,
                      "tok_s": round(a.steps / dt, 2), "context": a.prompt + a.warmup + a.steps,
                      "load_s": round(load_s, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
