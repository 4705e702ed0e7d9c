"""OpenAI's Predicted Outputs (issue 38): a request's `prediction` is the source of its
speculative drafts. The tokens are plain decoding's whatever the prediction (right, partly
right, wrong); usage reports the accepted and rejected prediction tokens as OpenAI does; an
engine that does not speculate refuses the field by name."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from helpers import run_requests as run
from test_server import ENGINE, ROLE_TEMPLATE
from test_speculative import NGRAM, byte_model, make_engine  # noqa: F401 - a fixture

from pagedjax import LLM, SamplingParams
from pagedjax.scheduler import RequestError
from pagedjax.serving.app import OpenAIServer
from pagedjax.text.tokenizer import ByteTokenizer

SPECULATIVE = dict(NGRAM, prompt_lookup_min=4, prompt_lookup_max=4)  # n-grams rarely match


def test_tokens_equal_plain_decoding_whatever_the_prediction(byte_model):  # noqa: F811
    tok = ByteTokenizer()
    prompt = tok.encode("predict me: ")
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (plain,) = run(make_engine(byte_model, None), [(prompt, greedy)])
    expected = plain.outputs[0].token_ids
    edited = expected[:12] + [65, 66] + expected[14:]  # a local edit
    for prediction, accepted_at_least in ((expected, 25), (edited, 15), (expected[::-1], 0)):
        engine = make_engine(byte_model, SPECULATIVE)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                prediction=prediction)
        (out,) = run(engine, [(prompt, params)])
        assert out.outputs[0].token_ids == expected
        metrics = out.metrics
        assert metrics.num_accepted_draft_tokens >= accepted_at_least
        assert metrics.num_draft_tokens > metrics.num_accepted_draft_tokens or \
            prediction == expected
    # without a prediction this prompt gives (almost) no drafts: the prediction made them
    (out,) = run(make_engine(byte_model, SPECULATIVE), [(prompt, greedy)])
    assert out.metrics.num_accepted_draft_tokens < 10


def test_an_engine_that_does_not_speculate_refuses_a_prediction(byte_model):  # noqa: F811
    engine = make_engine(byte_model, None)
    with pytest.raises(RequestError, match="prediction .* needs an engine with speculative"):
        engine.add_request([1, 2, 3], SamplingParams(prediction=[4, 5]))
    assert not engine.has_unfinished()
    with pytest.raises(RequestError, match="prediction must hold token ids"):
        make_engine(byte_model, SPECULATIVE).add_request([1, 2], SamplingParams(
            prediction=[4, 9999]))


@pytest.fixture(scope="module")
def client():
    llm = LLM(**ENGINE, speculative_config=SPECULATIVE)
    server = OpenAIServer(llm.engine, "tiny", chat_template=ROLE_TEMPLATE)
    with TestClient(server.build_app()) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_usage_reports_the_prediction_tokens(client, path):
    # 16 tokens whatever they are, their text back to the same tokens (special ones spelled)
    body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    if path == "/v1/completions":
        body["prompt"] = "copy:speculative decoding="
    else:
        body["messages"] = [{"role": "user", "content": "copy:speculative decoding="}]
    plain = client.post(path, json=body).json()
    text = plain["choices"][0].get("text", None) or plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]
    predicted = client.post(path, json={**body, "prediction": {
        "type": "content", "content": [{"type": "text", "text": text}]}}).json()
    assert predicted["choices"][0].get("text") == plain["choices"][0].get("text")
    assert predicted["choices"][0].get("message") == plain["choices"][0].get("message")
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 5, details
    assert details["rejected_prediction_tokens"] >= 0
    wrong = client.post(path, json={**body, "stream": True,
                                    "stream_options": {"include_usage": True},
                                    "prediction": {"type": "content", "content": text[::-1]}})
    chunks = [json.loads(line[6:]) for line in wrong.text.splitlines()
              if line.startswith("data: {")]
    wrong_details = chunks[-1]["usage"]["completion_tokens_details"]
    assert wrong_details["rejected_prediction_tokens"] > 0
    assert wrong_details["accepted_prediction_tokens"] < details["accepted_prediction_tokens"]


@pytest.mark.parametrize("prediction", [{"type": "content"}, {"type": "other", "content": "x"},
                                        {"type": "content", "content": 5},
                                        {"type": "content", "content": "x", "extra": 1}])
def test_a_malformed_prediction_is_refused_by_name(client, prediction):
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "prediction": prediction})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prediction"


def test_metrics_count_the_verified_drafts(client):
    """/metrics' spec_decode counters follow the engine's: after a predicted request, drafts
    were verified and the acceptance gauges are set."""
    client.post("/v1/completions", json={
        "prompt": "copy:metrics=", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "prediction": {"type": "content", "content": "metrics"}})
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("pagedjax:spec_decode"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    assert values["pagedjax:spec_decode_num_draft_tokens_total"] > 0
    assert values["pagedjax:spec_decode_num_drafts_total"] > 0
    rate = values["pagedjax:spec_decode_acceptance_rate"]
    assert rate == pytest.approx(values["pagedjax:spec_decode_num_accepted_tokens_total"]
                                 / values["pagedjax:spec_decode_num_draft_tokens_total"])
