"""Generations from C Python threads at once on one Model: aggregate tokens/s through the whole
stack (the one generation flow, lily.batching, the engine), device loop against host loop.

Each of C threads calls `model.generate(prompt_i, max_tokens=N, temperature=0,
repetition_penalty=1.0)` (prompt_i: a distinct prompt of --prompt-tokens random ids), all
started together; the model's `max_batch` is 7, so the C generations share every pass. Two modes,
alternated, the same requests:
- device: on a GPU backend the generations' decode rows run in the engine's device loop over
  them (each row's token chosen on the GPU; docs/metal.md "The device loop over several
  sequences");
- host: the same requests with a zero logit bias on token 0 (it changes no logit, so the tokens
  are the same; the script checks): the logits reach the host every step, and the batched
  passes are host passes.
Reported: generated tokens over the wall time from the threads' start to the last one's end
(prefill included), the median of --repeat runs after one warm-up; and the batcher's counts of
device-loop steps and loops begun in the last run.

    PYTHONPATH=src python benchmarks/generate_threads.py --backend msl-cuda --clients 1,2,4,7
    PYTHONPATH=src python benchmarks/generate_threads.py --backend msl-cpu --clients 1,2 --tokens 6 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np


def one_run(model, prompts, tokens: int, extra: dict) -> tuple[float, list[list[int]]]:
    out: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = model.generate(prompts[i], max_tokens=tokens, temperature=0, repetition_penalty=1.0,
                                    **extra).tokens
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, out


def main() -> None:
    import lily

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a checkpoint, or 'demo' (the embedded demo model)")
    ap.add_argument("--backend", default="msl-cuda", choices=["metal", "msl-cuda", "msl-cpu"])
    ap.add_argument("--clients", default="1,2,4,7")
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    model = lily.Model.load(None if args.model == "demo" else args.model, backend=args.backend, max_batch=7)
    rng = np.random.default_rng(0)
    vocab = model.tokenizer.vocab_size if model.tokenizer else model.config.vocab_size
    modes = {"device": {}, "host": {"logit_bias": {0: 0.0}}}
    rows = []
    for c in (int(x) for x in args.clients.split(",")):
        prompts = [rng.integers(0, vocab, size=args.prompt_tokens).tolist() for _ in range(c)]
        times: dict[str, list[float]] = {m: [] for m in modes}
        got: dict[str, list[list[int]]] = {}
        for rep in range(args.repeat + 1):  # the first is a warm-up
            for mode, extra in modes.items():
                before = (model._batcher.stats.device_steps, model._batcher.stats.device_loops)
                dt, got[mode] = one_run(model, prompts, args.tokens, extra)
                after = (model._batcher.stats.device_steps, model._batcher.stats.device_loops)
                if rep:
                    times[mode].append(dt)
                if mode == "device":
                    steps, loops = after[0] - before[0], after[1] - before[1]
        if got["device"] != got["host"]:
            raise SystemExit(f"C={c}: the device and host loops gave different tokens")
        n = sum(len(t) for t in got["device"])
        row = {"clients": c, "tokens": n, "device_tok_s": n / statistics.median(times["device"]),
               "host_tok_s": n / statistics.median(times["host"]), "device_steps": steps, "device_loops": loops}
        rows.append(row)
    print(f"{model!r}; {args.tokens} max tokens, {args.prompt_tokens}-token prompts, median of {args.repeat}\n")
    print("| clients | tokens | device loop tok/s | host loop tok/s | device / host | device steps, loops begun |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['tokens']} | {r['device_tok_s']:.0f} | {r['host_tok_s']:.0f} | "
              f"{r['device_tok_s'] / r['host_tok_s']:.2f}x | {r['device_steps']}, {r['device_loops']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": repr(model), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
