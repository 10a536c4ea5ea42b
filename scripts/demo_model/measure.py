"""Compare demo models: held-out perplexity, package size and how often sampling loops.

  python measure.py                                  # the shipped demo alone
  python measure.py --new /tmp/new_demo [--json out.json]
  python measure.py --gen '{"repetition_penalty": 1.15}'   # try sampling defaults on the models

Held-out perplexity: tests/data/demo_heldout.txt (13 prose paragraphs of Python documentation
pages no demo was trained on), each paragraph scored from a fresh state, next-token, by mlx-lm
(the reference) and by lily on the same 4-bit files. Models with different tokenizers are
compared per *old* token: exp(total NLL / the number of tokens the shipped demo's tokenizer
predicts on the same text), so a tokenizer that merely cuts the text into fewer pieces gains
nothing. The issue's goal is new <= 0.6 x old.

Package size: every file of the folder (the goal: <= 32 MB).

Loops: for each prompt, lily generates 200 tokens with the folder's generation_config.json
defaults (or those overridden by --gen), seeds 0-3; reported are the share of repeated 4-grams
among the generated tokens (0: no 4-gram twice) and the longest stretch covered by one repeated
n-gram (the "cafile cafile cafile" failure: a loop covers most of the tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HELDOUT = REPO / "tests" / "data" / "demo_heldout.txt"
SHIPPED = REPO / "src" / "lily" / "demo"
PROMPTS = ["The json module", "A list comprehension is", "To open a file for reading,", "Love is",
           "The difference between a tuple and a list is"]
GOAL_RATIO, GOAL_MB = 0.6, 32.0


def paragraphs() -> list[str]:
    return [p.strip() for p in HELDOUT.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def _nll(logits: np.ndarray, ids: np.ndarray) -> float:
    lg = logits[:-1].astype(np.float64)
    lg -= lg.max(-1, keepdims=True)
    logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum())


def heldout_nll(folder: Path) -> dict:
    """Summed NLL and predicted-token count on the held-out paragraphs, by mlx-lm and lily."""
    import mlx.core as mx
    from mlx_lm import load

    import lily

    ref, _ = load(str(folder))
    ref.set_dtype(mx.float32)  # lily computes in float32; compare like with like
    model = lily.Model.load(folder)
    out = {"mlx-lm": 0.0, "lily": 0.0, "tokens": 0}
    for text in paragraphs():
        ids = np.asarray(model.tokenizer.encode(text), dtype=np.int32)
        out["mlx-lm"] += _nll(np.array(ref(mx.array(ids)[None])[0].astype(mx.float32)), ids)
        out["lily"] += _nll(model.logits(ids), ids)
        out["tokens"] += len(ids) - 1
    return out


def package_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6


def repeats(tokens: list[int]) -> tuple[float, int]:
    """(share of 4-grams seen before in the text, longest run of tokens inside repeated 8-grams)."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    seen: set = set()
    again = 0
    for g in grams:
        again += g in seen
        seen.add(g)
    eights = [tuple(tokens[i:i + 8]) for i in range(len(tokens) - 7)]
    first: dict = {}
    in_repeat = [False] * len(tokens)
    for i, g in enumerate(eights):
        if g in first:
            for j in range(i, i + 8):
                in_repeat[j] = True
        first.setdefault(g, i)
    longest = run = 0
    for flag in in_repeat:
        run = run + 1 if flag else 0
        longest = max(longest, run)
    return (again / len(grams) if grams else 0.0), longest


def loop_check(folder: Path, overrides: dict) -> dict:
    import lily

    model = lily.Model.load(folder)
    rows = []
    for prompt in PROMPTS:
        for seed in range(4):
            r = model.generate(prompt, max_tokens=200, seed=seed, **overrides)
            share, longest = repeats(r.tokens)
            rows.append({"prompt": prompt, "seed": seed, "tokens": len(r.tokens), "repeated_4grams": share,
                         "longest_loop": longest, "text": r.text[:160]})
    return {"defaults": model.generation_defaults.sampling_kwargs() | overrides,
            "mean_repeated_4grams": float(np.mean([r["repeated_4grams"] for r in rows])),
            "worst_loop_tokens": max(r["longest_loop"] for r in rows),
            "samples": rows}


def measure(folder: Path, overrides: dict) -> dict:
    return {"folder": str(folder), "package_mb": round(package_mb(folder), 2), "heldout": heldout_nll(folder),
            "loops": loop_check(folder, overrides)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=str(SHIPPED), help="the model to beat (default: the shipped demo)")
    ap.add_argument("--new", default=None, help="the candidate folder (convert.py's output)")
    ap.add_argument("--gen", default="{}", help="JSON sampling overrides for the loop check (both models)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    overrides = json.loads(args.gen)
    report = {"old": measure(Path(args.old), overrides)}
    old = report["old"]["heldout"]
    lines = []
    for name in ("old", "new") if args.new else ("old",):
        if name == "new":
            report["new"] = measure(Path(args.new), overrides)
        m, h = report[name], report[name]["heldout"]
        per_token = np.exp(h["mlx-lm"] / h["tokens"])
        per_old_token = np.exp(h["mlx-lm"] / old["tokens"])
        m["perplexity"] = {"per_token_mlx_lm": per_token, "per_token_lily": float(np.exp(h["lily"] / h["tokens"])),
                           "per_old_token_mlx_lm": float(per_old_token)}
        lines.append(f"{name}: {m['folder']}  {m['package_mb']:.1f} MB  held-out ppl {per_token:.2f} per token "
                     f"(lily {m['perplexity']['per_token_lily']:.2f}), {per_old_token:.2f} per old token; "
                     f"repeated 4-grams {100 * m['loops']['mean_repeated_4grams']:.1f}%, "
                     f"longest loop {m['loops']['worst_loop_tokens']} tokens")
    ok = True
    if args.new:
        ratio = report["new"]["perplexity"]["per_old_token_mlx_lm"] / report["old"]["perplexity"]["per_old_token_mlx_lm"]
        report["ratio"] = ratio
        ok = ratio <= GOAL_RATIO and report["new"]["package_mb"] <= GOAL_MB
        lines.append(f"new/old held-out perplexity {ratio:.3f} (goal <= {GOAL_RATIO}); package "
                     f"{report['new']['package_mb']:.1f} MB (goal <= {GOAL_MB}): {'MET' if ok else 'NOT MET'}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
