"""litellm's hosted_vllm provider, unchanged: completion, streaming, tools, responses.
argv[1]: the server's URL."""

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network

import litellm  # noqa: E402

BASE = dict(model="hosted_vllm/smollm2", api_base=f"{sys.argv[1]}/v1", api_key="unused",
            temperature=0)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

reply = litellm.completion(messages=ASK, max_tokens=24, **BASE)
assert reply.choices[0].message.content and reply.usage.completion_tokens
streamed = "".join(chunk.choices[0].delta.content or ""
                   for chunk in litellm.completion(messages=ASK, max_tokens=24, stream=True,
                                                   **BASE))
assert streamed
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
called = litellm.completion(messages=ASK, tools=tools, tool_choice="required", max_tokens=64,
                            **BASE)
call = called.choices[0].message.tool_calls[0]
assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
answer = litellm.responses(input="Say hello.", max_output_tokens=16, **BASE)
assert answer.output and answer.status in ("completed", "incomplete"), answer
print("OK")
