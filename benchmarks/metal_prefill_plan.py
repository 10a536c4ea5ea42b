#!/usr/bin/env python3
"""Plan report of the Metal backend's prefill at the real Qwen3.6-35B-A3B shape.

Counted from the dispatch sequence, not executed (see metal_plan.py for the recording device
and the synthetic 4-bit weights): for prompts of 512, 4K and 32K tokens prefilled in chunks of
`--chunk` (the default prefill_chunk, 512), the LAST chunk (the one with the longest context)
is encoded by GpuBackend and reported:

- kernels and dependency stages per chunk, command buffers and CPU waits per chunk (the goal
  is no wait inside a chunk: the one wait is the hand-back at its end);
- bytes of weights the chunk's dispatches declare (routed experts counted as min(T*k, E) per
  layer: at T = 512, top-8 of 256, every expert is active), and the whole prompt's weight
  traffic (chunks x per-chunk weights);
- scratch: device memory allocated while encoding the chunk (activations, the routing plan,
  expert rows, offset tables), which bounds what prefill needs beyond weights and state.

    PYTHONPATH=src python benchmarks/metal_prefill_plan.py [--prompts 512 4096 32768] [--chunk 512]
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

from lily import _core
from metal_plan import BITS, GATE_BITS, GROUP, config_35b


def chunk_plan(c, prompt: int, chunk: int):
    tokens = min(chunk, prompt)
    rows, (dispatches, barriers, cbs, waits), scratch = _core.gpu_plan(
        c, prompt, BITS, GROUP, GATE_BITS, tokens=tokens)
    kernels, weights = Counter(r[0] for r in rows), defaultdict(int)
    for name, _stage, wb, _sb, _ob, _tgs, _threads in rows:
        weights[name] += wb
    return {"tokens": tokens, "dispatches": dispatches, "stages": barriers + 1, "command buffers": cbs,
            "CPU waits": waits, "weights": sum(r[2] for r in rows), "state": sum(r[3] for r in rows),
            "activations": sum(r[4] for r in rows), "scratch": scratch, "kernels": kernels, "by_kernel": weights}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    c = config_35b()
    GB = 1e9
    print("| prompt | chunks | kernels / chunk | stages / chunk | command buffers / chunk | CPU waits / chunk | "
          "weights GB / chunk | prompt weights GB | state GB / chunk | activations GB / chunk | scratch MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    last = None
    for prompt in args.prompts:
        p = chunk_plan(c, prompt, args.chunk)
        n = -(-prompt // args.chunk)
        print(f"| {prompt:,} | {n} | {p['dispatches']} | {p['stages']} | {p['command buffers']} | {p['CPU waits']} | "
              f"{p['weights'] / GB:.2f} | {n * p['weights'] / GB:.1f} | {p['state'] / GB:.3f} | "
              f"{p['activations'] / GB:.3f} | {p['scratch'] / 1e6:.0f} |")
        last = p
    print()
    print(f"| kernel | dispatches per chunk of {last['tokens']} | weights GB per chunk |")
    print("|---|---:|---:|")
    for name, n in sorted(last["kernels"].items(), key=lambda kv: (-last["by_kernel"][kv[0]], kv[0])):
        print(f"| {name} | {n} | {last['by_kernel'][name] / GB:.3f} |")


if __name__ == "__main__":
    main()
