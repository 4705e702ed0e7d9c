"""The engine core in its own process (pagedjax.frontend.engine_core, core_client) against the
in-process engine on the same model and settings: the same responses, token for token (greedy,
seeded sampling with n and best_of, stop strings, structured outputs, logprobs and prompt
logprobs, chat, streaming), aborts free the core's blocks, admission control and bad requests
answer the same, a killed core answers 503 at once, and `pagedjax serve` leaves no process
behind. The delta encoding of outputs is checked against the cumulative outputs it rebuilds."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import select
import subprocess
import sys
import time

import psutil
import pytest
from fastapi.testclient import TestClient
from helpers import ROLE_TEMPLATE
from prometheus_client.parser import text_string_to_metric_families

from pagedjax import LLM
from pagedjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedjax.frontend.core_client import CoreClient
from pagedjax.frontend.engine_core import LLMFactory
from pagedjax.frontend.llm import DEFAULT_MODEL
from pagedjax.frontend.output_deltas import DeltaDecoder, DeltaEncoder
from pagedjax.serving.app import OpenAIServer

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128)
PROMPTS = ["copy:hello=", "rev:paged=", "copy:kv cache=", "rev:block table="]

BODIES = [
    *({"prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}
      for p in PROMPTS),
    {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.8, "n": 2, "seed": 7},
    {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 1.0, "n": 2, "best_of": 3,
     "seed": 3, "logprobs": 1},
    {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "stop": ["ca"]},
    {"prompt": PROMPTS[3], "max_tokens": 10, "temperature": 0.7, "seed": 1,
     "structured_outputs": {"regex": "[a-e]{3,6}"}},
    {"prompt": PROMPTS[0], "max_tokens": 9, "ignore_eos": True, "temperature": 0,
     "stream": True, "logprobs": 1},
]


@pytest.fixture(scope="module")
def servers():
    local = OpenAIServer(LLM(**ENGINE).engine, "tiny", chat_template=ROLE_TEMPLATE)
    core = CoreClient(LLMFactory(DEFAULT_MODEL, engine_kwargs=ENGINE))
    remote = OpenAIServer(core, "tiny", chat_template=ROLE_TEMPLATE,
                          max_outstanding_tokens=4096)
    with TestClient(local.build_app()) as a, TestClient(remote.build_app()) as b:
        yield a, (remote, b)
    assert not core.process.is_alive()  # the app's shutdown stopped the core's process


def _answer(client, path: str, body: dict):
    """A response with what differs between two servers anyway (ids, times) left out; a
    stream as its events."""
    response = client.post(path, json=body)
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        return response.status_code, [_strip(e) for e in events]
    return response.status_code, _strip(response.json())


def _tokens(answer) -> list:
    """Each choice's text and finish reason (a stream's, concatenated)."""
    events = answer[1] if isinstance(answer[1], list) else [answer[1]]
    texts: dict = {}
    for event in events:
        for choice in event["choices"]:
            text, _ = texts.get(choice["index"], ("", None))
            texts[choice["index"]] = text + choice["text"], choice["finish_reason"]
    return sorted(texts.items())


def _strip(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("id", "created")}


@pytest.mark.slow  # two servers answering a whole request mix: make test-slow
def test_core_process_answers_as_the_in_process_engine(servers):
    local, (_, remote) = servers
    expected = [_answer(local, "/v1/completions", body) for body in BODIES]
    for body, want in zip(BODIES, expected):  # one at a time: the same batches, equal floats
        assert want[0] == 200, (body, want)
        assert _answer(remote, "/v1/completions", body) == want, body
    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:  # batched in the core
        got = list(pool.map(lambda body: _answer(remote, "/v1/completions", body), BODIES))
    for body, want, have in zip(BODIES, expected, got):  # the same tokens in other batches
        assert _tokens(have) == _tokens(want), body
    chat = {"messages": [{"role": "user", "content": "copy:abc="}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    assert _answer(remote, "/v1/chat/completions", chat) == \
        _answer(local, "/v1/chat/completions", chat)
    for bad in ({"prompt": "x", "max_tokens": 1000},  # over max_model_len: 400 naming it
                {"prompt": "x", "max_tokens": 4, "n": 0}):
        assert _answer(remote, "/v1/completions", bad) == _answer(local, "/v1/completions", bad)


def test_admission_control_runs_in_the_core(servers):
    _, (server, client) = servers
    core = server.async_engine
    configured = core.limits
    core.limits = dataclasses.replace(configured, max_outstanding_tokens=150)
    core.pause()  # the first request is held in flight
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(client.post, "/v1/completions",
                               json={"prompt": PROMPTS[0], "max_tokens": 100})
            deadline = time.monotonic() + 60
            while core.num_live < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            second = pool.submit(client.post, "/v1/completions",
                                 json={"prompt": PROMPTS[1], "max_tokens": 100})
            try:  # refused at once (admitted, it would wait for the resume)
                refused = second.result(timeout=30)
            finally:
                core.resume()
            assert refused.status_code == 429, refused.text
            assert "max_outstanding_tokens (150)" in refused.json()["error"]["message"]
            assert refused.headers["retry-after"] == "1"
            assert held.result(timeout=60).status_code == 200
    finally:
        core.resume()
        core.limits = configured


def _gauge(client, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == f"pagedjax:{name}":
                return sample.value
    raise AssertionError(name)


def test_metrics_hold_the_cores_weights_and_pool(servers):
    """/metrics of the core's server: the weights and the KV pool the core's engine holds,
    as the in-process engine's server reports its own (the same model and pool)."""
    local, (_, remote) = servers
    for name in ("weights_bytes", "kv_cache_pool_bytes"):
        assert _gauge(remote, name) == _gauge(local, name) > 0


def test_disconnected_stream_is_aborted_in_the_core(servers):
    _, (server, client) = servers
    with client.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True,
            "stream": True}) as response:
        next(response.iter_lines())  # the first token, then the client goes away
    deadline = time.time() + 60
    while time.time() < deadline and (server.async_engine.num_live or
                                      _gauge(client, "kv_cache_usage_perc") > 0):
        time.sleep(0.05)
    assert server.async_engine.num_live == 0
    assert _gauge(client, "kv_cache_usage_perc") == 0
    assert _gauge(client, "num_requests_running") == 0
    cancelled = client.get("/metrics").text
    assert 'pagedjax:requests_cancelled_total{model_name="tiny",reason="client_disconnect"} 1.0' \
        in cancelled


def test_killed_core_answers_503_within_a_second():
    core = CoreClient(LLMFactory(DEFAULT_MODEL, engine_kwargs=ENGINE))
    server = OpenAIServer(core, "tiny")
    with TestClient(server.build_app()) as client:
        with client.stream("POST", "/v1/completions", json={
                "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True,
                "stream": True}) as response:
            lines = response.iter_lines()
            next(lines)  # streaming when the core dies
            core.process.kill()
            killed = time.monotonic()
            while ((client.get("/health").status_code == 200 or core.num_live)
                   and time.monotonic() - killed < 5):
                time.sleep(0.02)
            assert time.monotonic() - killed < 1.0  # the stream failed, /health says so
            rest = "\n".join(lines)
        assert "engine core exited" in rest  # the stream ends with the error
        health = client.get("/health")
        assert health.status_code == 503 and "engine core exited" in health.text
        answer = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_dead"


@pytest.mark.slow  # data parallel: make test-slow
def test_a_data_parallel_engine_in_the_core(monkeypatch):
    """The core builds whatever LLM builds: two replicas over two host devices (the core's
    process sees the flag it inherits)."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_force_host_platform_device_count=2")
    core = CoreClient(LLMFactory(DEFAULT_MODEL, engine_kwargs={**ENGINE,
                                                               "data_parallel_size": 2}))
    server = OpenAIServer(core, "tiny")
    with TestClient(server.build_app()) as client:
        answers = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 8,
                                                        "temperature": 0}).json()
                   for p in PROMPTS[:2]]
        metrics = client.get("/metrics").text
    assert [a["choices"][0]["text"] for a in answers] == ["hello", "degap"]
    assert 'replica_num_requests_running{model_name="tiny",replica="1"}' in metrics


def test_a_bad_model_fails_the_start_with_its_message():
    with pytest.raises(ValueError, match="no-such-model"):
        CoreClient(LLMFactory("no-such-model"))


def test_core_exits_when_the_server_process_dies():
    script = ("import time\n"
              "from pagedjax.frontend.core_client import CoreClient\n"
              "from pagedjax.frontend.engine_core import LLMFactory\n"
              f"core = CoreClient(LLMFactory({DEFAULT_MODEL!r}, engine_kwargs={ENGINE!r}))\n"
              "print(core.process.pid, flush=True)\n"
              "time.sleep(600)\n")
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 120)
        assert ready, "the core did not start"
        core = psutil.Process(int(server.stdout.readline()))
        assert core.is_running()
    finally:
        server.kill()  # no shutdown: the core must notice its parent is gone
        server.wait(10)
    try:
        core.wait(timeout=10)  # psutil.TimeoutExpired: the core outlived the server
    finally:
        if core.is_running():
            core.kill()


def _output(request_id, samples, finished, prompt_logprobs=None):
    """A RequestOutput of (token ids, text, finish_reason) samples."""
    return RequestOutput(
        request_id, [1, 2, 3],
        [CompletionOutput(i, list(tokens), reason, -0.5 * len(tokens),
                          [{t: i} for t in tokens], text, None)
         for i, (tokens, text, reason) in enumerate(samples)],
        finished, RequestMetrics(0.0, 0.1, 0.2, 0.3 if finished else None, 0, 0),
        prompt="abc", prompt_logprobs=prompt_logprobs)


def test_deltas_rebuild_the_cumulative_outputs():
    steps = [
        _output("a", [([5], "x", None), ([6], "y", None)], False, [None]),
        _output("a", [([5, 7], "xz", None), ([6, 8], "y", None)], False, [None, {1: 0}]),
        # text not an extension of what was sent; the second sample unchanged this step
        _output("a", [([5, 7, 9], "xq", None), ([6, 8], "y", None)], False, [None, {1: 0}]),
        # best_of: the finished output keeps other samples (sent whole)
        _output("a", [([4, 4, 4, 4], "www", "length"), ([5, 7, 9, 1], "xqr", "stop")], True,
                [None, {1: 0}]),
        _output("b", [([], "", "abort")], True),
    ]
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    for out in steps:
        wire = encoder.encode(out)
        assert decoder.decode(wire) == out
    middle = encoder.encode(steps[0]), encoder.encode(steps[1])
    assert middle[1][2][0][2] == [7] and middle[1][2][0][5] == "z"  # only what is new
    assert middle[1][1] is None  # the prompt went once


def test_delta_outputs_cross_as_they_are_with_the_prompt_once():
    """A DELTA request's outputs (SamplingParams.output_kind) are sent as the engine made them,
    the prompt only with the first; a CUMULATIVE request beside it is delta-encoded as before."""
    import dataclasses
    import pickle

    steps = [
        _output("d", [([5], "x", None)], False, [None, {1: 0}]),
        _output("c", [([6], "y", None)], False),
        _output("d", [([7, 8], "zw", None)], False, []),
        _output("c", [([6, 9], "yv", "stop")], True),
        _output("d", [([], "", "length")], True, []),
    ]
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    encoder.expect_deltas("d")
    wires = [encoder.encode(out) for out in steps]
    for wire, out in zip(wires, steps):
        assert decoder.decode(pickle.loads(pickle.dumps(wire))) == out
    assert wires[0][1] == ([1, 2, 3], "abc", None) and wires[2][1] is None
    assert wires[2][2] == dataclasses.replace(steps[2], prompt_token_ids=[], prompt=None)
    assert wires[3][2][0][2] == [9]  # the cumulative one: only what is new
    assert "d" not in encoder._deltas and not decoder._received  # nothing stays behind


@pytest.mark.slow  # a whole `pagedjax serve` process: make test-slow
def test_a_server_whose_core_dies_exits_for_its_supervisor():
    """Issue 57: a killed core left the server answering 503 for good on its port. It now fails
    what was in flight, stops within seconds and exits with status 1 (a supervisor restarts
    it), freeing the port."""
    import signal
    import socket
    import urllib.request

    from helpers import complete, start_serve, wait_healthy

    proc, url = start_serve("--max-model-len", "128", "--max-num-batched-tokens", "128")
    port = int(url.rsplit(":", 1)[1])
    try:
        wait_healthy(url, [proc])
        assert complete(url, {"prompt": "rev:ab=", "max_tokens": 2})["choices"]
        core = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                    if "resource_tracker" not in " ".join(p.cmdline()))
        core.kill()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert "the engine core died" in out and "engine core exited" in out, out
    with socket.socket() as s:  # the port is free again for a restarted server (as uvicorn binds)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2)
        raise AssertionError("a server still answers")
    except OSError:
        pass
