"""Plot loss.csv (train.py's log) to loss.png: train (smoothed) and validation cross-entropy per token.

Needs matplotlib (not a lily dependency): `pip install matplotlib`.
  python plot_loss.py [loss.csv ...] --out loss.png
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def shipped_label(csv_path: Path) -> str:
    """The shipped run's label, from the train_summary.json beside its loss.csv."""
    summary = csv_path.with_name("train_summary.json")
    if not summary.exists():
        return "shipped demo"
    s = json.loads(summary.read_text())
    return f"shipped demo ({s['params'] / 1e6:.1f}M, {s['seconds']:.0f} s)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="*", default=[str(Path(__file__).parent / "loss.csv")])
    ap.add_argument("--out", default=str(Path(__file__).parent / "loss.png"))
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, path in enumerate(args.csv):
        rows = list(csv.DictReader(open(path)))
        tokens = [int(r["tokens"]) / 1e6 for r in rows]
        label = {
            "loss": shipped_label(Path(path)),
            "loss_demo2_231s": "second demo (44.4M, 231 s)",
            "loss_demo1_185s": "first demo (13.4M, 185 s)",
            "loss_run1_330s": "first demo's trial run (13.4M, 330 s)",
        }.get(Path(path).stem, Path(path).stem)
        ax.plot(tokens, [float(r["train_loss"]) for r in rows], f"C{i}--", label=f"{label}: train")
        ax.plot(
            tokens, [float(r["val_loss"]) for r in rows], f"C{i}-", label=f"{label}: validation"
        )
    # Each run validates on its own corpus's held-out documents: compare curves within a run.
    ax.set_xlabel("training tokens (millions); an epoch: 4.16M (first demo), 32.8M (second)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("lily demo model (Qwen3.5 MoE hybrid)")
    ax.set_ylim(1.5, 7.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
