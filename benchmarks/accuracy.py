"""The engine's test matrix as a table of measured errors (for docs and closing notes).

For every tiny checkpoint the test suite builds (tests/fixtures), prints the max relative
logit error max|lily - ref| / max|ref| against transformers (fp32) or mlx-lm (same quantized
bytes), for a prefilled prompt, prefill + token-by-token decode, and a prompt spanning several
prefill chunks, plus top-1 agreement.

    python benchmarks/accuracy.py [--out benchmarks/accuracy.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import lily  # noqa: E402
from fixtures import cases  # noqa: E402
from fixtures.store import Store  # noqa: E402


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def measure(path: Path, reference) -> tuple[float, float, float, float]:
    model = lily.Model.load(path, prefill_chunk=cases.PREFILL_CHUNK)
    prompt = model.logits(cases.PROMPT)
    s = model.session()
    k = cases.DECODE_SPLIT
    rows = [s.prefill(cases.PROMPT[:k])] + [s.decode(t) for t in cases.PROMPT[k:]]
    decode = np.stack(rows)
    long = model.logits(cases.LONG_PROMPT)
    top1 = float(np.mean(np.concatenate([prompt.argmax(-1) == reference.prompt.argmax(-1),
                                         long.argmax(-1) == reference.long.argmax(-1)])))
    return rel(prompt, reference.prompt), rel(decode, reference.prompt[k - 1:]), rel(long, reference.long), top1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    store = Store(Path(tempfile.mkdtemp(prefix="lily-accuracy-")))
    lines = ["| checkpoint | reference | prompt | prefill + decode | chunked long prompt | top-1 |",
             "|---|---|---:|---:|---:|---:|"]
    for case in cases.HF_CASES:
        path = store.hf(*case)
        e = measure(path, store.hf_reference(path))
        lines.append(f"| HF {cases.case_id(case)} | transformers fp32 | {e[0]:.1e} | {e[1]:.1e} | {e[2]:.1e} | {e[3]:.0%} |")
        print(lines[-1], flush=True)
    for case in cases.MLX_QUANT_CASES:
        path = store.mlx(*case)
        e = measure(path, store.mlx_reference(path))
        lines.append(f"| MLX {cases.case_id(case)} | mlx-lm, same bytes | {e[0]:.1e} | {e[1]:.1e} | {e[2]:.1e} | {e[3]:.0%} |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
