"""litellm's embedding through its hosted_vllm provider, unchanged, against a pooling server.
argv[1]: the server's URL."""

import math
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network

import litellm  # noqa: E402

TEXTS = ["The capital of France is Paris.", "Paged attention keeps the KV cache in blocks."]
reply = litellm.embedding(model="hosted_vllm/smollm2", input=TEXTS, api_base=f"{sys.argv[1]}/v1",
                          api_key="unused")
vectors = [item["embedding"] for item in reply.data]
assert len(vectors) == 2 and all(len(v) == 576 for v in vectors)
assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)
assert reply.usage.prompt_tokens > 0
print("OK")
