"""A device OOM inside a step is caught, counted (/metrics: pagedjax:oom_errors_total) and
survived: when the donated KV cache went with it, every running request is recomputed in a
fresh cache and answers what it answers without the OOM; when the cache survived, the step's
sequences are retried one at a time; a request that keeps running out of memory fails alone
after MAX_OOM_RETRIES, and the server serves on. The allocation failure is injected where the
device would raise it (the forward's dispatch), as JAX's own RESOURCE_EXHAUSTED error."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import jax
import pytest
from test_server import ENGINE, PROMPTS

from pagedjax import LLM, SamplingParams
from pagedjax.engine.step_recovery import MAX_OOM_RETRIES
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer

OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes."


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


class Injector:
    """Wraps the runner's forward: when armed(plan) says so, raises JAX's OOM error, first
    deleting the KV cache (the donated buffer consumed) when lose_cache."""

    def __init__(self, llm, armed, lose_cache: bool):
        self.runner, self.forward = llm.engine.runner, llm.engine.runner.dispatch_forward
        self.armed, self.lose_cache, self.calls, self.raised = armed, lose_cache, 0, 0
        self.runner.dispatch_forward = self

    def __call__(self, plan):
        self.calls += 1
        if self.armed(self, plan):
            self.raised += 1
            if self.lose_cache:
                for leaf in jax.tree.leaves(self.runner.kv_cache):
                    leaf.delete()
            raise jax.errors.JaxRuntimeError(OOM)
        return self.forward(plan)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**ENGINE)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _serve_all(url):
    with httpx.Client(base_url=url, timeout=120) as client, \
            concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(client.post, "/v1/completions", json={
            "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            for p in PROMPTS]
        responses = [f.result(timeout=120) for f in futures]
        return responses, client.get("/metrics").text


@pytest.mark.parametrize("lose_cache", [True, False])
def test_an_oom_mid_generation_is_counted_and_every_request_answers_as_without_it(
        reference, lose_cache):
    llm = LLM(**ENGINE)
    # the sixth forward: the prompts are in, some tokens generated
    injector = Injector(llm, lambda inj, plan: inj.calls == 6, lose_cache)
    server = OpenAIServer(llm.engine, "tiny")
    server.async_engine.pause()  # every request in the first step
    with BackgroundServer(server.build_app()) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as starter:
            running = starter.submit(_serve_all, url)
            deadline = time.monotonic() + 60
            while (server.async_engine.num_live < len(PROMPTS) and not running.done()
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            server.async_engine.resume()
            responses, metrics = running.result(timeout=300)
        assert injector.raised == 1
        assert [r.status_code for r in responses] == [200] * len(PROMPTS)
        assert [r.json()["choices"][0]["text"] for r in responses] == reference
        assert _metric(metrics, "pagedjax:oom_errors_total") == 1
        if lose_cache:  # every running request recomputed: a preemption each
            assert llm.engine.stats.num_preemptions >= len(PROMPTS)
        assert httpx.get(f"{url}/health").status_code == 200
    assert llm.engine.scheduler.kv_manager.num_used_blocks == 0


def test_requests_that_sat_out_the_failing_step_are_recomputed_too(reference):
    """prefill_first: a new prompt's prefill step runs no decodes, so the requests decoding sit
    it out. When that step loses the cache, they lost their KV as well: every running request,
    not only the step's, goes back to the queue to recompute, and all answer as without the
    OOM."""
    llm = LLM(**ENGINE, policy="prefill_first")
    engine, state = llm.engine, llm.engine.scheduler.state
    sat_out = []

    def armed(inj, plan):
        if inj.raised or int(plan.num_seqs) == len(state.running):
            return False
        sat_out.extend(r for r in state.running if r.num_computed_tokens > r.num_prompt_tokens)
        return bool(sat_out)

    injector = Injector(llm, armed, lose_cache=True)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(llm.tokenizer.encode(p), params) for p in PROMPTS[:2]]
    for _ in range(3):  # both decoding
        engine.step()
    ids += [engine.add_request(llm.tokenizer.encode(p), params) for p in PROMPTS[2:]]
    engine.step()
    assert injector.raised == 1 and sat_out
    assert all(r in state.waiting and r.num_computed_tokens == 0 for r in sat_out)
    assert not state.running and engine.scheduler.kv_manager.num_used_blocks == 0
    texts = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = llm.tokenizer.decode(out.outputs[0].token_ids)
        if not engine.has_unfinished():
            break
    assert [texts[i] for i in ids] == reference


def test_a_request_that_keeps_running_out_of_memory_fails_alone():
    llm = LLM(**ENGINE)
    poison = 7  # the BEL byte: in no other prompt
    Injector(llm, lambda inj, plan: poison in plan.token_ids[:int(plan.cu_q_lens[-1])], True)
    server = OpenAIServer(llm.engine, "tiny")
    with BackgroundServer(server.build_app()) as url, httpx.Client(base_url=url,
                                                                   timeout=120) as client:
        bad = client.post("/v1/completions", json={"prompt": "copy:\x07=", "max_tokens": 4})
        assert bad.status_code == 500
        assert f"out of device memory {MAX_OOM_RETRIES + 1} times" in bad.json()["error"][
            "message"]
        good = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
        assert good.status_code == 200
        metrics = client.get("/metrics").text
        assert _metric(metrics, "pagedjax:oom_errors_total") == MAX_OOM_RETRIES + 1
    assert llm.engine.scheduler.kv_manager.num_used_blocks == 0
