"""The workload profile of a trace (scheduler.workload, `pagedjax profile-workload`): token
percentiles, the shares of multi-turn, RAG, shared-system-prompt and streamed requests, arrival
rate; a real server's --trace-out records what it needs, so traffic with known shares gives
those shares."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from helpers import RAG_TEMPLATE
from test_server import ENGINE

from pagedjax import LLM
from pagedjax.scheduler.trace import TraceRequest, load_trace
from pagedjax.scheduler.workload import workload_profile
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer
from pagedjax.tools.cli import main as cli_main


def test_profile_of_a_synthetic_trace():
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(1, 900, 200), rng.integers(1, 300, 200)
    trace = [TraceRequest(0.5 * i, int(p), int(o)) for i, (p, o) in
             enumerate(zip(prompts, outputs))]
    profile = workload_profile(trace, bin_s=10.0)
    for name, values in (("prompt_tokens", prompts), ("output_tokens", outputs)):
        for p in (50, 95, 99):
            assert profile[name][f"p{p}"] == pytest.approx(np.percentile(values, p))
    # a synthetic trace records no sessions, stream flags or tags: unknown, not 0
    for name in ("multi_turn", "rag", "streamed"):
        assert profile[name] == {"share": None, "recorded": 0}
    assert profile["shared_system_prompt"]["share"] == 0.0
    arrivals = profile["arrivals"]
    assert arrivals["requests_per_s"][:9] == [2.0] * 9  # 20 arrivals in every 10 s bin
    assert sum(r * 10 for r in arrivals["requests_per_s"]) == 200
    with pytest.raises(ValueError, match="bin_s"):
        workload_profile(trace, bin_s=0)


def test_a_returning_session_is_multi_turn_without_assistant_turns():
    """A session's later request continues its conversation even when its prompt holds no
    assistant turn (a client that sends only the new message, the history kept server-side);
    its first request does not, and neither does another session's first. Arrivals out of
    order: what counts is which came first."""
    trace = [TraceRequest(3.0, 8, 4, session="a", turns=0, stream=False),  # a's second
             TraceRequest(1.0, 8, 4, session="a", turns=0, stream=False),  # a's first
             TraceRequest(2.0, 8, 4, session="b", turns=0, stream=False),
             TraceRequest(4.0, 8, 4, session=None, turns=2, stream=False)]  # by its turns
    assert workload_profile(trace)["multi_turn"] == {"share": 0.5, "recorded": 4}
    assert workload_profile(trace[1:])["multi_turn"] == {"share": 1 / 3, "recorded": 3}


SYSTEM = "Answer briefly about paged KV."


@pytest.fixture(scope="module")
def served_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("workload") / "served.jsonl"
    server = OpenAIServer(LLM(**dict(ENGINE, max_model_len=256)).engine, "tiny",
                          trace_out=str(path),
                          chat_template=RAG_TEMPLATE)
    with BackgroundServer(server.build_app()) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, path


def _chat(client, messages, **body):
    headers = body.pop("headers", None)
    response = client.post("/v1/chat/completions", headers=headers,
                           json={"messages": messages, "max_tokens": 3, **body})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.slow  # make test-slow
def test_served_trace_with_known_shares_gives_those_shares(served_trace, tmp_path):
    """Ten requests: a three-turn conversation and two more sessions under one system prompt
    (five share it, two of them later turns), a chat with documents and two completions tagged
    rag, three streamed."""
    client, path = served_trace
    system = {"role": "system", "content": SYSTEM}
    turn = [system, {"role": "user", "content": "a block table?"}]
    for i in range(3):  # session alice: its prompt grows by a turn each time
        _chat(client, turn, headers={"X-Session-ID": "alice"})
        turn = turn + [{"role": "assistant", "content": f"answer {i}"},
                       {"role": "user", "content": "then?"}]
    _chat(client, [system, {"role": "user", "content": "why pages?"}], user="bob")
    _chat(client, [system, {"role": "user", "content": "copy on write?"}],
          metadata={"session_id": "carol"})
    _chat(client, [{"role": "system", "content": "Ground every answer in the documents."},
                   {"role": "user", "content": "summarize"}],
          documents=[{"text": "blocks are 16 tokens"}], user="dave")
    for i, stream in enumerate((True, False)):
        body = {"prompt": f"{i}: retrieved passage about eviction order, then a question",
                "max_tokens": 3, "metadata": {"workload": "rag"}, "stream": stream}
        assert client.post("/v1/completions", json=body).status_code == 200
    for i in range(2):
        assert client.post("/v1/completions", json={
            "prompt": f"{i} streamed completion prompt of some length", "max_tokens": 3,
            "stream": True}).status_code == 200
    trace = load_trace(path)
    assert len(trace) == 10
    out_json, out_png = tmp_path / "profile.json", tmp_path / "profile.png"
    cli_main(["profile-workload", str(path), "--json", str(out_json), "--plot", str(out_png)])
    profile = json.loads(out_json.read_text())
    assert profile["requests"] == 10
    assert profile["multi_turn"] == {"share": 0.2, "recorded": 10}
    assert profile["rag"] == {"share": 0.3, "recorded": 10}
    assert profile["shared_system_prompt"] == {"share": 0.5, "recorded": 10}
    assert profile["streamed"] == {"share": 0.3, "recorded": 10}
    assert profile["conversations"] == 1
    assert profile["prompt_tokens"]["p50"] == pytest.approx(
        np.percentile([r.prompt_len for r in trace], 50))
    assert out_png.stat().st_size > 10_000
    assert all("alice" not in line for line in path.read_text().splitlines())  # hashed


def test_documents_need_a_template_that_renders_them():
    server = OpenAIServer(LLM(**ENGINE).engine, "tiny",
                          chat_template=RAG_TEMPLATE.split("{% endif %}", 1)[1])
    from fastapi.testclient import TestClient
    with TestClient(server.build_app()) as client:
        response = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "documents": [{"text": "y"}],
            "max_tokens": 2})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "documents"
