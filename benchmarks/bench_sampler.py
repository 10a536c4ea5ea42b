"""Time one native sampling step over a Qwen3.5-sized vocabulary (248,320 logits).

Two kinds of logits: flat (N(0, 3): the worst case for top-p, most of the vocabulary in play)
and peaked (a language model's shape: a few likely tokens over a long tail, ~N(0, 2) shifted
down with 20 tokens near the top). Time is per call through the Python binding, which copies the
logits and always computes logprobs, so it is an upper bound on the cost inside the engine.

    PYTHONPATH=src python benchmarks/bench_sampler.py
"""

import time

import numpy as np

from lily._core import Sampler, SamplingParams

V = 248_320
CONFIGS = {
    "greedy": dict(),
    "T=0.7": dict(temperature=0.7),
    "T=0.6 top_k=20 top_p=0.95 (Qwen3.5 default)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "T=0.7 top_p=0.95": dict(temperature=0.7, top_p=0.95),
    "T=0.7 min_p=0.05": dict(temperature=0.7, min_p=0.05),
    "T=1 top_p=0.9 + penalties(64)": dict(temperature=1.0, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5),
}


def logits_kinds(rng):
    flat = (rng.standard_normal(V) * 3).astype(np.float32)
    peaked = (rng.standard_normal(V) * 2 - 8).astype(np.float32)
    peaked[rng.choice(V, 20, replace=False)] = rng.uniform(2, 10, 20).astype(np.float32)
    return {"flat": flat, "peaked": peaked}


def main(n=200):
    rng = np.random.default_rng(0)
    window = rng.integers(0, V, 64).astype(np.int32)
    kinds = logits_kinds(rng)
    print(f"{'config':50s} " + " ".join(f"{k:>10s}" for k in kinds) + "   (ms per call)")
    for name, kw in CONFIGS.items():
        row = []
        for logits in kinds.values():
            s = Sampler(SamplingParams(seed=1, **kw))
            s.sample(logits, window)
            t = time.perf_counter()
            for _ in range(n):
                s.sample(logits, window)
            row.append((time.perf_counter() - t) / n * 1e3)
        print(f"{name:50s} " + " ".join(f"{ms:10.3f}" for ms in row))


if __name__ == "__main__":
    main()
