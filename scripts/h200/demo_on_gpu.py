"""The embedded demo model on msl-cuda against the CPU backend: the check for mlx-written
checkpoints (the demo's safetensors header is unpadded, so its tensors sit at 2 mod 4 and the
GPU backend copies them to an aligned buffer; before that, phase D's first msl-cuda load of
it died with CUDA "misaligned address").

    python3 scripts/h200/demo_on_gpu.py --out demo_on_gpu.json          # on the H200 (msl-cuda)
    python3 scripts/h200/demo_on_gpu.py --backend msl-cpu --out x.json   # a local dry run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import lily

PROMPT = [1, 50, 300, 7, 99, 1200, 4000, 12, 13, 14, 15, 16]  # token ids of the demo's vocabulary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="msl-cuda")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    gpu = lily.Model.load(backend=a.backend, backend_options={"kv_dtype": "float32"})
    cpu = lily.Model.load(backend="cpu", cpu_matmul="f32")
    g = np.asarray(gpu.session().prefill(PROMPT, all_logits=True), dtype=np.float32)
    c = np.asarray(cpu.session().prefill(PROMPT, all_logits=True), dtype=np.float32)
    greedy = {name: m.generate(PROMPT[:9], max_tokens=16, temperature=0, repetition_penalty=1.0).tokens
              for name, m in (("gpu", gpu), ("cpu", cpu))}
    held, copied = gpu._engine.gpu_weight_bytes
    report = {"backend": a.backend, "gpu_weight_bytes": held, "copied_at_load": copied,
              "prefill_max_rel_err": float(np.abs(g - c).max() / np.abs(c).max()),
              "prefill_argmax_equal": bool((g.argmax(-1) == c.argmax(-1)).all()),
              "greedy_equal": greedy["gpu"] == greedy["cpu"], "greedy": greedy}
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0 if report["prefill_max_rel_err"] < 1e-4 and report["greedy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
