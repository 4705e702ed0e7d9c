"""Training to serving over HTTP (issue 52: pagedjax/serving/weight_routes.py), a real server on
127.0.0.1: behind the admin key; POST /update_weights with a checkpoint path while a stream is
in flight (mode wait: the stream ends on the old weights, the next request is answered with the
new ones, as a fresh engine from that checkpoint answers it); pause / resume / is_paused;
reset_prefix_cache; bad bodies and bad checkpoints refused by name, nothing changed."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time

import httpx
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.models import get_config, init_model
from pagedjax.models.loading.checkpoint import save_checkpoint
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer

ENGINE = dict(tokenizer="byte", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=4, num_blocks=64)
ADMIN = {"Authorization": "Bearer ops"}
PROMPT = "weights over http "


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    old, new = init_model(config, seed=1), init_model(config, seed=2)
    path = str(tmp_path_factory.mktemp("next") / "ckpt")
    save_checkpoint(new, path)
    return old, new, path


def tokens_of(model, max_tokens: int) -> list[int]:
    out = LLM(model, **ENGINE).generate(
        [PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False)
    return out[0].outputs[0].token_ids


def stream(client, max_tokens: int) -> list[dict]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: {")]


def test_update_weights_over_http_waits_for_the_stream_in_flight(models):
    old, new, path = models
    expected_old, expected_new = tokens_of(old, 40), tokens_of(new, 8)
    llm = LLM(old, **ENGINE)
    forward = llm.engine.runner.dispatch_forward

    def slowed(plan, previous=None):  # the stream stays in flight while the update is asked
        time.sleep(0.02)
        return forward(plan, previous)

    llm.engine.runner.dispatch_forward = slowed
    server = OpenAIServer(llm.engine, "tiny", admin_key="ops")
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=120) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert client.post("/update_weights", json={"path": path}).status_code == 401
        in_flight = pool.submit(stream, client, 40)
        deadline = time.monotonic() + 60
        while server.async_engine.num_live < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        first = pool.submit(client.post, "/update_weights", headers=ADMIN,
                            json={"path": path, "version": "step-1"})
        time.sleep(0.1)  # the first is draining: the stream has ~0.7 s to go
        second = client.post("/update_weights", headers=ADMIN,
                             json={"path": path, "version": "step-2"})
        assert second.status_code == 409 and second.json()["error"]["code"] == \
            "update_in_progress"
        updated = first.result(timeout=120)
        assert updated.status_code == 200 and updated.json() == {"weight_version": "step-1"}
        chunks = in_flight.result(timeout=120)
        got = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
        assert got == expected_old  # finished on the old weights, all 40 tokens
        after = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert after.json()["choices"][0]["token_ids"] == expected_new
        info = client.get("/weight_info", headers=ADMIN).json()
        assert info == {"weight_version": "step-1", "is_paused": False, "is_sleeping": False}
        assert 'pagedjax:weight_version_info{model_name="tiny",version="step-1"} 1.0' in \
            client.get("/metrics").text


def test_pause_resume_reset_and_refusals(models):
    old, _, path = models
    llm = LLM(old, **ENGINE)
    server = OpenAIServer(llm.engine, "tiny", admin_key="ops")
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=60) as client:
        assert client.post("/pause", headers=ADMIN, json={"mode": "keep"}).json()[
            "is_paused"] is True
        assert client.get("/is_paused", headers=ADMIN).json() == {"is_paused": True}
        assert client.post("/resume", headers=ADMIN).json()["is_paused"] is False
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}
                           ).status_code == 200
        assert client.post("/reset_prefix_cache", headers=ADMIN).json() == {"reset": True}
        asleep = client.post("/sleep", headers=ADMIN, json={"level": 1})
        assert asleep.status_code == 200 and asleep.json()["is_sleeping"] is True
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_asleep"
        assert client.post("/sleep", headers=ADMIN, json={"level": 3}).json()["error"][
            "param"] == "level"
        assert client.post("/wake_up", headers=ADMIN, json={}).json()["is_sleeping"] is False
        assert client.get("/is_sleeping", headers=ADMIN).json() == {"is_sleeping": False}
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}
                           ).status_code == 200
        for body, param in (({"path": path, "mode": "later"}, "mode"),
                            ({"path": path, "timeout_s": 0}, "timeout_s"),
                            ({"path": path, "extra": 1}, "extra"),
                            ({"path": "/nonexistent/ckpt"}, "path")):
            response = client.post("/update_weights", headers=ADMIN, json=body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["param"] == param, response.json()
        assert client.get("/weight_info", headers=ADMIN).json()["weight_version"] == "0"


@pytest.mark.slow  # `pagedjax serve` with its engine core process: make test-slow
def test_the_engine_core_process_takes_new_weights(models, tmp_path):
    """The default server: its engine runs in a process of its own, which reads the checkpoint
    and takes the weights in place when told over its channel."""
    import signal

    from helpers import complete, start_serve, wait_healthy

    old, new, path = models
    save_checkpoint(old, str(tmp_path / "old"), metadata={"tokenizer": "byte"})
    proc, url = start_serve(str(tmp_path / "old"), "--admin-key", "ops",
                            "--max-model-len", "96", "--max-num-batched-tokens", "32",
                            "--block-size", "4", "--num-blocks", "64")
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    try:
        wait_healthy(url, [proc])
        assert complete(url, body)["choices"][0]["token_ids"] == tokens_of(old, 8)
        with httpx.Client(base_url=url, timeout=120) as client:
            updated = client.post("/update_weights", headers=ADMIN,
                                  json={"path": path, "version": "core-1"})
            assert updated.status_code == 200, updated.text
            assert client.get("/weight_info", headers=ADMIN).json()["weight_version"] == "core-1"
        assert complete(url, body)["choices"][0]["token_ids"] == tokens_of(new, 8)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
