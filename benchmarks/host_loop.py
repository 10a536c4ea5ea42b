"""What leaving the device loop costs a request on a GPU backend, per token, on the demo model.

On the GPU backends `Model.generate` chooses each token on the device and feeds it to the next
step there (the device loop, docs/metal.md: two steps in flight, one 4-byte read per token),
unless the request's sampler needs the host: a structured-output token mask, a logit bias,
repetition / presence / frequency penalties or logprobs. Such a request runs the host loop: each
step's logits are copied to the host, sampled there, and the token goes back with the next step.
Three requests, the same prompt, greedy, `max_tokens` each:

- (a) device loop: plain greedy. `repetition_penalty=1.0` is passed on purpose: the demo
  checkpoint's generation_config.json defaults to 1.3, which alone would take the host loop;
- (b) the same request forced onto the host loop by a zero logit bias on one token (it changes
  no logit; the script checks that (a) and (b) give the same tokens): the host loop's own cost;
- (c) a `json_schema`-constrained request (an object with one free string, so it runs long):
  the host loop plus llguidance's mask, its copy into the sampler and the masked sampling.

ms per token is decode time over decoded tokens (`GenerationResult.decode_tokens_per_s`: the
first token, sampled from the prefill, and the prefill itself are not in it), the median of
`--repeat` runs after one warm-up run of each (kernel compilation, the tokenizer index). The
runs alternate a, b, c. The GPU counters (`Engine.gpu_stats`) say which loop ran: the device
loop keeps 2 steps in flight, the host loop 1 (the script fails if (a) never had 2).

    PYTHONPATH=src python benchmarks/host_loop.py --backend msl-cuda              # the H200: under a minute
    PYTHONPATH=src python benchmarks/host_loop.py --backend msl-cpu --tokens 8 --repeat 1   # smoke, ~30 s
    ... [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

PROMPT = "Once upon a time"
SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"],
          "additionalProperties": False}
MODES = {
    "a": ("device loop, greedy", {}),
    "b": ("host loop (the same request, zero logit_bias)", {"logit_bias": {0: 0.0}}),
    "c": ("host loop, json_schema", {"json_schema": SCHEMA}),
}


def run(backend: str, tokens: int, repeat: int) -> dict:
    import lily

    t0 = time.perf_counter()
    model = lily.Model.load(backend=backend, max_batch=1)  # one request at a time: no other rows in its passes
    load_s = time.perf_counter() - t0
    engine = model._engine

    def request(mode: str):
        before = engine.gpu_stats
        r = model.generate(PROMPT, max_tokens=tokens, temperature=0, repetition_penalty=1.0, **MODES[mode][1])
        after = engine.gpu_stats
        return r, [b - a for a, b in zip(before[:4], after[:4], strict=True)], after[4]

    warm = {}
    for mode in MODES:  # warm-up: kernels compiled, llguidance's index built
        warm[mode] = request(mode)
        if mode == "a" and warm[mode][2] < 2:
            raise SystemExit(f"(a) did not run the device loop on {backend} (steps in flight {warm[mode][2]})")
    if warm["a"][0].tokens != warm["b"][0].tokens:
        raise SystemExit(f"(a) and (b) differ: {warm['a'][0].tokens} vs {warm['b'][0].tokens}")
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    counts: dict[str, list[int]] = {m: [] for m in MODES}
    stats: dict[str, list[int]] = {}
    for _ in range(repeat):
        for mode in MODES:
            r, delta, _ = request(mode)
            if r.completion_tokens < 2:
                raise SystemExit(f"({mode}) generated {r.completion_tokens} token(s): nothing decoded to time")
            samples[mode].append(1e3 / r.decode_tokens_per_s)
            counts[mode].append(r.completion_tokens)
            stats[mode] = delta
    rows = []
    for mode, (what, _) in MODES.items():
        per_token = [round(delta / max(counts[mode][-1], 1), 2) for delta in stats[mode]]
        rows.append({"mode": mode, "what": what, "ms_per_token_median": statistics.median(samples[mode]),
                     "ms_per_token_min": min(samples[mode]), "tokens": statistics.median(counts[mode]),
                     "per_token_dispatches_barriers_command_buffers_waits": per_token})
    return {"backend": backend, "device": repr(model), "python": platform.python_version(), "load_s": load_s,
            "max_tokens": tokens, "repeat": repeat, "rows": rows, "total_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="msl-cuda", choices=["metal", "msl-cuda", "msl-cpu"])
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs of each request (median kept)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    report = run(args.backend, args.tokens, args.repeat)
    a = report["rows"][0]["ms_per_token_median"]
    print(f"{report['device']}; {args.tokens} max tokens, median of {args.repeat}; "
          f"load {report['load_s']:.1f} s, total {report['total_s']:.1f} s")
    print("| request | ms per token (median) | min | tokens | vs (a) | per token, prefill included: dispatches, "
          "barriers, command buffers, CPU waits |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| ({r['mode']}) {r['what']} | {r['ms_per_token_median']:.2f} | {r['ms_per_token_min']:.2f} | "
              f"{r['tokens']:.0f} | {r['ms_per_token_median'] - a:+.2f} ms | "
              f"{', '.join(str(x) for x in r['per_token_dispatches_barriers_command_buffers_waits'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
