"""The production checklist's monitoring list on /metrics, against what the engine did:
computed prefill tokens (prefix hits excluded), device memory (the weights and pool the engine
holds, where the backend reports no memory statistics), KV allocation failures and prefix
cache evictions in a pool too small for the load, cancellations by reason."""

from __future__ import annotations

import time

import jax
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_server import ENGINE, PROMPTS

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer


def _samples(client) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[s.name, labels] = s.value
    return samples


def test_prefill_memory_and_cancellations():
    llm = LLM(**ENGINE)
    engine = llm.engine
    server = OpenAIServer(engine, "tiny")
    shared = "copy:" + "paged attention " * 3  # 53 characters: three shared 16-token blocks
    with TestClient(server.build_app()) as client:
        for tail in ("one=", "two=", "three="):
            assert client.post("/v1/completions", json={"prompt": shared + tail,
                                                        "max_tokens": 2}).status_code == 200
        with client.stream("POST", "/v1/completions", json={
                "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True,
                "stream": True}) as response:
            next(response.iter_lines())  # then the client goes away
        deadline = time.time() + 60
        while engine.stats.num_aborted == 0 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the report after the abort
        m = _samples(client)
    received = m["pagedjax:prompt_tokens_total", ()]
    hits = m["pagedjax:prefix_cache_hits_total", ()]
    assert hits == 2 * 48  # the second and third prompts found three blocks each
    assert engine.stats.num_preemptions == 0
    assert m["pagedjax:prompt_tokens_computed_total", ()] == received - hits
    weights = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params))
    pool = engine.num_blocks * engine.bytes_per_block
    assert m["pagedjax:device_memory_used_bytes", (("source", "engine"),)] == weights + pool
    assert m["pagedjax:requests_cancelled_total", (("reason", "client_disconnect"),)] == 1


@pytest.mark.slow  # make test-slow
def test_allocation_failures_and_evictions_in_a_small_pool():
    llm = LLM(**dict(ENGINE, num_blocks=12, block_size=8))  # 11 usable blocks of 8 tokens
    server = OpenAIServer(llm.engine, "tiny")
    prompts = [f"copy:{i} " + "abcdefgh" * 3 + "=" for i in range(6)]  # 32 tokens each
    with TestClient(server.build_app()) as client:
        response = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 24,
                                                         "ignore_eos": True})
        assert response.status_code == 200
        m = _samples(client)
    stats = llm.engine.stats
    assert stats.num_preemptions > 0
    failures = m["pagedjax:kv_allocation_failures_total", ()]
    assert failures == stats.num_allocation_failures >= stats.num_preemptions
    assert m["pagedjax:prefix_cache_evictions_total", ()] == stats.num_evictions > 0


def test_tiers_below_the_device_in_metrics(tmp_path):
    """The tiered prefix cache's series (pagedjax.serving.tier_metrics) follow the engine's
    totals: prompts asked again after a pool too small for them evicted their prefixes are
    served from the host tier and the disk tier."""
    llm = LLM(**dict(ENGINE, num_blocks=12, block_size=8, kv_offload_bytes=4 * 2**14,
                     kv_disk_dir=str(tmp_path), kv_disk_bytes=2**22))
    engine = llm.engine
    server = OpenAIServer(engine, "tiny")
    prompts = [f"copy:{i} " + "abcdefgh" * 3 + "=" for i in range(6)]  # 32 tokens each
    with TestClient(server.build_app()) as client:
        for _ in range(2):
            for prompt in prompts:
                assert client.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": 4}).status_code == 200
        time.sleep(0.2)  # the report after the last step
        m = _samples(client)
    stats = engine.stats
    tiers = stats.kv_tiers
    for tier in ("host", "disk"):
        label = (("tier", tier),)
        assert m["pagedjax:kv_tier_hits_total", label] == tiers[tier]["hits"] > 0, tier
        for direction in ("in", "out"):
            key = (("direction", direction), ("tier", tier))
            assert m["pagedjax:kv_tier_blocks_moved_total", key] == \
                tiers[tier][f"blocks_{direction}"] > 0, (tier, direction)
            assert m["pagedjax:kv_tier_bytes_moved_total", key] == tiers[tier][f"bytes_{direction}"]
        assert 0 < m["pagedjax:kv_tier_usage_perc", label] <= 1
        assert m["pagedjax:kv_tier_capacity_bytes", label] == tiers[tier]["capacity_bytes"]
    assert m["pagedjax:external_prefix_cache_hits_total", ()] == \
        stats.num_prefix_host_hit_tokens > 0
    assert m["pagedjax:prefix_cache_hits_total", ()] == \
        stats.num_prefix_hit_tokens - stats.num_prefix_host_hit_tokens
    assert m["pagedjax:external_prefix_cache_queries_total", ()] == \
        stats.num_prefix_query_tokens - m["pagedjax:prefix_cache_hits_total", ()]
    engine.close()
