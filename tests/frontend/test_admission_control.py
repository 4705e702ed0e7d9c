"""Admission control's rules on a real server (uvicorn on 127.0.0.1): with requests held live
(the engine paused), each rule refuses the request that breaks it with 429, its reason on
/metrics, and queues nothing; the request that keeps within the rule is admitted."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from test_server import ENGINE

from pagedjax import LLM
from pagedjax.frontend.admission_control import AdmissionLimits
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer

LONG = "copy:" + "x" * 40 + "="  # 47 tokens with BOS
SHORT = "copy:ab="
REFUSAL_S = 10  # a refusal answers before the engine runs; longer means it was admitted


@pytest.fixture(scope="module")
def llm():
    return LLM(**dict(ENGINE, num_blocks=21, block_size=8))  # 20 usable blocks of 8 tokens


def _rejected(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("pagedjax:requests_rejected_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _held(limits: AdmissionLimits, llm, held_bodies, probes):
    """Serves with limits; held_bodies are admitted while the engine is paused, then each probe
    (body, expected status) is sent; returns the probes' responses and /metrics."""
    server = OpenAIServer(llm.engine, "tiny", admission=limits)
    server.async_engine.pause()
    with BackgroundServer(server.build_app()) as url, httpx.Client(base_url=url,
                                                                   timeout=120) as client, \
            concurrent.futures.ThreadPoolExecutor(len(held_bodies) + len(probes)) as pool:
        try:  # a failed check resumes the engine, so the held requests end and so does the test
            held = [pool.submit(client.post, "/v1/completions", json=b) for b in held_bodies]
            deadline = time.monotonic() + 60
            while server.async_engine.num_live < len(held) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.async_engine.num_live == len(held)
            answers = []
            for body, status in probes:
                before = set(llm.engine.request_groups)
                if status == 429:  # answered at once: one admitted instead waits on the pause
                    response = client.post("/v1/completions", json=body, timeout=REFUSAL_S)
                    assert set(llm.engine.request_groups) == before  # nothing queued
                else:  # admitted: held live too, before the next probe
                    live = server.async_engine.num_live
                    response = pool.submit(client.post, "/v1/completions", json=body)
                    while (server.async_engine.num_live == live and not response.done()
                           and time.monotonic() < deadline):
                        time.sleep(0.02)
                    if response.done():  # answered at once: refused
                        assert response.result().status_code == status, response.result().text
                answers.append(response)
        finally:
            server.async_engine.resume()
        answers = [a.result(timeout=120) if isinstance(a, concurrent.futures.Future) else a
                   for a in answers]
        assert all(h.result(timeout=120).status_code == 200 for h in held)
        for answer, (_, status) in zip(answers, probes):
            assert answer.status_code == status, answer.text
            if status == 429:
                assert answer.headers["retry-after"] == "1"
        return answers, _rejected(client.get("/metrics").text)


def test_kv_pressure(llm):
    """20 usable blocks, overcommit 1: a live request that may take 7 blocks (9 + 40 tokens)
    leaves room for another of 7 but not for one of 15 (47 + 70 tokens)."""
    body = {"prompt": SHORT, "max_tokens": 40, "ignore_eos": True}
    answers, rejected = _held(AdmissionLimits(kv_overcommit=1.0), llm, [body], [
        ({"prompt": LONG, "max_tokens": 70}, 429),
        ({"prompt": SHORT, "max_tokens": 40}, 200)])
    assert "KV pressure" in answers[0].json()["error"]["message"]
    assert rejected == {"kv_pressure": 1}


def test_long_context_cap(llm):
    limits = AdmissionLimits(long_context_threshold=20, max_long_context_requests=1)
    answers, rejected = _held(limits, llm, [{"prompt": LONG, "max_tokens": 4}], [
        ({"prompt": LONG, "max_tokens": 4}, 429), ({"prompt": SHORT, "max_tokens": 4}, 200)])
    assert "prompts over 20 tokens" in answers[0].json()["error"]["message"]
    assert rejected == {"long_context_cap": 1}


def test_non_streamed_cap_and_concurrency_cap(llm):
    """Under max_non_streamed_requests 1 a live streamed request leaves room for one non-streamed
    request, not two; streamed ones stay admitted until the concurrency cap (3)."""
    limits = AdmissionLimits(max_non_streamed_requests=1, max_concurrent_requests=3)
    held = [{"prompt": SHORT, "max_tokens": 4, "stream": True}]
    answers, rejected = _held(limits, llm, held, [
        ({"prompt": SHORT, "max_tokens": 4}, 200),  # the first non-streamed one
        ({"prompt": SHORT, "max_tokens": 4}, 429),  # a second non-streamed one
        ({"prompt": SHORT, "max_tokens": 4, "stream": True}, 200),  # streamed: the third
        ({"prompt": SHORT, "max_tokens": 4, "stream": True}, 429)])  # a fourth live one
    assert "non-streamed requests are limited to 1 live ones (1 now)" in \
        answers[1].json()["error"]["message"]
    assert rejected == {"non_streamed_cap": 1, "concurrency_cap": 1}


def test_limits_are_checked_when_built():
    with pytest.raises(ValueError, match="kv_overcommit"):
        AdmissionLimits(kv_overcommit=0)
    with pytest.raises(ValueError, match="together"):
        AdmissionLimits(long_context_threshold=100)
    with pytest.raises(ValueError, match="max_non_streamed_requests"):
        AdmissionLimits(max_non_streamed_requests=-1)
