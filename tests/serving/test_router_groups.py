"""The router's instance groups on real servers (uvicorn on 127.0.0.1): long-context requests
land on their own group (and only they do), and a canary rolled back under load loses no request
in flight: those on the canary finish there, the next ones go to the stable group."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from test_server import ENGINE

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer
from pagedjax.serving.router import Router, prompt_tokens

ADMIN = {"Authorization": "Bearer ops"}
SHORT = "copy:abc="
LONG = "copy:" + "long context " * 8 + "="  # 110 characters: ~27 tokens by the estimate


@pytest.fixture(scope="module")
def instances():
    """stable, canary (slowed: its requests stay in flight) and long-context servers."""
    llms = [LLM(**ENGINE) for _ in range(3)]
    forward = llms[1].engine.runner.dispatch_forward

    def slowed(plan):
        time.sleep(0.05)
        return forward(plan)

    llms[1].engine.runner.dispatch_forward = slowed
    servers = [OpenAIServer(llm.engine, name) for llm, name in
               zip(llms, ("stable", "canary", "long"))]
    with BackgroundServer(servers[0].build_app()) as stable, \
            BackgroundServer(servers[1].build_app()) as canary, \
            BackgroundServer(servers[2].build_app()) as long:
        yield stable, canary, long


def _router(instances, **kwargs):
    stable, canary, long = instances
    router = Router([stable], canary=[canary], long_context=[long], long_context_threshold=20,
                    admin_key="ops", **kwargs)
    return router, BackgroundServer(router.build_app())


def test_long_context_requests_land_on_their_group(instances):
    stable, canary, long = instances
    assert prompt_tokens(LONG) > 20 >= prompt_tokens(SHORT)
    router, background = _router(instances, canary_weight=0.5)
    with background as url, httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(4):
            for prompt, where in ((LONG, {long}), (SHORT, {stable, canary})):
                response = client.post("/v1/completions", json={"prompt": prompt,
                                                                "max_tokens": 2})
                assert response.status_code == 200
                assert response.headers["x-pagedjax-backend"] in where
        ids = client.post("/v1/completions", json={"prompt": list(range(1, 30)),
                                                   "max_tokens": 2})
        assert ids.headers["x-pagedjax-backend"] == long  # 29 token ids, counted exactly
        status = client.get("/router/status", headers=ADMIN).json()
        assert {b["group"] for b in status["backends"]} == {"stable", "canary", "long_context"}
        assert client.post("/router/promote", headers=ADMIN).status_code == 200
        again = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
        assert again.headers["x-pagedjax-backend"] == long  # promotion keeps the group


def test_canary_rollback_under_load_loses_no_request(instances):
    stable, canary, _ = instances
    router, background = _router(instances, canary_weight=1.0)
    body = {"prompt": SHORT, "max_tokens": 12, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    with background as url, httpx.Client(base_url=url, timeout=120) as client, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        in_flight = [pool.submit(client.post, "/v1/completions", json=body) for _ in range(4)]
        deadline = time.monotonic() + 60
        while sum(b.in_flight for b in router.backends) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        back = client.post("/router/rollback", headers=ADMIN)
        assert back.status_code == 200 and back.json()["canary"]["weight"] == 0
        after = [pool.submit(client.post, "/v1/completions", json=body) for _ in range(2)]
        for futures, where in ((in_flight, canary), (after, stable)):
            for f in futures:
                response = f.result(timeout=120)
                assert response.status_code == 200
                assert response.headers["x-pagedjax-backend"] == where
                events = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 12
