"""Multi-turn chat with and without state reuse: time to first token and tokens/s per turn.

The same greedy conversation is run twice, alternating turn by turn: through ``Chat`` (the
state is kept; each turn prefills only what the state has not seen) and from scratch (each
turn renders and prefills the whole history, as a server without a prompt cache does).

    python benchmarks/chat_reuse.py [--model PATH] [--turns 6] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import statistics

import lily

QUESTIONS = ["What is a list?", "And a tuple?", "How do I sort a list?", "What does dict.get do?",
             "Explain str.split.", "What is a generator?", "How do I open a file?", "What is a set?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    model = lily.Model.load(args.model)
    chat = model.chat(system="You are a helpful assistant.", temperature=0)
    print("| turn | prompt tokens | reuse: prefilled | reuse: TTFT ms | scratch: TTFT ms | reuse tok/s | scratch tok/s | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    ttft_r, ttft_s = [], []
    for i, q in enumerate(QUESTIONS[: args.turns]):
        r = chat.send(q, max_tokens=args.max_tokens)
        s = model.generate(chat.messages[:-1], max_tokens=args.max_tokens, temperature=0)
        ttft_r.append(r.ttft_s)
        ttft_s.append(s.ttft_s)
        print(f"| {i + 1} | {r.prompt_tokens} | {r.prefilled_tokens} | {r.ttft_s * 1e3:.1f} | {s.ttft_s * 1e3:.1f} | "
              f"{r.decode_tokens_per_s:.1f} | {s.decode_tokens_per_s:.1f} | {r.tokens == s.tokens} |")
    print(f"\nmedian TTFT: reuse {statistics.median(ttft_r) * 1e3:.1f} ms, from scratch "
          f"{statistics.median(ttft_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
