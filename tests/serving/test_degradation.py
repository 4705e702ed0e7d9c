"""Automatic degradation: the rule on a fake clock (steps, hold, hysteresis, recovery), then a
real server (uvicorn on 127.0.0.1) slowed down: its p99 inter-token latency spike steps it down
(max_tokens cut, then long-context requests shed) and, once fast again, it recovers; every step
is on /metrics."""

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
from pagedjax.serving.degradation import DegradationController, DegradationPolicy, settings_for


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_steps_hold_hysteresis_and_recovery():
    clock, changes = Clock(), []
    policy = DegradationPolicy(itl_p99_s=0.1, oom_burst=2, window_s=10, min_samples=5,
                               hold_s=5, recover_ratio=0.5)
    control = DegradationController(policy, clock=clock,
                                    on_change=lambda *a: changes.append(a[:2]))

    def feed(value, seconds):
        for _ in range(int(seconds * 10)):
            clock.now += 0.1
            control.observe("itl", value)
            control.evaluate()

    feed(0.02, 5)
    assert control.level == 0
    feed(0.3, 1)  # the spike: one step at once
    assert control.level == 1
    feed(0.3, 3.9)  # not again before hold_s
    assert control.level == 1
    feed(0.3, 0.6)
    assert control.level == 2
    # The spike stays in the window for window_s: one more step; then below the threshold but
    # above recover_ratio x it: held, neither down nor up.
    feed(0.07, 30)
    assert control.level == 3
    feed(0.02, 15.5)  # the window forgets the 0.07s after 10 s, healthy for hold_s after that
    assert control.level == 2
    feed(0.02, 5.5)
    assert control.level == 1
    feed(0.02, 5.5)
    assert control.level == 0
    feed(0.02, 5)  # hold_s after the last step: the next one may come
    control.oom(2)  # an OOM burst with no latency signal at all
    control.evaluate()
    assert control.level == 1
    assert changes == [(1, "degrade"), (2, "degrade"), (3, "degrade"), (2, "recover"),
                       (1, "recover"), (0, "recover"), (1, "degrade")]


def test_ooms_still_in_the_window_hold_recovery_back():
    """OOMs at t=0 and t=15 degrade (a burst of 2 in a 20 s window) once, the burst gone before
    hold_s (8 s) allows a second step. From t=20 only the second is in the window: no burst, but
    not healthy either, so with latency low all along recovery waits for it to leave (t=35)
    and then hold_s."""
    clock = Clock()
    control = DegradationController(DegradationPolicy(itl_p99_s=0.1, oom_burst=2, window_s=20,
                                                      min_samples=5, hold_s=8), clock=clock)

    def run_until(t):
        while clock.now < t - 1e-9:
            clock.now = round(clock.now + 0.1, 6)
            control.observe("itl", 0.01)
            control.evaluate()

    control.oom()
    run_until(15)
    control.oom()
    control.evaluate()
    assert control.level == 1
    run_until(34.5)  # one OOM in the window since t=20
    assert control.level == 1
    run_until(42.5)  # OOM-free since t=35, not yet for hold_s
    assert control.level == 1
    run_until(43.5)
    assert control.level == 0


def test_levels_derive_from_the_configured_limits():
    base = AdmissionLimits(max_outstanding_tokens=1000, max_concurrent_requests=8)
    policy = DegradationPolicy(itl_p99_s=0.1)
    assert settings_for(0, policy, base, 256, 512, 10) == (base, None)
    limits, cap = settings_for(2, policy, base, 256, 512, 10)
    assert cap == 128 and limits.max_long_context_requests == 0
    assert limits.long_context_threshold == 256 and limits.max_outstanding_tokens == 1000
    limits, _ = settings_for(3, policy, base, 256, 512, 10)
    assert limits.max_concurrent_requests == 5
    with pytest.raises(ValueError, match="recover_ratio"):
        DegradationPolicy(recover_ratio=1.5)


def _level(text: str) -> float:
    line, = [ln for ln in text.splitlines() if ln.startswith("pagedjax:degradation_level{")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.slow  # a served instance slowed, degraded and recovered in real time (15 s)
def test_a_slowed_instance_degrades_then_recovers():
    llm = LLM(**ENGINE)
    runner = llm.engine.runner
    forward, slow = runner.dispatch_forward, [0.12]

    def slowed(plan):
        time.sleep(slow[0])
        return forward(plan)

    runner.dispatch_forward = slowed
    policy = DegradationPolicy(itl_p99_s=0.06, window_s=1.5, min_samples=10, hold_s=0.5,
                               long_context_threshold=30)
    server = OpenAIServer(llm.engine, "tiny", degradation=policy, max_tokens_cap=40)
    body = {"prompt": "copy:abc=", "max_tokens": 24, "ignore_eos": True}
    long = {"prompt": "copy:" + "y" * 40 + "=", "max_tokens": 4}
    with BackgroundServer(server.build_app()) as url, httpx.Client(base_url=url,
                                                                   timeout=120) as client, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        def until(condition, limit_s):
            deadline = time.monotonic() + limit_s
            while not condition() and time.monotonic() < deadline:
                list(pool.map(lambda _: client.post("/v1/completions", json=body), range(2)))
            return condition()

        assert until(lambda: server.degradation.level >= 2, 60), server.degradation.level
        capped = client.post("/v1/completions", json={**body, "max_tokens": 30})
        assert capped.headers["x-pagedjax-max-tokens-capped"] == "20"  # 40 x 0.5
        assert capped.json()["choices"][0]["finish_reason"] == "length"
        assert len(capped.json()["choices"][0]["text"]) <= 20
        shed = client.post("/v1/completions", json=long)
        assert shed.status_code == 429 and "prompts over 30 tokens" in shed.text
        assert _level(client.get("/metrics").text) >= 2
        slow[0] = 0.0  # fast again
        assert until(lambda: server.degradation.level == 0, 60), server.degradation.level
        assert client.post("/v1/completions", json=long).status_code == 200
        uncapped = client.post("/v1/completions", json={**body, "max_tokens": 30})
        assert "x-pagedjax-max-tokens-capped" not in uncapped.headers
        metrics = client.get("/metrics").text
        assert _level(metrics) == 0
        assert 'pagedjax:degradation_changes_total{direction="recover"' in metrics


def test_max_tokens_cap_and_the_chat_default():
    from fastapi.testclient import TestClient
    from helpers import ROLE_TEMPLATE
    llm = LLM(**ENGINE)
    messages = [{"role": "user", "content": "hi"}]
    for cap, default, want in ((5, 512, 5), (None, 6, 6), (None, None, None)):
        server = OpenAIServer(llm.engine, "tiny", chat_template=ROLE_TEMPLATE,
                              max_tokens_cap=cap, default_max_tokens=default)
        with TestClient(server.build_app()) as client:
            chat = client.post("/v1/chat/completions", json={"messages": messages,
                                                            "ignore_eos": True})
            usage = chat.json()["usage"]
            if want is None:  # vLLM's: what the context leaves
                want = ENGINE["max_model_len"] - usage["prompt_tokens"]
            assert usage["completion_tokens"] == want
            assert chat.headers.get("x-pagedjax-max-tokens-capped") == (
                str(cap) if cap else None)
            done = client.post("/v1/completions", json={"prompt": "copy:ab=", "max_tokens": 9,
                                                        "ignore_eos": True, "stream": True})
            assert done.headers.get("x-pagedjax-max-tokens-capped") == (
                str(cap) if cap else None)
    with pytest.raises(ValueError, match="max_tokens_cap"):
        OpenAIServer(llm.engine, "tiny", max_tokens_cap=0)
