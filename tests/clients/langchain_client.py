"""langchain-openai, unchanged: invoke, stream, batch, bind_tools with a tool round trip,
with_structured_output in its three methods, and use_responses_api. argv[1]: the server's URL."""

import sys

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict

URL = f"{sys.argv[1]}/v1"
llm = ChatOpenAI(base_url=URL, api_key="unused", model="smollm2", temperature=0, max_tokens=160,
                 max_retries=0)

reply = llm.invoke("Say hello in one sentence.")
assert isinstance(reply.content, str) and reply.content and reply.usage_metadata["output_tokens"]
chunks = list(llm.stream("Count from one to five."))
assert len(chunks) > 3 and "".join(c.content for c in chunks)
assert len(llm.batch(["Name a color.", "Name a fruit."])) == 2


@tool
def get_weather(city: str) -> str:
    """The weather of a city."""
    return f"25C and sunny in {city}"


question = HumanMessage("What is the weather in Paris?")
called = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke([question])
call, = called.tool_calls
assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str), called
answer = llm.bind_tools([get_weather], tool_choice="none").invoke(
    [question, called, get_weather.invoke(call)])
assert isinstance(answer.content, str) and not answer.tool_calls
required = llm.bind_tools([get_weather], tool_choice="any", strict=True,
                          parallel_tool_calls=False).invoke([question])
assert required.tool_calls and required.tool_calls[0]["name"] == "get_weather", required


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a strict schema: no room for extra keys

    name: str
    country: str


for method in ("json_schema", "function_calling"):
    city = llm.with_structured_output(City, method=method).invoke("Name a city in France.")
    assert isinstance(city, City), (method, city)
schema = {"title": "City", "type": "object", "properties": {"name": {"type": "string"}},
          "required": ["name"], "additionalProperties": False}
loose = llm.with_structured_output(schema, method="json_mode").invoke(
    'Reply with a JSON object like {"name": "Paris"} naming a city.')
assert isinstance(loose, dict), loose

responses = ChatOpenAI(base_url=URL, api_key="unused", model="smollm2", temperature=0,
                       max_tokens=32, use_responses_api=True, max_retries=0)
said = responses.invoke("Say hello.")
assert said.text and said.response_metadata.get("status") in ("completed", "incomplete"), said
print("OK")
