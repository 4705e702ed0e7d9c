"""vLLM's utility endpoints: /tokenize (text and chat forms) and /detokenize round trip through the
engine's own tokenizer, unknown fields and bad ids are refused by name, /version and
/v1/models/{id} answer as vLLM's do, and an unknown route gets an OpenAI error body."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from helpers import ROLE_TEMPLATE
from test_server import ENGINE

from pagedjax import LLM, __version__
from pagedjax.serving.app import OpenAIServer


@pytest.fixture(scope="module")
def client():
    llm = LLM(**ENGINE)
    server = OpenAIServer(llm.engine, "tiny", chat_template=ROLE_TEMPLATE)
    with TestClient(server.build_app()) as client:
        client.tokenizer = llm.tokenizer
        yield client


def test_tokenize_detokenize_round_trip(client):
    text = "copy:hello= world"
    got = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = client.tokenizer.encode(text)
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == ENGINE["max_model_len"]
    assert got["token_strs"] == client.tokenizer.convert_ids_to_tokens(ids)
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == client.tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None
    back = client.post("/detokenize", json={"tokens": bare["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenize_chat_form_is_the_chat_template(client):
    messages = [{"role": "user", "content": "rev:paged="}]
    got = client.post("/tokenize", json={"messages": messages}).json()
    want = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, chat_template=ROLE_TEMPLATE)
    assert got["tokens"] == list(want) and got["count"] == len(want)
    plain = client.post("/tokenize", json={"messages": messages,
                                           "add_generation_prompt": False}).json()
    assert len(plain["tokens"]) < len(want)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
     "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_bodies_are_refused_by_name(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error


def test_version_and_model_card(client):
    assert client.get("/version").json() == {"version": __version__}
    card = client.get("/v1/models/tiny").json()
    assert card == client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == ENGINE["max_model_len"]
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_unknown_route_gets_an_openai_error_body(client):
    response = client.post("/v1/images/generations", json={"prompt": "x"})
    assert response.status_code == 404
    assert set(response.json()["error"]) >= {"message", "type", "param", "code"}
