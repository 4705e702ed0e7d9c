"""The pooling server (pagedjax.serving.pooling_routes, `pagedjax serve --runner pooling`):
/v1/embeddings (float and base64, dimensions, usage), /pooling, /classify, /score, /rerank
against transformers' own states through sentence-transformers' modules (an embedding model)
and the causal LM's yes / no logits (a reranker); the runner rule both ways; bad fields
refused by name; pooling requests in /metrics."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

from pooling_checkpoints import (ENGINE, assert_close, save_random, st_reference,  # noqa: E402
                                 word_tokenizer, write_st_pipeline)

from pagedjax import LLM  # noqa: E402
from pagedjax.pooling.scoring import cosine  # noqa: E402
from pagedjax.serving.app import OpenAIServer  # noqa: E402

TEXTS = ["w5 w9 w17 w3 w44 w2 w8", "w70 w71 w3", "w9 w9 w9 w9"]
# each message's content, then the role's word as a separator (the word tokenizer's words)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} "
                 "{{ 'w60' if m['role'] == 'user' else 'w61' }} {% endfor %}")


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("embedder")
    hf = save_random(directory, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32,
                     tie_word_embeddings=True, matryoshka_dimensions=[16])
    write_st_pipeline(directory, "lasttoken", normalize=True)
    word_tokenizer(directory)
    llm = LLM(str(directory), runner="pooling", **ENGINE)
    server = OpenAIServer(llm.engine, "emb", chat_template=CHAT_TEMPLATE)
    with TestClient(server.build_app()) as client:
        client.hf = hf
        yield client


def test_embeddings_float_base64_dimensions_and_usage(embedding_server):
    client, hf = embedding_server, embedding_server.hf
    got = client.post("/v1/embeddings", json={"input": TEXTS, "model": "emb"}).json()
    assert got["object"] == "list" and got["model"] == "emb"
    assert got["usage"]["prompt_tokens"] == sum(len(t.split()) for t in TEXTS)
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"]
    for item, text in zip(got["data"], TEXTS):
        assert item["object"] == "embedding"
        assert_close(item["embedding"], st_reference(hf, ids_of(text), "lasttoken", True))
    packed = client.post("/v1/embeddings", json={"input": ids_of(TEXTS[0]),
                                                 "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(vector, np.float32(got["data"][0]["embedding"]))
    short = client.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 16}).json()
    assert_close(short["data"][0]["embedding"],
                 st_reference(hf, ids_of(TEXTS[0]), "lasttoken", True, 16))
    tokens = client.post("/pooling", json={"input": TEXTS[1], "task": "token_embed"}).json()
    assert np.asarray(tokens["data"][0]["data"]).shape == (3, 64)
    chat = client.post("/v1/embeddings", json={"messages": [
        {"role": "system", "content": TEXTS[1]}, {"role": "user", "content": TEXTS[2]}]}).json()
    rendered = ids_of(f"{TEXTS[1]} w61 {TEXTS[2]} w60")  # the chat template's text
    assert chat["usage"]["prompt_tokens"] == len(rendered)
    assert_close(chat["data"][0]["embedding"], st_reference(hf, rendered, "lasttoken", True))


def test_embedding_model_scores_and_reranks_by_cosine(embedding_server):
    client, hf = embedding_server, embedding_server.hf
    want = [cosine(st_reference(hf, ids_of(TEXTS[0]), "lasttoken", True),
                   st_reference(hf, ids_of(t), "lasttoken", True)) for t in TEXTS]
    scores = client.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    np.testing.assert_allclose([d["score"] for d in scores["data"]], want, atol=2e-5)
    ranked = client.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:],
                                             "top_n": 1}).json()
    best = int(np.argmax(want[1:]))
    assert [r["index"] for r in ranked["results"]] == [best]
    assert ranked["results"][0]["document"] == {"text": TEXTS[1 + best]}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "w1", "foo": 1}, "foo"),
    ("/v1/embeddings", {"input": "w1", "dimensions": 20}, "dimensions"),
    ("/v1/embeddings", {"input": "w1", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": [], "model": "emb"}, "input"),
    ("/v1/embeddings", {"input": "w1", "priority": 3}, "priority"),
    ("/v1/embeddings", {"input": "w1", "messages": [{"role": "user", "content": "w2"}]},
     "input"),
    ("/v1/embeddings", {"input": "w1", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "w2"}],
                        "add_special_tokens": True}, "add_special_tokens"),
    ("/classify", {"input": "w1"}, "task"),
    ("/pooling", {"input": "w1", "task": "embed", "use_activation": True}, "use_activation"),
    ("/pooling", {"input": "w1", "use_activation": True, "softmax": False}, "softmax"),
    ("/score", {"text_1": "w1", "text_2": ["w2"] * 1025}, "text_2"),
    ("/score", {"text_1": ["w1"] * 1025, "text_2": ["w2"] * 1025}, "text_1"),
    ("/score", {"text_1": "w1", "text_2": ["w2", ""]}, "text_2"),
    ("/rerank", {"query": "w1", "documents": ["w2"] * 1025}, "documents"),
    ("/rerank", {"query": "w1", "documents": ["w2", ""]}, "documents"),
    ("/rerank", {"query": "", "documents": ["w2"]}, "query"),
])
def test_bad_pooling_bodies_are_refused_by_name(embedding_server, path, body, param):
    response = embedding_server.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    if "" in body.get("documents", ()):  # the item named, not an internal request's field
        assert response.json()["error"]["message"] == "documents[1] must not be empty"


def test_pooling_server_refuses_generation_and_counts_its_requests(embedding_server):
    response = embedding_server.post("/v1/completions", json={"prompt": "w1"})
    assert response.status_code == 400 and "runner" in response.json()["error"]["message"]
    metrics = embedding_server.get("/metrics").text
    line = next(m for m in metrics.splitlines()
                if m.startswith("pagedjax:request_success_total") and 'reason="stop"' in m)
    assert float(line.split()[-1]) >= 3
    assert "pagedjax:prompt_tokens_total" in metrics


def test_reranker_through_yes_no_and_a_generating_server_refuses_pooling(tmp_path):
    hf = save_random(tmp_path, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32)
    word_tokenizer(tmp_path, {"no": 5, "yes": 7})
    llm = LLM(str(tmp_path), runner="pooling", hf_overrides={"is_original_qwen3_reranker": True},
              **ENGINE)
    query, docs = "w10 w11 w12", ["w20 w21", "w30 w31 w32 w33 w34", "w40"]
    want = []
    for doc in docs:
        with torch.no_grad():
            logits = hf(torch.tensor([ids_of(query + " " + doc)])).logits[0, -1]
        want.append(torch.softmax(logits[[5, 7]], dim=0)[1].item())
    with TestClient(OpenAIServer(llm.engine, "rr").build_app()) as client:
        ranked = client.post("/rerank", json={"query": query, "documents": docs,
                                              "return_documents": False}).json()
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(want)[::-1])
        np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]],
                                   sorted(want, reverse=True), rtol=2e-5, atol=2e-6)
        assert all("document" not in r for r in ranked["results"])
        probs = client.post("/classify", json={"input": [query + " " + docs[0]]}).json()
        assert probs["data"][0]["label"] == "yes"
        assert probs["data"][0]["probs"] == pytest.approx([want[0]], rel=2e-5, abs=2e-6)
        raw = client.post("/score", json={"text_1": query, "text_2": docs[0],
                                          "softmax": False}).json()  # vLLM's older name
        assert raw["data"][0]["score"] == pytest.approx(np.log(want[0] / (1 - want[0])),
                                                        rel=1e-4, abs=1e-4)
    generating = LLM(str(tmp_path), runner="generate", **ENGINE)
    with TestClient(OpenAIServer(generating.engine, "gen").build_app()) as client:
        response = client.post("/v1/embeddings", json={"input": "w1"})
        assert response.status_code == 400 and "runner" in response.json()["error"]["message"]
