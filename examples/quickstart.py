"""Quickstart: load a model and generate.

    python examples/quickstart.py                      # the demo model shipped with lily
    python examples/quickstart.py mlx-community/Qwen3.6-35B-A3B-4bit   # or a path / hub id
"""

import sys

import lily

model = lily.Model.load(sys.argv[1] if len(sys.argv) > 1 else None)
print(model)

result = model.generate("The Python standard library", max_tokens=48, temperature=0)
print(result.text)
print(f"[{result.completion_tokens} tokens, {result.decode_tokens_per_s:.1f} tok/s decode, "
      f"time to first token {result.ttft_s * 1000:.0f} ms, finish: {result.finish_reason}]")
