"""The server when something goes wrong: a request failing inside a step fails alone, an
internal error answers 500 with a request id while the engine serves on, a chat without a
template is refused and changes nothing, --chat-template reads a file or a template, and a
shut-down engine answers 503."""

from __future__ import annotations

import concurrent.futures
import time

import jax
import pytest
from fastapi.testclient import TestClient
from helpers import ROLE_TEMPLATE
from test_server import ENGINE, PROMPTS

from pagedjax import LLM, SamplingParams
from pagedjax.serving.app import OpenAIServer


def test_request_failing_inside_a_step_fails_alone():
    """A step that raises for one request's rows: that request answers 500 with its error, the
    one batched with it is served as if alone, the engine keeps serving and frees every block."""
    llm = LLM(**ENGINE)
    step = llm.engine.runner.dispatch_forward  # where every step's plan reaches the device
    poison = 7  # the tokenizer's id for the BEL byte, which no other prompt holds

    def flaky(plan):
        if poison in plan.token_ids[:int(plan.cu_q_lens[int(plan.num_seqs)])]:
            raise RuntimeError("kernel fault")
        return step(plan)

    expected = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0),
                            use_tqdm=False)[0].text
    llm.engine.runner.dispatch_forward = flaky
    server = OpenAIServer(llm.engine, "tiny")
    with TestClient(server.build_app()) as client:
        server.async_engine.pause()  # both requests land in the same first step
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bad = pool.submit(client.post, "/v1/completions",
                              json={"prompt": "copy:\x07=", "max_tokens": 8})
            good = pool.submit(client.post, "/v1/completions",
                               json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
            deadline = time.time() + 30
            while server.async_engine.num_live < 2 and time.time() < deadline:
                time.sleep(0.01)
            server.async_engine.resume()
            bad, good = bad.result(timeout=60), good.result(timeout=60)
        assert bad.status_code == 500, bad.text
        assert "kernel fault" in bad.json()["error"]["message"]
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == expected
        assert client.get("/health").status_code == 200
        assert llm.engine.stats.num_failed == 1
        assert llm.engine.scheduler.kv_manager.num_used_blocks == 0


def test_internal_errors_answer_500_with_a_request_id_and_the_engine_serves_on(caplog, monkeypatch):
    """A handler bug answers 500 with a request id (logged with its traceback); a step that
    loses the KV cache itself fails the requests it held, and the engine starts over with a
    fresh cache and serves the next request right."""
    llm = LLM(**ENGINE)
    expected = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0),
                            use_tqdm=False)[0].text
    server = OpenAIServer(llm.engine, "tiny")
    step = llm.engine.runner.dispatch_forward
    lost = []

    def loses_the_cache(plan):
        if not lost:
            lost.append(1)
            for leaf in jax.tree.leaves(llm.engine.runner.kv_cache):
                leaf.delete()
            raise RuntimeError("device reset")
        return step(plan)

    with TestClient(server.build_app(), raise_server_exceptions=False) as client:
        def broken_template(*args):
            raise KeyError("a bug")

        monkeypatch.setattr("pagedjax.serving.chat.render_prompt", broken_template)
        with caplog.at_level("ERROR", logger="pagedjax.http"):
            response = client.post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 500
        request_id = response.headers["x-request-id"]
        assert request_id in response.json()["error"]["message"]
        assert "a bug" not in response.text  # the traceback goes to the log only
        assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
        llm.engine.runner.dispatch_forward = loses_the_cache
        failed = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
        assert failed.status_code == 500 and "device reset" in failed.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        again = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8,
                                                     "temperature": 0})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
        assert llm.engine.scheduler.kv_manager.num_used_blocks == 0


def test_chat_without_a_chat_template_is_refused_and_changes_nothing():
    """The embedded model's tokenizer has no chat template: chat answers 400 (vLLM does the
    same) instead of rendering a made-up one; a template passed to the server is used."""
    llm = LLM(**ENGINE)
    assert llm.tokenizer.chat_template is None
    server = OpenAIServer(llm.engine, "tiny")
    with TestClient(server.build_app()) as client:
        response = client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and "no chat template" in error["message"]
        assert "--chat-template" in error["message"]
    assert not llm.engine.has_unfinished() and llm.engine.stats.num_finished == 0
    with pytest.raises(ValueError, match="chat_template does not compile"):
        OpenAIServer(llm.engine, "tiny", chat_template="{% if %}")
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                            chat_template=ROLE_TEMPLATE, tokenize=True)
    assert llm.tokenizer.decode(ids) == "user: hi\nassistant: "


def test_chat_template_flag_reads_a_file_or_a_template(tmp_path):
    from pagedjax.text.tokenizer import read_chat_template
    path = tmp_path / "t.jinja"
    path.write_text(ROLE_TEMPLATE)
    assert read_chat_template(str(path)) == ROLE_TEMPLATE == read_chat_template(ROLE_TEMPLATE)
    with pytest.raises(ValueError, match="neither a file, a Jinja template nor a shipped one"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        read_chat_template("{{ messages[ }}")


def test_shut_down_engine_answers_503():
    llm = LLM(**ENGINE)
    server = OpenAIServer(llm.engine, "tiny")
    with TestClient(server.build_app()) as client:
        server.async_engine.shutdown()
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_dead"
        assert client.get("/health").status_code == 503


def test_a_failing_step_report_is_logged_and_the_engine_serves_on(caplog):
    """Metrics, the trace and degradation observe each step; an error there is the observer's,
    logged with its traceback, not the engine's end."""
    llm = LLM(**ENGINE)
    server = OpenAIServer(llm.engine, "tiny")
    on_step, failed = server.metrics.on_step, []

    def broken(info):
        if not failed:
            failed.append(1)
            raise ValueError("a metrics bug")
        on_step(info)

    server.metrics.on_step = broken
    with TestClient(server.build_app()) as client, \
            caplog.at_level("ERROR", logger="pagedjax.engine"):
        response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
        assert response.status_code == 200
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json={"prompt": PROMPTS[1],
                                                    "max_tokens": 4}).status_code == 200
    assert failed and any("a step report failed" in r.getMessage() and r.exc_info
                          for r in caplog.records)
