#!/usr/bin/env python3
"""Talk to `lily serve` with the official OpenAI Python client.

    pip install ".[server]" openai   # in a lily checkout (the distribution is named lily-llm)
    lily serve                       # the built-in demo model on http://127.0.0.1:8000
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]

Shows a chat completion, a streamed answer, a follow-up that reuses the cached prompt, a
request with tools, and a plain completion.
"""

import argparse

import openai
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

ap = argparse.ArgumentParser()
ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
ap.add_argument("--api-key", default="not-needed", help="the server's --api-key, if it has one")
args = ap.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
model = client.models.list().data[0].id
print("model:", model)

# 1. A chat completion (greedy).
messages: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a concise Python tutor."},
    {"role": "user", "content": "What is a list?"}]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
print("\n[chat]", r.choices[0].message.content)
if r.usage:
    print("usage:", r.usage.prompt_tokens, "prompt +", r.usage.completion_tokens, "completion tokens")

# 2. The same conversation continued, streamed. The server has the earlier turn's state
#    cached, so only the new tokens are prefilled (usage reports them as cached_tokens).
messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
             {"role": "user", "content": "And a tuple?"}]
print("\n[stream] ", end="", flush=True)
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7, seed=1,
                                        stream=True, stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage and chunk.usage.prompt_tokens_details:
        print(f"\ncached prompt tokens: {chunk.usage.prompt_tokens_details.cached_tokens} "
              f"of {chunk.usage.prompt_tokens}")

# 3. Tools: the model may answer with tool_calls (OpenAI's structure) instead of text.
tools: list[ChatCompletionFunctionToolParam] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                   tools=tools, max_tokens=48, temperature=0)
msg = r.choices[0].message
if msg.tool_calls:
    for call in msg.tool_calls:
        if call.type == "function":
            print("\n[tool call]", call.function.name, call.function.arguments)
else:
    print("\n[tools] no call; answer:", msg.content)

# 4. A plain completion with log-probabilities.
completion = client.completions.create(model=model, prompt="The standard library", max_tokens=12, temperature=0,
                                       logprobs=2)
choice = completion.choices[0]
print("\n[completion]", repr(choice.text))
if choice.logprobs and choice.logprobs.token_logprobs:
    print("first token logprob:", choice.logprobs.token_logprobs[0])
