"""openai-agents, unchanged: an agent with a function tool, on the chat-completions model and on
the SDK's default Responses model. argv[1]: the server's URL."""

import sys

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                    function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

set_tracing_disabled(True)
client = AsyncOpenAI(base_url=f"{sys.argv[1]}/v1", api_key="unused", max_retries=0)


@function_tool
def get_weather(city: str) -> str:
    """The weather of a city."""
    return f"25C and sunny in {city}"


for model in (OpenAIChatCompletionsModel("smollm2", client), OpenAIResponsesModel("smollm2", client)):
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=256))
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert result.final_output.startswith("25C and sunny in"), (type(model), result.final_output)
    plain = Agent(name="plain", instructions="Answer in one short sentence.", model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=400))
    answer = Runner.run_sync(plain, "Say hello.")
    assert isinstance(answer.final_output, str) and answer.final_output, type(model)
    print(type(model).__name__, "ok:", result.final_output, "|", answer.final_output[:40])
print("OK")
