"""deploy/grafana.json queries only what a server's /metrics exports: every pagedjax: series in
every panel's expression is a family of the live registry, with the suffix its type gives."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_server import ENGINE

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana.json"
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
               "prompt_lookup_max": 2}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def queried_series(dashboard: dict) -> set[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [var["query"]["query"] for var in dashboard["templating"]["list"]
              if isinstance(var.get("query"), dict)]
    return {name for expr in exprs for name in re.findall(r"pagedjax:[A-Za-z0-9_]+", expr)}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    llm = LLM(**ENGINE, speculative_config=SPECULATIVE)  # its series appear once it drafts
    server = OpenAIServer(llm.engine, "tiny")
    with TestClient(server.build_app()) as client:
        client.post("/v1/completions", json={"prompt": "copy:ab=", "max_tokens": 3})
        client.post("/v1/completions", json={"prompt": "abababababab", "max_tokens": 8})
        assert llm.engine.stats.num_spec_drafts  # the prompt repeats: n-gram drafts
        text = client.get("/metrics").text
    names = set()
    for family in text_string_to_metric_families(text):
        base = family.name.removesuffix("_total") if family.type == "counter" else family.name
        names.update(base + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def test_every_queried_series_is_exported(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    queried = queried_series(dashboard)
    assert len(queried) >= 20  # the dashboard's panels, not an empty file
    assert queried <= exported, sorted(queried - exported)


def test_the_vllm_latency_histograms_are_on_the_dashboard():
    queried = queried_series(json.loads(DASHBOARD.read_text()))
    for name in ("inter_token_latency_seconds", "time_to_first_token_seconds",
                 "e2e_request_latency_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "iteration_tokens_total"):
        assert f"pagedjax:{name}_bucket" in queried, name


def test_the_checklist_metrics_are_on_the_dashboard():
    """The production checklist's monitoring list: memory, OOMs, allocation failures, evictions,
    computed prefill tokens, cancellations."""
    queried = queried_series(json.loads(DASHBOARD.read_text()))
    for name in ("device_memory_used_bytes", "device_memory_limit_bytes", "oom_errors_total",
                 "kv_allocation_failures_total", "prefix_cache_evictions_total",
                 "prompt_tokens_computed_total", "requests_cancelled_total",
                 "num_preemptions_total", "kv_cache_usage_perc", "degradation_level",
                 "serving_config_info"):
        assert f"pagedjax:{name}" in queried, name


def test_the_speculative_decoding_metrics_are_on_the_dashboard(exported):
    """vLLM's spec_decode counters, exported and charted."""
    queried = queried_series(json.loads(DASHBOARD.read_text()))
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"pagedjax:{name}" in queried and f"pagedjax:{name}" in exported, name
    for name in ("spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length"):
        assert f"pagedjax:{name}" in exported, name
