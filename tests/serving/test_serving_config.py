"""Versioned serving configurations: files parsed strictly, the active version on /v1/models and
/metrics, a new version applied live and rolled back under load on a real server (uvicorn on
127.0.0.1) without losing a request: each keeps the settings it was admitted under."""

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
from pagedjax.serving.serving_config import ServingConfig
from pagedjax.tools.cli import main as cli_main

V1 = {"version": "v1", "engine": ENGINE, "server": {"max_tokens_cap": 12}}
V2 = {"version": "v2", "engine": ENGINE, "server": {"max_tokens_cap": 3,
                                                    "max_concurrent_requests": 64}}
ADMIN = {"Authorization": "Bearer ops"}


def test_files_are_parsed_strictly(tmp_path):
    path = tmp_path / "v1.yaml"
    path.write_text("version: v1\nengine: {max_model_len: 128}\nserver:\n  kv_overcommit: 1.5\n"
                    "  degradation: {itl_p99_s: 0.2}\n")
    config = ServingConfig.load(path)
    assert config.admission.kv_overcommit == 1.5 and config.degradation.itl_p99_s == 0.2
    assert ServingConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad, message in (({"engine": {}}, "version is required"),
                         ({**V1, "servre": {}}, r"unknown key\(s\) \['servre'\]"),
                         ({**V1, "server": {"max_token_cap": 3}}, "max_token_cap"),
                         ({**V1, "server": {"degradation": {"itl": 1}}}, "degradation key"),
                         ({**V1, "engine": {"max_model_len": -1}}, "engine: max_model_len"),
                         ({**V1, "server": {"kv_overcommit": 0}}, "server: kv_overcommit")):
        with pytest.raises(ValueError, match=message):
            ServingConfig.from_dict(bad)
    with pytest.raises(SystemExit):
        cli_main(["serve", "--config", str(path), "--max-num-seqs", "4"])


def _complete(client, max_tokens):
    return client.post("/v1/completions", json={"prompt": "copy:abcdef=", "max_tokens": max_tokens,
                                                "ignore_eos": True, "stream": True,
                                                "return_token_ids": True})


def test_a_version_applied_and_rolled_back_under_load_loses_no_request():
    llm = LLM(**ENGINE)
    forward = llm.engine.runner.dispatch_forward

    def slowed(plan):  # requests stay in flight while the versions change
        time.sleep(0.03)
        return forward(plan)

    llm.engine.runner.dispatch_forward = slowed
    server = OpenAIServer(llm.engine, "tiny", config=ServingConfig.from_dict(V1),
                          admin_key="ops")
    with BackgroundServer(server.build_app()) as url, httpx.Client(base_url=url,
                                                                   timeout=120) as client, \
            concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert client.get("/v1/models").json()["data"][0]["config_version"] == "v1"
        under_v1 = [pool.submit(_complete, client, 10) for _ in range(4)]
        deadline = time.monotonic() + 60
        while server.async_engine.num_live < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.post("/admin/config", json=V2).status_code == 401  # no key
        applied = client.post("/admin/config", json=V2, headers=ADMIN)
        assert applied.status_code == 200 and applied.json()["versions"] == ["v1", "v2"]
        under_v2 = [pool.submit(_complete, client, 10) for _ in range(4)]
        while server.async_engine.num_live < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        models = client.get("/v1/models").json()["data"][0]
        metrics = client.get("/metrics").text
        back = client.post("/admin/config/rollback", headers=ADMIN)
        assert back.status_code == 200 and back.json()["active"]["version"] == "v1"
        after = [pool.submit(_complete, client, 10) for _ in range(2)]
        for futures, want in ((under_v1, 10), (under_v2, 3), (after, 10)):
            for f in futures:
                response = f.result(timeout=120)
                assert response.status_code == 200
                events = [json.loads(line[6:]) for line in response.text.splitlines()
                          if line.startswith("data: {")]
                assert events[-1]["choices"][0]["finish_reason"] == "length"
                assert sum(len(e["choices"][0]["token_ids"]) for e in events) == want
        assert models["config_version"] == "v2"
        assert 'pagedjax:serving_config_info{model_name="tiny",version="v2"} 1.0' in metrics
        assert client.get("/v1/models").json()["data"][0]["config_version"] == "v1"
        changed = client.post("/admin/config", headers=ADMIN, json={
            "version": "v3", "engine": {**ENGINE, "max_model_len": 64}})
        assert changed.status_code == 409 and "engine.max_model_len" in changed.text
        first = client.post("/admin/config/rollback", headers=ADMIN)
        assert first.status_code == 409 and "nothing to roll back to" in first.text
