"""instructor, unchanged: a pydantic model extracted in TOOLS, JSON_SCHEMA and JSON modes.
argv[1]: the server's URL.

TOOLS and JSON_SCHEMA are constrained by the schema, so they must succeed. JSON mode constrains
the reply to a JSON object only and shows the schema in the prompt; SmolLM2-135M tends to copy
the schema rather than fill it, which instructor rejects: there the check is the server's part,
a JSON object each attempt (response_format honoured), and a success when the model gets it
right."""

import json
import sys

import instructor
import openai
from instructor.core.exceptions import InstructorRetryException
from pydantic import BaseModel, ConfigDict


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a strict schema: no room for extra keys

    name: str
    country: str


def extract(mode):
    client = instructor.from_openai(openai.OpenAI(base_url=f"{sys.argv[1]}/v1", api_key="unused",
                                                  max_retries=0), mode=mode)
    return client.chat.completions.create(
        model="smollm2", response_model=City, max_retries=3, temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": "Paris is a city in France. Extract it."}])


for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
    city = extract(mode)
    assert isinstance(city, City), (mode, city)
    print(mode, city)
try:
    print(instructor.Mode.JSON, extract(instructor.Mode.JSON))
except InstructorRetryException as error:
    for attempt in error.failed_attempts:
        content = attempt.completion.choices[0].message.content
        assert isinstance(json.loads(content), dict), content  # a JSON object, as asked
    print(instructor.Mode.JSON, f"the model's objects did not validate in "
          f"{len(error.failed_attempts)} attempts: {content[:80]}")
print("OK")
