"""KV-aware routing: the policy alone (pure bookkeeping), then the router in front of two real
servers (uvicorn, two engines): answers equal the offline engine's, requests sharing a prefix
land on one instance and raise its prefix-cache hits over round robin, failover past a dead
instance, and errors pass through."""

from __future__ import annotations

import socket

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import ROLE_TEMPLATE
from prometheus_client.parser import text_string_to_metric_families

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer
from pagedjax.serving.router import (Backend, RolloutGuard, Router, RoutingPolicy, prompt_chunks,
                                     routing_key)
from pagedjax.serving.routing_keys import request_model

# ---- the policy -------------------------------------------------------------------------------


def _policy(policy="kv_aware", n=2, **kwargs):
    backends = [Backend(f"http://b{i}") for i in range(n)]
    return backends, RoutingPolicy(backends, policy, **kwargs)


def test_chunks_are_chained_prefix_hashes():
    a = prompt_chunks("x" * 64 + "y" * 64 + "z" * 10)
    b = prompt_chunks("x" * 64 + "y" * 64 + "w" * 70)
    assert len(a) == 2 and a == b[:2] and len(b) == 3
    assert prompt_chunks("y" * 64 + "x" * 64)[1] != a[1]  # same chunk, other prefix
    assert prompt_chunks(list(range(40))) == prompt_chunks(list(range(32)))  # 16 ids a chunk
    assert prompt_chunks("short") == []


def test_kv_aware_follows_prefixes_and_spreads_new_ones():
    backends, policy = _policy()
    a, b = prompt_chunks("A" * 256), prompt_chunks("B" * 256)
    first, _ = policy.choose(a)
    policy.record(first, a)
    second, matched = policy.choose(b)  # no match: the backend with the emptier index
    assert second is not first and matched == 0
    policy.record(second, b)
    for _ in range(3):
        assert policy.choose(a) == (first, 4)
        assert policy.choose(prompt_chunks("B" * 256 + "tail" * 20))[0] is second


def test_kv_aware_yields_to_load_imbalance_and_min_match():
    backends, policy = _policy(balance_abs=2, balance_rel=1.5, min_match=0.5)
    a = prompt_chunks("A" * 256)
    policy.record(backends[0], a)
    backends[0].in_flight, backends[1].in_flight = 3, 0  # 3 - 0 > 2 and 3 > 1.5 * 0
    assert policy.choose(a)[0] is backends[1]  # out of balance: the least loaded
    backends[0].in_flight, backends[1].in_flight = 10, 7  # 3 > 2 but 10 < 1.5 * 7
    assert policy.choose(a) == (backends[0], 4)  # in balance: affinity
    backends[0].in_flight, backends[1].in_flight = 2, 0  # 2 is not > 2
    assert policy.choose(a) == (backends[0], 4)
    backends[0].in_flight = 0
    longer = prompt_chunks("A" * 64 + "C" * 256)  # matches 1 of 5 chunks, under min_match
    assert policy.choose(longer) == (backends[1], 0)  # the emptier index


def test_round_robin_least_loaded_and_dead_backends():
    backends, policy = _policy("round_robin", n=3)
    picks = [policy.choose([])[0] for _ in range(6)]
    assert picks[:3] == picks[3:] and len(set(map(id, picks))) == 3
    backends, policy = _policy("least_loaded", n=3)
    backends[0].in_flight, backends[1].in_flight, backends[2].in_flight = 2, 0, 1
    assert policy.choose([])[0] is backends[1]
    backends[1].down_until = 1e18
    assert policy.choose([])[0] is backends[2]
    assert policy.choose([], exclude=[backends[2]])[0] is backends[0]
    with pytest.raises(LookupError):
        policy.choose([], exclude=[backends[0], backends[2]])


def test_index_is_a_bounded_lru():
    backends, policy = _policy(index_capacity=4)
    policy.record(backends[0], [1, 2, 3])
    policy.record(backends[0], [1, 4, 5])  # 1 used again: 2 is now the oldest
    assert list(backends[0].index) == [3, 1, 4, 5]


def test_bad_router_settings_are_refused():
    with pytest.raises(ValueError, match="policy"):
        RoutingPolicy([Backend("http://a")], "random")
    with pytest.raises(ValueError, match="backend"):
        RoutingPolicy([], "kv_aware")
    with pytest.raises(ValueError, match="min_match"):
        RoutingPolicy([Backend("http://a")], min_match=2)
    with pytest.raises(ValueError, match="http"):
        Router(["localhost:8000"])
    with pytest.raises(ValueError, match="distinct"):
        Router(["http://a", "http://a/"])


def test_routing_keys():
    assert routing_key("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_key("/v1/completions", {"prompt": [[1, 2], [3]]}) == [1, 2]
    assert routing_key("/v1/completions", {"prompt": 5}) is None
    chat = routing_key("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": [
            {"type": "text", "text": "U"}]}]})
    turn = routing_key("/v1/chat/completions", {"messages": [{"role": "system",
                                                              "content": "S"}]})
    assert chat.startswith(turn)
    # LoRA adapters (issue 53): one prompt under two models shares no chunk; under one, all
    prompt = "shared context " * 20
    one, two = (prompt_chunks(prompt, model=m) for m in ("sql-lora", "chat-lora"))
    assert len(one) == 4 and not set(one) & set(two)
    assert prompt_chunks(prompt, model="sql-lora") == one != prompt_chunks(prompt)
    assert request_model({"model": "sql-lora"}) == "sql-lora"
    assert request_model({"model": 3}) is None and request_model([]) is None


# ---- the router in front of two servers -------------------------------------------------------

ENGINE = dict(max_model_len=384, max_num_seqs=8, max_num_batched_tokens=128)


def _prefix(name: str) -> str:
    """A 192-character shared context (3 routing chunks, 12 KV blocks)."""
    return (f"context {name}: " + "the quick brown fox jumps over the lazy dog. " * 5)[:192]


@pytest.fixture(scope="module")
def backends():
    llms = [LLM(**ENGINE), LLM(**ENGINE)]
    servers = [OpenAIServer(llm.engine, "tiny", chat_template=ROLE_TEMPLATE) for llm in llms]
    with BackgroundServer(servers[0].build_app()) as a, \
            BackgroundServer(servers[1].build_app()) as b:
        yield llms, [a, b]


def _hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pagedjax:prefix_cache_hits_total")


def _post(client, prompt, **extra):
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response


def test_router_answers_like_a_server_and_follows_prefixes(backends):
    _, urls = backends
    router = Router(urls, "kv_aware")
    prompts = [_prefix(name) + f" question {i}=" for name in "AB" for i in range(3)]
    with TestClient(router.build_app()) as client:
        before = sum(_hits(u) for u in urls)
        responses = [_post(client, p) for p in prompts]
        kv_hits = sum(_hits(u) for u in urls) - before
        where = [r.headers["x-pagedjax-backend"] for r in responses]
        assert where[0] == where[1] == where[2] and where[3] == where[4] == where[5]
        assert where[0] != where[3]
        # The answers the instance gives when asked directly.
        for prompt, response, url in zip(prompts, responses, where):
            direct = httpx.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60).json()
            assert response.json()["choices"] == direct["choices"]
        streamed = client.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 4,
                                                        "temperature": 0, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")
        metrics = {s.name: s.value for f in text_string_to_metric_families(
            client.get("/metrics").text) for s in f.samples}
        # 3 chunks a prompt: the 2nd and 3rd of each prefix matched, and the stream's.
        assert metrics["pagedjax_router:matched_chunks_total"] == 2 * (0 + 3 + 3) + 3
        # Errors an instance answers pass through as they are.
        bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert client.post("/v1/completions", content=b"{oops").status_code == 400
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    # Round robin over other prefixes: the same requests find fewer cached blocks.
    router = Router(urls, "round_robin")
    prompts = [_prefix(name) + f" question {i}=" for name in "CD" for i in range(3)]
    with TestClient(router.build_app()) as client:
        before = sum(_hits(u) for u in urls)
        for p in prompts:
            _post(client, p)
        rr_hits = sum(_hits(u) for u in urls) - before
    assert kv_hits > rr_hits


def test_router_fails_over_past_a_dead_backend(backends):
    _, urls = backends
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once this block ends
    router = Router([dead, urls[0]], "round_robin", retry_after_s=60)
    with TestClient(router.build_app()) as client:
        for i in range(3):
            assert _post(client, f"copy:{i}=").headers["x-pagedjax-backend"] == urls[0]
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["backends"] == {dead: False,
                                                                            urls[0]: True}
        text = client.get("/metrics").text
        assert f'pagedjax_router:failovers_total{{backend="{dead}"}} 1.0' in text
    router = Router([dead], "kv_aware")
    with TestClient(router.build_app()) as client:
        response = client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_backend"
        assert client.get("/health").status_code == 503


# ---- safe rollout -----------------------------------------------------------------------------


def test_guard_splits_exactly_and_rolls_back_on_errors():
    guard = RolloutGuard(0.25, window=50, min_requests=8, max_error_delta=0.1)
    picks = [guard.to_canary() for _ in range(100)]
    assert sum(picks) == 25 and picks[:8] == [False, False, False, True] * 2
    for _ in range(20):
        guard.record("stable", True, 0.1)
    for i in range(7):  # one error in seven: under min_requests, not judged yet
        guard.record("canary", i != 0, 0.1)
    assert guard.state == "canary"
    guard.record("canary", True, 0.1)  # 1/8 = 12.5% > 0% + 10%
    assert guard.state == "rolled_back" and "error rate 12.5%" in guard.reason
    assert guard.weight == 0 and not any(guard.to_canary() for _ in range(10))
    guard.set_weight(0.5)  # re-armed, with a clean canary window
    assert guard.state == "canary" and guard.stats("canary").requests == 0


def test_guard_rolls_back_on_latency_but_not_on_noise():
    guard = RolloutGuard(0.5, window=100, min_requests=10, max_latency_ratio=2.0)
    for _ in range(10):
        guard.record("stable", True, 0.100)
    for _ in range(10):
        guard.record("canary", True, 0.150)  # 1.5x: within the limit
    assert guard.state == "canary"
    for _ in range(20):
        guard.record("canary", True, 0.500)
    assert guard.state == "rolled_back" and "median latency" in guard.reason
    for bad in ({"window": 0}, {"min_requests": 0}, {"min_requests": 300},
                {"max_error_delta": 2}, {"max_latency_ratio": 0.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RolloutGuard(0.1, **bad)
    with pytest.raises(ValueError, match="weight"):
        RolloutGuard(1.5)


@pytest.fixture(scope="module")
def broken_backend():
    """A real server whose device step fails: every request gets a 5xx."""
    llm = LLM(**ENGINE)

    def step(plan):
        raise RuntimeError("bad build")

    llm.engine.runner.dispatch_forward = step
    with BackgroundServer(OpenAIServer(llm.engine, "tiny").build_app()) as url:
        yield url


def test_failing_canary_is_rolled_back_and_clients_never_see_it(backends, broken_backend):
    _, urls = backends
    router = Router([urls[0]], "kv_aware", canary=[broken_backend], canary_weight=0.5,
                    guard=dict(window=20, min_requests=3), admin_key="ops")
    admin = {"Authorization": "Bearer ops"}
    with TestClient(router.build_app()) as client:
        served_by = [_post(client, f"copy:{i}=").headers["x-pagedjax-backend"]
                     for i in range(10)]
        assert set(served_by) == {urls[0]}  # the canary's 503s were resent to stable
        assert client.get("/router/status").status_code == 401
        status = client.get("/router/status", headers=admin).json()
        canary = status["canary"]
        assert canary["state"] == "rolled_back" and "error rate 100.0%" in canary["reason"]
        assert canary["canary"]["requests"] == 3  # judged after min_requests, then no more
        text = client.get("/metrics").text
        assert "pagedjax_router:canary_retries_total 3.0" in text
        assert 'pagedjax_router:responses_total{group="canary",outcome="error"} 3.0' in text
        assert "pagedjax_router:canary_weight 0.0" in text
        bad = client.post("/router/canary", json={"weight": 2}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight"


def test_healthy_canary_ramps_and_is_promoted(backends):
    _, urls = backends
    router = Router([urls[0]], "round_robin", canary=[urls[1]], canary_weight=0.5,
                    guard=dict(window=20, min_requests=3, max_latency_ratio=100),
                    admin_key="ops")
    admin = {"Authorization": "Bearer ops"}
    with TestClient(router.build_app()) as client:
        served_by = [_post(client, f"rev:{i}=").headers["x-pagedjax-backend"]
                     for i in range(6)]
        assert served_by == [urls[0], urls[1]] * 3
        status = client.get("/router/status", headers=admin).json()
        assert status["canary"]["state"] == "canary"
        assert client.post("/router/canary", json={"weight": 1.0},
                           headers=admin).status_code == 200
        assert {_post(client, "x").headers["x-pagedjax-backend"] for _ in range(3)} \
            == {urls[1]}
        status = client.post("/router/promote", headers=admin).json()
        assert [b["url"] for b in status["backends"]] == [urls[1]]
        assert status["canary"]["state"] == "off"
        assert _post(client, "y").headers["x-pagedjax-backend"] == urls[1]
        assert client.post("/router/promote", headers=admin).status_code == 400  # none left


def test_admin_endpoints_exist_only_with_a_key(backends):
    _, urls = backends
    router = Router([urls[0]], "round_robin", canary=[urls[1]], canary_weight=0.5)
    with TestClient(router.build_app()) as client:
        for path in ("/router/canary", "/router/promote", "/router/rollback"):
            response = client.post(path, json={"weight": 1})
            assert response.status_code == 404, path
            assert response.json()["error"]["type"] == "not_found_error"
        assert client.get("/router/status").status_code == 404
        assert router.guard.weight == 0.5 and "canary" in router.groups


def test_router_refuses_hostile_bodies_with_400(backends):
    """Bodies no parser should trust get a 400 from the router itself (never a 500), and bodies
    that parse but are wrong reach a backend, whose 400 comes back; the router serves on."""
    _, urls = backends
    router = Router(urls, "kv_aware", max_request_bytes=2**16)
    json_header = {"content-type": "application/json"}
    with TestClient(router.build_app()) as client:
        for raw in (b'{"prompt": "ab\xff"}', b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}",
                    b"[" * 10_000 + b"]" * 10_000, b"[1, 2]", b"", b'{"prompt": '):
            response = client.post("/v1/completions", content=raw, headers=json_header)
            assert response.status_code == 400, (raw[:40], response.text[:200])
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
        response = client.post("/v1/chat/completions", json=parts)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        odd = {"messages": [{"role": ["x"], "content": {"a": 1}}, 7]}
        assert client.post("/v1/chat/completions", json=odd).status_code == 400
        big = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * 2**17 + b'"}')
        assert big.status_code == 413
        assert client.get("/v1/nowhere").status_code == 404
        assert client.get("/v1/completions").json()["error"]["type"] == "invalid_request_error"
        _post(client, "copy:ab=")


def test_router_cli_sizes_each_instances_picture(monkeypatch):
    """--index-capacity (what an instance's prefix cache holds with its tiers) reaches every
    group's policy."""
    import argparse

    from pagedjax.serving import router as router_module
    from pagedjax.tools import serve_commands

    built = []

    def fake_run(urls, policy, host, port, log_level, **kwargs):
        built.append(router_module.Router(urls, policy, **kwargs))

    monkeypatch.setattr(router_module, "run_router", fake_run)
    parser = argparse.ArgumentParser()
    serve_commands.router_args(parser)
    args = parser.parse_args(["--backend", "http://a:1", "--backend", "http://b:1",
                              "--canary", "http://c:1", "--index-capacity", "7"])
    serve_commands.router(args, parser)
    (router,) = built
    assert {name: group.index_capacity for name, group in router.groups.items()} == {
        "stable": 7, "canary": 7}
