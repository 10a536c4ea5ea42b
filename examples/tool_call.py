"""Tool calling: pass tool definitions, get structured calls back, answer them, continue.

The demo model was not trained to call tools, so with it this shows the plumbing (the tools
reach the chat template; any <tool_call> block in the output is parsed). With a real
Qwen3.5 / Qwen3.6 checkpoint the model emits calls.

    python examples/tool_call.py [MODEL]
"""

import json
import sys

import lily

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 21, "sky": "clear"})


model = lily.Model.load(sys.argv[1] if len(sys.argv) > 1 else None)
chat = model.chat(tools=TOOLS, temperature=0)
result = chat.send("What's the weather in Oslo?", max_tokens=64)
print("assistant:", result.content)
for call in result.tool_calls:
    fn = call["function"]
    args = json.loads(fn["arguments"])
    print(f"tool call: {fn['name']}({args})")
    chat.add_message("tool", get_weather(**args), tool_call_id=call["id"])
if result.tool_calls:
    print("assistant:", chat.respond(max_tokens=64).content)

# The parser on its own, on the Qwen3.5 / Qwen3.6 output format:
from lily.tool_calls import parse_output  # noqa: E402

parsed = parse_output(
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
    tools=TOOLS,
)
print(parsed.tool_calls)
