"""Load a checkpoint and greedily continue a few token ids (no tokenizer needed).

    python examples/generate_tokens.py PATH_TO_CHECKPOINT
"""

import sys
import time

import lily

model = lily.Model.load(sys.argv[1])
print(model)
prompt = [1, 2, 3, 4, 5, 6, 7, 8]
t0 = time.perf_counter()
out = model.generate(prompt, max_tokens=32)
dt = time.perf_counter() - t0
print("prompt ids:   ", prompt)
print("generated ids:", out)
print(f"{len(out)} tokens in {dt:.3f} s")
