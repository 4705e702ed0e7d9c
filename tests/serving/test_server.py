"""The OpenAI-compatible server against the offline API on the same engine (the reference): text,
token ids and parallel samples equal; streaming equals non-streaming; bad input gets HTTP 400
naming the field and changes nothing; admission control's 429; aborts on disconnect; metrics;
and `pagedjax serve` as a real process (failures: test_server_failures.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import threading
import time
import urllib.request

import psutil
import pytest
from fastapi.testclient import TestClient
from helpers import ROLE_TEMPLATE, complete, start_serve, wait_healthy
from prometheus_client.parser import text_string_to_metric_families

from pagedjax import LLM, EngineConfig, LLMEngine, SamplingParams, load_model
from pagedjax.frontend.llm import DEFAULT_MODEL
from pagedjax.scheduler import SchedulerConfig, ShapeBuckets
from pagedjax.scheduler.cost_model import StepCostModel
from pagedjax.scheduler.simulator import simulate
from pagedjax.scheduler.trace import load_trace, prefix_hashes
from pagedjax.serving.app import OpenAIServer

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128)
PROMPTS = ["copy:hello=", "rev:paged=", "copy:kv cache=", "rev:block table="]


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def reference(llm):
    """Offline outputs, computed on the engine before the server drives it."""
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    sampled = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.8, n=2,
                                                       seed=7), use_tqdm=False)
    return greedy, sampled


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return tmp_path_factory.mktemp("trace") / "served.jsonl"


@pytest.fixture(scope="module")
def server(llm, reference, trace_path):
    server = OpenAIServer(llm.engine, "tiny", trace_out=str(trace_path),
                          chat_template=ROLE_TEMPLATE)
    with TestClient(server.build_app()) as client:
        yield server, client


def _stream(client, path, body, headers=None):
    """The decoded data events of a streamed response (which must end with [DONE])."""
    events = []
    with client.stream("POST", path, json={**body, "stream": True},
                       headers=headers) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _metrics(client, headers=None) -> dict[tuple[str, tuple], float]:
    samples = {}
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                         if k != "model_name"))] = s.value
    return samples


def test_completions_equal_offline_generate_under_concurrency(server, reference):
    _, client = server
    greedy, _ = reference
    body = dict(model="tiny", max_tokens=12, temperature=0, return_token_ids=True)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: client.post("/v1/completions",
                                                        json={**body, "prompt": p}), PROMPTS))
    for _, response, ref in zip(PROMPTS, responses, greedy):
        assert response.status_code == 200, response.json()
        data = response.json()
        choice, = data["choices"]
        assert choice["text"] == ref.text
        assert choice["token_ids"] == ref.output_token_ids
        assert choice["finish_reason"] == ref.finish_reason
        assert data["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                                 "completion_tokens": len(ref.output_token_ids),
                                 "total_tokens": len(ref.prompt_token_ids)
                                 + len(ref.output_token_ids)}
    # Token-id prompts and a batch of prompts in one request: the same answers, in order.
    data = client.post("/v1/completions", json={**body, "prompt": [r.prompt_token_ids
                                                                   for r in greedy]}).json()
    assert [c["index"] for c in data["choices"]] == list(range(len(PROMPTS)))
    assert [c["text"] for c in data["choices"]] == [r.text for r in greedy]


def test_parallel_samples_and_seeds_equal_offline(server, reference):
    _, client = server
    _, sampled = reference
    data = client.post("/v1/completions", json={
        "prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0.8, "n": 2, "seed": 7,
        "return_token_ids": True}).json()
    got = [(c["index"], c["token_ids"]) for c in data["choices"]]
    want = [(2 * i + c.index, c.token_ids) for i, r in enumerate(sampled) for c in r.outputs]
    assert got == want
    # Streamed, each chunk carries one choice (as vLLM streams n > 1), and each choice's
    # chunks add up to its tokens.
    body = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0.8, "n": 2, "seed": 7,
            "return_token_ids": True}
    chunks = _stream(client, "/v1/completions", body)
    assert chunks and all(len(c["choices"]) == 1 for c in chunks)
    streamed = {}
    for c in chunks:
        streamed.setdefault(c["choices"][0]["index"], []).extend(c["choices"][0]["token_ids"])
    assert sorted(streamed.items()) == want
    chat = _stream(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2})
    assert all(len(c["choices"]) == 1 for c in chat)
    assert {c["choices"][0]["index"] for c in chat} == {0, 1}


def test_streaming_equals_non_streaming(server, reference):
    _, client = server
    greedy, _ = reference
    body = dict(prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=2,
                stream_options={"include_usage": True})
    whole = client.post("/v1/completions", json=body).json()
    events = _stream(client, "/v1/completions", body)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy[2].text
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == greedy[2].finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    echoed = client.post("/v1/completions", json={**body, "echo": True, "logprobs": None})
    assert echoed.json()["choices"][0]["text"] == PROMPTS[2] + greedy[2].text
    logprobs = whole["choices"][0]["logprobs"]
    for token, chosen, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                  logprobs["top_logprobs"]):
        assert top[token] == chosen and len(top) >= 2 and chosen <= 0


def test_chat_completions(server, llm):
    _, client = server
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "copy:"},
                                             {"type": "text", "text": "abc="}]}]
    body = dict(messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.post("/v1/chat/completions", json=body).json()
    flat = [messages[0], {"role": "user", "content": "copy:abc="}]
    prompt_ids = llm.tokenizer.apply_chat_template(flat, add_generation_prompt=True,
                                                   tokenize=True, chat_template=ROLE_TEMPLATE)
    assert whole["object"] == "chat.completion"
    assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
    choice, = whole["choices"]
    assert choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] >= t["logprob"]
               for t in content)
    events = _stream(client, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) \
        == choice["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


BAD = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),  # max_logprobs is 20
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": [" "]}, "bad_words"),
    ({"prompt": "x", "guided_regex": "a(b"}, "guided_regex"),
    ({"prompt": "x", "structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs"),
    ({"prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),  # past the vocabulary
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "x", "stop_token_ids": [9999]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [70000]}, "prompt"),  # outside the vocabulary
    ({"prompt": "x" * 120, "max_tokens": 16}, "prompt"),  # over max_model_len (128)
    ({"prompt": "x", "n": 9}, "n"),  # over max_num_seqs (8)
    ({"max_tokens": 4}, "prompt"),  # missing
]


def test_bad_requests_get_400_naming_the_field_and_change_nothing(server, reference):
    srv, client = server
    engine = srv.engine
    before = _metrics(client)
    for body, param in BAD:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400, (body, response.json())
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
        assert param.split("_")[0] in error["message"], error
    assert not engine.scheduler.state.requests and not engine.has_unfinished()
    assert engine.scheduler.kv_manager.num_used_blocks == 0
    response = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert response.status_code == 400 and "only text" in response.json()["error"]["message"]
    after = _metrics(client)
    rejected = ("pagedjax:requests_rejected_total", (("reason", "invalid"),))
    assert after[rejected] - before.get(rejected, 0) == len(BAD) + 3
    # ... and the engine still serves.
    greedy, _ = reference
    data = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12,
                                                "temperature": 0}).json()
    assert data["choices"][0]["text"] == greedy[0].text


def test_metrics_count_what_was_served(server):
    _, client = server
    before = _metrics(client)
    usage = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 5,
                                                  "ignore_eos": True}).json()["usage"]
             for p in PROMPTS[:3]]
    after = _metrics(client)

    def delta(name, labels=()):
        return after[name, labels] - before.get((name, labels), 0)

    assert delta("pagedjax:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("pagedjax:generation_tokens_total") == 15
    assert delta("pagedjax:request_success_total", (("finished_reason", "length"),)) == 3
    assert delta("pagedjax:time_to_first_token_seconds_count") == 3
    assert delta("pagedjax:e2e_request_latency_seconds_count") == 3
    # Per token, as vLLM V1 observes them: 4 intervals after each request's first token.
    assert delta("pagedjax:inter_token_latency_seconds_count") == 12
    assert delta("pagedjax:time_per_output_token_seconds_count") == 12
    for name in ("request_time_per_output_token", "request_prefill_time",
                 "request_decode_time", "request_inference_time"):
        assert delta(f"pagedjax:{name}_seconds_count") == 3, name
    # One request at a time: a prefill step and 4 decode steps each, computing its prompt
    # (less what the prefix cache held) and 4 generated tokens.
    assert delta("pagedjax:iteration_tokens_total_count") == 15
    assert 12 < delta("pagedjax:iteration_tokens_total_sum") <= sum(
        u["prompt_tokens"] for u in usage) + 12
    assert delta("pagedjax:request_generation_tokens_sum") == 15
    assert after["pagedjax:num_requests_running", ()] == 0
    assert after["pagedjax:kv_cache_usage_perc", ()] == 0


def test_disconnected_stream_is_aborted_and_frees_its_blocks(server):
    srv, client = server
    engine = srv.engine
    aborted, generated = engine.stats.num_aborted, engine.stats.num_generated_tokens
    with client.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True,
            "stream": True}) as response:
        next(response.iter_lines())  # the first token, then the client goes away
    deadline = time.time() + 60
    while engine.stats.num_aborted == aborted and time.time() < deadline:
        time.sleep(0.05)
    assert engine.stats.num_aborted == aborted + 1
    assert engine.stats.num_generated_tokens - generated < 100
    while engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert engine.scheduler.kv_manager.num_used_blocks == 0


def test_admission_control_api_key_and_token_ids_without_tokenizer(llm, reference):
    """A server over an engine without a tokenizer (prompts and outputs are token ids), a token
    budget of 40 and an API key."""
    greedy, _ = reference
    engine = LLMEngine(load_model(DEFAULT_MODEL), EngineConfig(**ENGINE))
    budgeted = OpenAIServer(engine, "tiny", max_outstanding_tokens=40, api_key="secret")
    auth = {"Authorization": "Bearer secret"}
    ids = greedy[0].prompt_token_ids  # 12 tokens: 12 + 16 = 28 outstanding
    body = {"prompt": ids, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    with TestClient(budgeted.build_app()) as client:
        assert client.post("/v1/completions", json=body).status_code == 401
        assert client.get("/health").status_code == 200  # the one route without a key
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert client.get(path).status_code == 401, path
        wrong = client.get("/v1/models", headers={"Authorization": "Bearer secreT"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        text = client.post("/v1/completions", json={"prompt": "x"}, headers=auth)
        assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"]
        budgeted.async_engine.pause()
        first = concurrent.futures.Future()
        threading.Thread(target=lambda: first.set_result(
            client.post("/v1/completions", json=body, headers=auth))).start()
        deadline = time.time() + 30
        while not budgeted.async_engine.num_live and time.time() < deadline:
            time.sleep(0.01)
        queued = dict(engine.scheduler.state.requests)
        refused = client.post("/v1/completions", json=body, headers=auth)  # 28 + 28 > 40
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert engine.scheduler.state.requests == queued  # refused: nothing queued
        assert len(engine.request_groups) == budgeted.async_engine.num_live == 1
        error = refused.json()["error"]
        assert error["code"] == "server_overloaded"
        assert "max_outstanding_tokens (40)" in error["message"]
        budgeted.async_engine.resume()
        data = first.result(timeout=60).json()
        assert len(data["choices"][0]["token_ids"]) == 16  # token ids, with no tokenizer
        assert data["choices"][0]["token_ids"][:6] == greedy[0].output_token_ids[:6]
        events = _stream(client, "/v1/completions", {**body, "max_tokens": 5},
                         headers=auth)  # admitted now: nothing outstanding
        assert [t for e in events for t in e["choices"][0]["token_ids"]] \
            == data["choices"][0]["token_ids"][:5]
        rejected = _metrics(client, auth)["pagedjax:requests_rejected_total",
                                    (("reason", "token_budget"),)]
        assert rejected == 1


@pytest.mark.slow  # make test-slow
def test_pagedjax_serve_process():
    proc, url = start_serve("--max-model-len", "128", "--max-num-batched-tokens", "128",
                            "--served-model-name", "tiny", "--max-outstanding-tokens", "4096")
    try:
        wait_healthy(url, [proc])
        data = complete(url, {"model": "tiny", "prompt": "rev:paged=", "max_tokens": 8,
                              "temperature": 0}, timeout_s=60)
        assert data["choices"][0]["text"] == "degap"  # the embedded model reverses strings
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            assert json.load(r)["data"][0]["id"] == "tiny"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the engine core's process (and multiprocessing's tracker)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive  # stopping the server ended the engine core too
    # uvicorn shuts down gracefully, then re-raises the signal it caught (exit by SIGTERM).
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out, out


def test_served_trace_replays_in_the_simulator(server, trace_path):
    _, client = server
    shared = "system: answer in one word. " * 2  # 56 characters
    responses = [client.post("/v1/completions", json={
        "prompt": shared + f"copy:{w}=", "max_tokens": 6, "temperature": 0,
        "return_token_ids": True}).json() for w in ("ab", "cd", "ef")]
    usages = [r["usage"] for r in responses]
    client.post("/v1/completions", json={"prompt": shared + "copy:ab=", "max_tokens": 6,
                                         "temperature": 0, "cache_salt": "tenant-b"})
    assert os.stat(trace_path).st_mode & 0o777 == 0o600  # the owner's only
    records = [json.loads(line) for line in trace_path.read_text().splitlines()][-4:]
    salted = records.pop()
    # Keyed by a secret of the file: a guessed prompt's plain hashes do not match, and the
    # same prompt under another cache_salt hashes apart.
    ids = responses[0]["choices"][0]["prompt_token_ids"]
    assert not set(prefix_hashes(ids)) & set(records[0]["prefix_hashes"])
    assert not set(salted["prefix_hashes"]) & set(records[0]["prefix_hashes"])
    assert [(r["prompt_len"], r["output_len"]) for r in records] == \
        [(u["prompt_tokens"], u["completion_tokens"]) for u in usages]
    # 65 tokens (with <bos>): 4 whole pieces, the first 3 inside the shared text.
    hashes = [r["prefix_hashes"] for r in records]
    assert all(len(h) == 4 and h[:3] == hashes[0][:3] for h in hashes)
    assert len({h[3] for h in hashes}) == 3
    assert records[0]["arrival_s"] <= records[1]["arrival_s"] <= records[2]["arrival_s"]
    trace = load_trace(trace_path)
    sim = simulate([dataclasses.replace(t, arrival_s=0.0) for t in trace[-4:-1]],
                   SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128,
                                   max_model_len=128), num_blocks=64, block_size=16,
                   buckets=ShapeBuckets.create(max_num_batched_tokens=128, max_num_seqs=8,
                                               max_model_len=128, block_size=16),
                   cost=StepCostModel({"prefill": (1e-3, 0, 0, 0, 0),
                                       "decode": (1e-3, 0, 0, 0, 0)}),
                   vocab_size=264)
    assert sim.prefix_hit_rate > 0  # the 2nd and 3rd find the shared pieces
