#!/usr/bin/env python3
"""Request latency and tokens/s through `lily serve` (OpenAI client) vs the Python API.

    PYTHONPATH=src python benchmarks/server_vs_api.py [--model PATH] [--requests 5] [--max-tokens 64]

Both sides run the same greedy chat requests (distinct prompts, so the prompt cache does not
help) on the same checkpoint, the server in a subprocess on 127.0.0.1. Reported per side: the
median request latency (non-streamed), the median time to the first streamed token, and
completion tokens per second of wall time (request latency, prefill included). The two sides
alternate request by request so both see the same machine load.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

import lily

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    prompts = [f"Question {i}: explain Python's {w}." for i, w in enumerate(
        ["lists", "tuples", "sets", "dicts", "classes", "modules", "iterators", "generators", "decorators",
         "exceptions"] * 4)][: args.requests]
    msgs = [[{"role": "user", "content": p}] for p in prompts]

    model = lily.Model.load(args.model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "lily", "serve", "--port", str(port), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env=env)
    api_lat, api_tok, api_ttft = [], [], []
    srv_lat, srv_tok, srv_ttft = [], [], []
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        name = client.models.list().data[0].id
        client.chat.completions.create(model=name, messages=msgs[0], max_tokens=4, temperature=0)  # warm-up
        model.generate(msgs[0], max_tokens=4, temperature=0)
        # Interleaved, so both sides see the same machine load.
        for m in msgs:
            t = time.perf_counter()
            r = model.generate(m, max_tokens=args.max_tokens, temperature=0)
            api_lat.append(time.perf_counter() - t)
            api_tok.append(r.completion_tokens)
            t = time.perf_counter()
            r = client.chat.completions.create(model=name, messages=m, max_tokens=args.max_tokens, temperature=0)
            srv_lat.append(time.perf_counter() - t)
            srv_tok.append(r.usage.completion_tokens)
            t = time.perf_counter()
            for c in model.generate(m, max_tokens=args.max_tokens, temperature=0, stream=True):
                if c.text:
                    api_ttft.append(time.perf_counter() - t)
                    break  # breaking out closes the stream
            t = time.perf_counter()
            stream = client.chat.completions.create(model=name, messages=m, max_tokens=args.max_tokens,
                                                    temperature=0, stream=True)
            for ev in stream:
                if ev.choices and ev.choices[0].delta.content:
                    srv_ttft.append(time.perf_counter() - t)
                    break
            stream.close()
    finally:
        proc.terminate()
        proc.wait(10)

    def row(label, lat, tok, ttft):
        print(f"{label:<12} {statistics.median(lat) * 1e3:>12.1f} {statistics.median(ttft) * 1e3:>10.1f} "
              f"{sum(tok) / sum(lat):>10.1f} {sum(tok) / len(tok):>8.1f}")

    print(f"{args.requests} greedy chat requests, max_tokens {args.max_tokens}, {model!r}")
    print(f"{'':<12} {'latency ms':>12} {'ttft ms':>10} {'tok/s':>10} {'tokens':>8}")
    row("python api", api_lat, api_tok, api_ttft)
    row("server", srv_lat, srv_tok, srv_ttft)


if __name__ == "__main__":
    main()
