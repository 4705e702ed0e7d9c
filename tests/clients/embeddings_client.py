"""The openai client's embeddings.create (float, and its default base64 it decodes itself) and
langchain-openai's OpenAIEmbeddings (check_embedding_ctx_length=False, as its docs say for
servers other than OpenAI's), unchanged, against a pooling server. argv[1]: the server's URL."""

import math
import sys

from langchain_openai import OpenAIEmbeddings
from openai import OpenAI

URL = f"{sys.argv[1]}/v1"
TEXTS = ["The capital of France is Paris.", "Paged attention keeps the KV cache in blocks."]
client = OpenAI(base_url=URL, api_key="unused", max_retries=0)

plain = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
packed = client.embeddings.create(model="smollm2", input=TEXTS)  # base64 on the wire
assert [d.index for d in plain.data] == [0, 1] and plain.usage.prompt_tokens > 0
assert plain.usage.total_tokens == plain.usage.prompt_tokens
for a, b in zip(plain.data, packed.data):
    assert len(a.embedding) == len(b.embedding) == 576
    assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
    assert abs(math.sqrt(sum(x * x for x in a.embedding)) - 1) < 1e-4  # normalized
one = client.embeddings.create(model="smollm2", input=TEXTS[0], encoding_format="float")
assert max(abs(x - y) for x, y in zip(one.data[0].embedding, plain.data[0].embedding)) < 1e-4

embedder = OpenAIEmbeddings(base_url=URL, api_key="unused", model="smollm2",
                            check_embedding_ctx_length=False, max_retries=0)
documents = embedder.embed_documents(TEXTS)
query = embedder.embed_query(TEXTS[0])
assert len(documents) == 2 and len(query) == 576
assert max(abs(x - y) for x, y in zip(query, plain.data[0].embedding)) < 1e-4
assert max(abs(x - y) for x, y in zip(documents[1], plain.data[1].embedding)) < 1e-4
print("OK")
