"""Batched decode (Engine.decode_batch): time per step and aggregate tokens/s for B sequences.

One step is one forward pass over B decode rows, one per sequence (csrc/engine/engine.h
Engine::step): the dense and expert weights are read once for all rows, attention and DeltaNet
run against each sequence's own cache and state (on the GPU backends in one dispatch per kernel
for all of them: the kernels' sequence tables, docs/metal.md). Each sequence holds a context of about --context tokens: a shared prefix of
--context - 10 tokens prefilled once and cloned, then 10 random tokens of its own, so the rows
differ (and route to different experts) from the first step on. Each step feeds every sequence
its greedy token. Reported: the median wall time of --steps steps after --warmup, and B / that.

--backend msl-cuda / metal / msl-cpu: the GPU backends batch too (a pass of several sequences
holds at most engine.batch_rows = 7 rows there; 8 sequences are passes of 7 and 1). --check
first compares one batched step with each sequence decoded alone (clones), bit for bit.
--device-loop (GPU backends, B <= 7): the steps run in the engine's device loop over the B
sequences (Engine.begin_device_batch: each row's argmax chosen on the device and fed to the
next step there, the next step committed before this one's tokens are read); --check then
also compares the loop's tokens with the host loop's greedy tokens on clones, step by step.

    python benchmarks/batch_decode.py --model build/bench/medium/mlx4 --threads 2 --batch 1,2,4,8,16
    python benchmarks/batch_decode.py --model demo --backend msl-cuda --batch 1,2,4,7,8 --check
    python benchmarks/batch_decode.py --model demo --backend msl-cuda --batch 1,2,4,7 --device-loop --check
    python benchmarks/batch_decode.py --json out.json

--backend-options JSON goes to the GPU model load (Model.load backend_options), so one build
times a variant against another, e.g. '{"per_sequence_mixers": true}' (the mixers one dispatch
per sequence, as before the sequence tables).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import lily

ROOT = Path(__file__).resolve().parents[1]
OWN_TOKENS = 10  # distinct tokens per sequence after the shared prefix


def same_as_solo(engine, states, tokens) -> bool:
    """One batched step of `states` equals each sequence's step alone (on clones), bit for bit;
    leaves the states one step on."""
    solo = [s.clone() for s in states]
    got = engine.decode_batch(states, tokens)
    want = np.stack([engine.decode(s, int(t)) for s, t in zip(solo, tokens, strict=True)])
    return bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))


def device_loop_steps(engine, states, tokens, n: int) -> tuple[list[float], list[list[int]]]:
    """n steps of the device loop over `states` from `tokens`: each step's wall time (from the
    call that commits the next step to its tokens) and tokens; the loop is ended after them."""
    assert engine.begin_device_batch(states, [int(t) for t in tokens], n, [None] * len(states))
    times, out = [], []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            tokens, errors = engine.next_device_tokens()
            out.append(tokens)
            times.append(time.perf_counter() - t0)
            if any(errors):
                raise RuntimeError(f"device loop: {errors}")
    finally:
        engine.end_device_batch()
    return times, out


def host_greedy(engine, states, tokens, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        tokens = engine.decode_batch(states, np.asarray(tokens, np.int32)).argmax(-1).astype(np.int32)
        out.append([int(t) for t in tokens])
    return out


def measure(model: lily.Model, batch: int, context: int, steps: int, warmup: int, seed: int,
            check: bool = False, device_loop: bool = False) -> dict:
    engine = model._engine
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prefix = engine.new_state(context + warmup + steps + 1)
    engine.prefill(prefix, rng.integers(0, vocab, size=context - OWN_TOKENS).astype(np.int32), False)
    states = []
    for _ in range(batch):
        s = prefix.clone()
        logits = engine.prefill(s, rng.integers(0, vocab, size=OWN_TOKENS).astype(np.int32), False)
        states.append(s)
    tokens = np.full(batch, int(logits.argmax()), dtype=np.int32)
    identical = same_as_solo(engine, states, tokens) if check else None
    if device_loop:
        clones = [s.clone() for s in states] if check else None
        times, got = device_loop_steps(engine, states, tokens, warmup + steps)
        if check:
            identical = identical and got == host_greedy(engine, clones, tokens, warmup + steps)
        step_s = statistics.median(times[warmup:])
        return {"batch": batch, "context": states[0].position - warmup - steps, "step_ms": step_s * 1e3,
                "tokens_per_s": batch / step_s, "steps": steps, "bit_identical_to_solo": identical,
                "device_loop": True}
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = engine.decode_batch(states, tokens)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        tokens = logits.argmax(-1).astype(np.int32)
    step_s = statistics.median(times)
    return {"batch": batch, "context": states[0].position - warmup - steps, "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s, "steps": steps, "bit_identical_to_solo": identical}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "build" / "bench" / "medium" / "mlx4"),
                    help="a checkpoint, or 'demo' (the embedded demo model)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "metal", "msl-cpu", "msl-cuda"])
    ap.add_argument("--check", action="store_true", help="first compare a batched step with solo steps")
    ap.add_argument("--device-loop", action="store_true", help="run the steps in the engine's device loop (GPU)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-matmul", default="auto", choices=["auto", "int8", "f32"])
    ap.add_argument("--batch", default="1,2,4,8,16", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=200, help="tokens in each sequence before the first step")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--backend-options", type=json.loads, default={}, help="GPU backends: Model.load backend_options")
    args = ap.parse_args()
    if args.context <= OWN_TOKENS:
        ap.error(f"--context must exceed {OWN_TOKENS}")
    path = None if args.model == "demo" else args.model
    if args.backend == "cpu":
        model = lily.Model.load(path, threads=args.threads, cpu_matmul=args.cpu_matmul)
    else:
        model = lily.Model.load(path, backend=args.backend, backend_options=args.backend_options)
    rows = [measure(model, int(b), args.context, args.steps, args.warmup, args.seed, args.check, args.device_loop)
            for b in args.batch.split(",")]
    base = rows[0]["tokens_per_s"] / rows[0]["batch"]
    loop = "device loop" if args.device_loop else "host loop"
    print(f"{model!r}\n{loop}, context ~{args.context} tokens, median of {args.steps} steps after {args.warmup}\n")
    print("| B | ms / step | tokens/s (all sequences) | vs B=1 per token | bit-identical to solo |")
    print("|---:|---:|---:|---:|---|")
    for r in rows:
        same = {None: "-", True: "yes", False: "NO"}[r["bit_identical_to_solo"]]
        print(f"| {r['batch']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | {same} |")
    if args.json:
        out = {"model": args.model, "engine": repr(model), "backend": args.backend, "threads": args.threads,
               "device_loop": args.device_loop, "backend_options": args.backend_options,
               "cpu_matmul": model._engine.cpu_matmul,
               "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
