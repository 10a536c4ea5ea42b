"""Streaming: print text as it is generated; stop strings; breaking out early.

    python examples/streaming.py [MODEL]
"""

import sys

import lily

model = lily.Model.load(sys.argv[1] if len(sys.argv) > 1 else None)

# Chunks carry a text delta (never a broken UTF-8 character) and the token id.
for chunk in model.generate("Once upon a time", max_tokens=60, temperature=0.8, seed=42, stream=True):
    print(chunk.text, end="", flush=True)
    if chunk.finish_reason:
        print(f"\n[finish: {chunk.finish_reason}]")

# A stop string is honoured even when it spans tokens, and is not emitted.
result = model.generate("The", max_tokens=60, temperature=0, stop=["."])
print(repr(result.text), result.finish_reason)

# Breaking out of the loop stops generation at once and frees the model.
with model.generate("Errors should never", max_tokens=500, stream=True) as stream:
    for i, _chunk in enumerate(stream):
        if i == 5:
            break
print("stopped after 5 chunks; the model is free:", model.generate("x", max_tokens=1).finish_reason)
