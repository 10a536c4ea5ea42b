"""A multi-turn chat that keeps its state between turns: each turn prefills only new tokens.

    python examples/chat.py [MODEL]
"""

import sys

import lily

model = lily.Model.load(sys.argv[1] if len(sys.argv) > 1 else None)
chat = model.chat(system="You are a helpful assistant.", temperature=0)

for question in ["What is a list?", "And a tuple?", "How do I sort a list?"]:
    print(f"> {question}")
    result = chat.send(question, max_tokens=40)
    print(result.content)
    print(f"  [prompt {result.prompt_tokens} tokens, {result.cached_tokens} reused from the "
          f"conversation state, {result.prefilled_tokens} prefilled]")

chat.undo()  # forget the last exchange; the next turn restores a state snapshot, no re-prefill
print("> (undone) How do I reverse a list?")
for chunk in chat.send("How do I reverse a list?", max_tokens=40, stream=True):
    print(chunk.text, end="", flush=True)
print()
