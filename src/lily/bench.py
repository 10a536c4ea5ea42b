"""`lily bench`: prefill and decode speed across prompt lengths.

For each prompt length L: a fresh sequence prefills L tokens (one ``Session.prefill`` call, which
the engine runs in chunks of ``prefill_chunk``), then decodes ``decode_tokens`` tokens greedily
(argmax of the returned logits, the cheapest sampler, so the figure is the engine's). The
prompt is deterministic pseudo-random token ids, so runs are comparable across machines and
need no tokenizer. With ``repeats`` > 1 the best run per length is kept (least disturbed by
other load), as the anchor's table does.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import numpy as np


def bench(model, lengths: list[int], *, decode_tokens: int = 64, repeats: int = 1, seed: int = 0) -> list[dict]:
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError("[bench] prompt lengths must be positive integers")
    if decode_tokens < 1 or repeats < 1:
        raise ValueError("[bench] decode tokens and repeats must be at least 1")
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        if n + decode_tokens > model.max_context:
            raise ValueError(f"[bench] {n} + {decode_tokens} tokens exceed the context ({model.max_context})")
        ids = rng.integers(0, vocab, size=n, dtype=np.int32)
        best = None
        for _ in range(repeats):
            s = model.session(n + decode_tokens + 1)
            t0 = time.perf_counter()
            logits = s.prefill(ids)
            t1 = time.perf_counter()
            for _ in range(decode_tokens):
                logits = s.decode(int(np.argmax(logits)))
            t2 = time.perf_counter()
            row = {"prompt_tokens": n, "decode_tokens": decode_tokens, "prefill_s": t1 - t0, "decode_s": t2 - t1,
                   "prefill_tok_s": n / (t1 - t0), "decode_tok_s": decode_tokens / (t2 - t1),
                   "ttft_ms": (t1 - t0) * 1e3}
            if best is None or row["prefill_s"] + row["decode_s"] < best["prefill_s"] + best["decode_s"]:
                best = row
        rows.append(best)
    return rows


def print_table(model, rows: list[dict], file: TextIO | None = None) -> None:
    out = file or sys.stdout
    mode = f", cpu_matmul {model._engine.cpu_matmul}" if model._engine.cpu_matmul else ""
    print(f"lily bench - {model.config.family}, backend {model._engine.backend}, {model._engine.threads} threads{mode}",
          file=out)
    print(f"{'prompt':>8} {'prefill tok/s':>14} {'ttft ms':>10} {'decode tok/s':>13}", file=out)
    for r in rows:
        print(f"{r['prompt_tokens']:>8} {r['prefill_tok_s']:>14.1f} {r['ttft_ms']:>10.1f} {r['decode_tok_s']:>13.1f}",
              file=out)
