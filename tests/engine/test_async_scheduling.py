"""Async scheduling (EngineConfig.async_scheduling): step N + 1 scheduled and dispatched while
step N runs, its tokens read from step N's sampled ids on the device, equals synchronous
stepping token for token: requests that finish (stop strings, stop tokens, max_tokens), that
need their tokens on the host (penalties, grammars, n > 1: stepped synchronously), chunked
prefills, prefix hits, preemption, aborts between two steps, and a step failing on the
device while the next one is already dispatched."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from helpers import check_kv_invariants, until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models import get_config, init_model
from pagedjax.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from pagedjax.scheduler.async_steps import advance_ahead, placeholder
from pagedjax.text.tokenizer import ByteTokenizer

# A pool of 40 blocks of 4 tokens for ~12 requests of 20-70 tokens: preemption by recompute;
# a 32-token budget chunks the long prompts.
CONFIG = dict(max_model_len=128, max_num_seqs=6, max_num_batched_tokens=32, block_size=4,
              num_blocks=40, min_seq_bucket=2)
LETTERS = tuple(b"abcdefghijklmnopqrstuvwxyz")


@pytest.fixture(scope="module")
def byte_model():
    """A random model over the byte tokenizer's vocabulary (264 ids, EOS 257)."""
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return init_model(config, seed=5)


def engine_for(model, async_scheduling: bool, **overrides) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{**CONFIG, **overrides},
                                         async_scheduling=async_scheduling),
                     tokenizer=ByteTokenizer())


def mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    """Every way a request ends or is constrained, over shared and long prompts."""
    tok = ByteTokenizer()
    head = tok.encode("the system prompt all share ")  # 28 tokens: prefix hits
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_k=40, seed=11)
    return [
        (head + tok.encode("one"), dataclasses.replace(greedy, logprobs=2, prompt_logprobs=1)),
        (head + tok.encode("two"), sampled),
        (tok.encode("x" * 70), dataclasses.replace(greedy, max_tokens=12)),  # chunked
        (tok.encode("stop on a vowel: "), dataclasses.replace(
            sampled, seed=3, allowed_token_ids=LETTERS, stop=["a", "e", "i", "o"])),
        (tok.encode("stop on a space: "), dataclasses.replace(
            sampled, seed=4, allowed_token_ids=tuple(b"abc "), stop_token_ids=[32])),
        (tok.encode("one token"), dataclasses.replace(greedy, max_tokens=1)),
        (tok.encode("letters, at least 6: "), dataclasses.replace(
            sampled, seed=5, allowed_token_ids=LETTERS + (257,), min_tokens=6)),
        (head + tok.encode("penalized"), dataclasses.replace(
            sampled, seed=6, repetition_penalty=1.5, presence_penalty=0.5)),
        (tok.encode("regex: "), dataclasses.replace(
            sampled, seed=7, structured_outputs={"regex": "[a-z]{3,8}-[0-9]{2}"})),
        (tok.encode("two samples "), dataclasses.replace(sampled, n=2, seed=8)),
        (head + tok.encode("bad words"), dataclasses.replace(
            sampled, seed=9, bad_words=("th", "e"))),
        (tok.encode("y" * 45), dataclasses.replace(sampled, seed=10, max_tokens=30)),
    ]


def run(engine: LLMEngine, requests, on_step=None) -> dict:
    """Steps engine until its requests finish; request id -> final output. on_step(engine,
    step index) runs after each step (aborts, checks)."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    for i in until_done(engine, 2000):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        check_kv_invariants(engine.scheduler.kv_manager)
        if on_step is not None:
            on_step(engine, i)
    return {i: done[i] for i in ids if i in done}


def summary(output) -> list:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]


def assert_same(got: dict, expected: dict) -> None:
    """The same samples (tokens, text, why they ended); logprobs within 1e-4 (f32: a row's
    products may round differently in a batch of another size)."""
    assert got.keys() == expected.keys()
    for request_id, out in got.items():
        ref = expected[request_id]
        assert summary(out) == summary(ref), request_id
        for sample, ref_sample in zip(out.outputs, ref.outputs):
            for step, ref_step in zip(sample.logprobs or (), ref_sample.logprobs or ()):
                assert step.keys() == ref_step.keys()
                np.testing.assert_allclose([v.logprob for v in step.values()],
                                           [v.logprob for v in ref_step.values()], atol=1e-4)
        assert (out.prompt_logprobs is None) == (ref.prompt_logprobs is None)


@pytest.fixture(scope="module")
def sync_outputs(byte_model):
    engine = engine_for(byte_model, False)
    return run(engine, mixed_requests()), engine


def test_async_scheduling_equals_synchronous_stepping(byte_model, sync_outputs):
    expected, sync_engine = sync_outputs
    engine = engine_for(byte_model, True)
    got = run(engine, mixed_requests())
    assert_same(got, expected)
    reasons = {c.finish_reason for out in got.values() for c in out.outputs}
    assert reasons == {"stop", "length"}
    stop_reasons = {out.outputs[0].stop_reason for out in got.values()}
    assert {32} < stop_reasons and stop_reasons & {"a", "e", "i", "o"}
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    # most steps ran ahead; the penalized, grammar, bad-words and forking ones did not
    assert 0.3 * stats.num_steps < engine.stats.num_ahead_steps < stats.num_steps
    assert engine.scheduler.kv_manager.num_used_blocks == 0


def test_plain_requests_run_every_step_ahead_and_constrained_ones_none(byte_model):
    """Requests that end at max_tokens alone: every step but the first dispatched ahead, and
    not one token computed that synchronous stepping does not (a request its step in flight
    certainly finishes gets no row in the next)."""
    tok = ByteTokenizer()
    plain = [(tok.encode(f"plain {i}"), SamplingParams(max_tokens=4 + 3 * i, temperature=0.0,
                                                       ignore_eos=True)) for i in range(3)]
    engine = engine_for(byte_model, True)
    sync = engine_for(byte_model, False)
    assert_same(run(engine, plain), run(sync, plain))
    assert engine.stats.num_ahead_steps == engine.stats.num_steps - 1
    assert engine.stats.num_scheduled_tokens == sync.stats.num_scheduled_tokens
    penalized = [(p, dataclasses.replace(sp, frequency_penalty=0.5)) for p, sp in plain]
    engine = engine_for(byte_model, True)
    run(engine, penalized)
    assert engine.stats.num_steps > 0 and engine.stats.num_ahead_steps == 0


def test_aborts_between_steps_equal_synchronous_stepping(byte_model):
    """Requests aborted once they hold a number of tokens, while (async) the step after theirs
    is in flight: the others' outputs as synchronous stepping gives them, the aborted ones
    holding what they had, and every block back in the pool."""
    requests = mixed_requests()[:7]
    abort_at = {"1": 3, "2": 3, "0": 19}  # request id -> its tokens when it is aborted
    full = run(engine_for(byte_model, False), requests)
    runs = {}
    for async_scheduling in (False, True):
        aborted = {}

        def abort(engine, step):
            for request_id, samples in list(engine.request_groups.items()):
                tokens = list(samples[0].output_token_ids)
                if len(tokens) >= abort_at.get(request_id, 1000):
                    aborted[request_id] = tokens  # noqa: B023 - called within this loop
                    engine.abort(request_id)

        engine = engine_for(byte_model, async_scheduling)
        runs[async_scheduling] = run(engine, requests, abort), aborted
        assert engine.scheduler.kv_manager.num_used_blocks == 0
        assert engine.stats.num_aborted == len(aborted) == len(abort_at)
    (sync, sync_aborted), (got, got_aborted) = runs[False], runs[True]
    assert_same(got, sync)
    assert got.keys() == full.keys() - abort_at.keys()
    assert got_aborted == sync_aborted
    for request_id, tokens in got_aborted.items():
        assert tokens == full[request_id].outputs[0].token_ids[:abort_at[request_id]]


def test_a_step_failing_on_the_device_with_the_next_dispatched_recomputes(
        byte_model, sync_outputs, caplog):
    """The results of a step cannot be fetched (it failed on the device) while the next step
    was dispatched after it: the next is dropped, the running requests recompute in a fresh
    cache, and every output is still synchronous stepping's."""
    expected, _ = sync_outputs
    engine = engine_for(byte_model, True)
    fetch = engine.runner.fetch
    calls = []

    def failing_once(pending):
        calls.append(pending)
        if len(calls) == 6:
            raise RuntimeError("device step failed")
        return fetch(pending)

    engine.runner.fetch = failing_once
    got = run(engine, mixed_requests())
    assert_same(got, expected)
    assert "a failed device step lost the KV cache" in caplog.text
    assert engine.stats.num_failed == 0 and engine.scheduler.kv_manager.num_used_blocks == 0


@pytest.mark.parametrize("ahead", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_step_failing_while_dispatched_is_retried_row_by_row(byte_model, sync_outputs,
                                                                caplog, ahead):
    """A step's dispatch raises once (before the device: the KV cache is intact), either a step
    dispatched ahead of the one before it or one dispatched on its own: no step is dispatched
    ahead of the failed one (its rows' tokens are not coming), its rows run again one at a time,
    nothing is recomputed, and every output is still synchronous stepping's."""
    expected, _ = sync_outputs
    engine = engine_for(byte_model, True)
    dispatch = engine.runner.dispatch_forward
    kinds, failed = [], []  # kinds: whether each dispatch was ahead of its step's results

    def failing_once(plan, previous=None):
        kinds.append(previous is not None)
        if kinds[-1] == ahead and kinds.count(ahead) == 4:  # the 4th of its kind
            failed.append(len(kinds))
            raise RuntimeError("dispatch failed")
        return dispatch(plan, previous)

    engine.runner.dispatch_forward = failing_once
    got = run(engine, mixed_requests())
    assert len(failed) == 1
    assert_same(got, expected)
    assert "lost the KV cache" not in caplog.text
    assert engine.stats.num_failed == 0 and engine.scheduler.kv_manager.num_used_blocks == 0


def test_a_step_whose_results_fail_to_process_drops_the_step_dispatched_ahead(byte_model):
    """complete_step raises with the next step already dispatched: that step is waited for and
    dropped with its placeholder tokens (none is left in any request or output), the error is
    raised, and after fail_all the engine answers as a synchronous one."""
    tok = ByteTokenizer()
    plain = [(tok.encode(f"plain {i} "), SamplingParams(max_tokens=10, temperature=0.0))
             for i in range(3)]
    engine = engine_for(byte_model, True)
    complete, fetch, fetched = engine.complete_step, engine.runner.fetch, []
    calls = []

    def failing(started, results, final_only=False):
        calls.append(engine.async_scheduling.in_flight)
        if len(calls) == 4:
            raise RuntimeError("postprocessing failed")
        return complete(started, results, final_only)

    engine.complete_step = failing
    engine.runner.fetch = lambda pending: fetched.append(pending) or fetch(pending)
    for prompt, params in plain:
        engine.add_request(prompt, params)
    with pytest.raises(RuntimeError, match="postprocessing failed"):
        for _ in range(50):
            engine.step()
    assert len(calls) == 4 and engine.async_scheduling.in_flight is None
    assert len(fetched) == 5  # the failed step's results and the dropped one's
    requests = engine.scheduler.state.requests.values()
    assert requests and not any(t < 0 for r in requests for t in r.output_token_ids)
    failed = engine.fail_all(RuntimeError("postprocessing failed"))
    assert failed and not any(t < 0 for o in failed for c in o.outputs for t in c.token_ids)
    engine.complete_step = complete
    want = run(engine_for(byte_model, False), plain).values()
    assert [summary(o) for o in run(engine, plain).values()] == [summary(o) for o in want]


@pytest.mark.parametrize("field, value", [("preemption_mode", "swap"),
                                          ("speculative_config", {"method": "ngram",
                                                                  "num_speculative_tokens": 2,
                                                                  "prompt_lookup_max": 2})])
def test_async_scheduling_names_what_it_cannot_run_with(field, value):
    with pytest.raises(ValueError, match=f"async_scheduling is not supported with {field}"):
        EngineConfig(async_scheduling=True, **{field: value})


def test_a_request_preempted_while_its_step_runs_gets_its_token_or_finishes():
    """The scheduler alone: step 3, scheduled ahead of step 2's results, preempts a request
    step 2 runs. Step 2's update still gives it its token (it recomputes with it), or, when
    that token stops it, finishes it out of the waiting queue with its blocks released."""
    for stops in (False, True):
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16,
                                              max_model_len=32, watermark=0.0),
                              num_blocks=5, block_size=4)  # 4 usable blocks
        params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[9])
        a, b = (Request(name, [1] * 7, params, seed=0, arrival_time=0.0) for name in "ab")
        for request in (a, b):
            scheduler.add_request(request)
        step1 = scheduler.schedule(0.0)  # both prompts: 2 blocks each, the pool is full
        scheduler.update(step1, np.array([3, 3]), 0.0)
        step2 = scheduler.schedule(1.0)  # both decode inside their second block
        advance_ahead(scheduler.state, step2)
        step3 = scheduler.schedule(2.0)  # a needs a fifth block: b, the latest, is preempted
        assert [s.request for s in step3.scheduled] == [a] and step3.preempted == [b]
        assert b.output_token_ids == [3, placeholder(1)] and b.num_computed_tokens == 0
        scheduler.update(step2, np.array([4, 9 if stops else 5]), 2.0)
        assert b.output_token_ids == [3, 9 if stops else 5]
        assert a.output_token_ids == [3, 4] and a.num_computed_tokens == 8
        if stops:
            assert b.status is RequestStatus.FINISHED_STOPPED
            assert b not in scheduler.state.waiting and "b" not in scheduler.state.requests
        else:
            assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert list(scheduler.state.waiting) == [b]
        check_kv_invariants(scheduler.kv_manager)
        scheduler.update(step3, np.array([6]), 3.0)
        assert a.output_token_ids == [3, 4, 6] and a.num_computed_tokens == 9
        check_kv_invariants(scheduler.kv_manager)


@pytest.mark.parametrize("windows", [(None,), (8,), (None, 6)], ids=["full", "sliding", "hybrid"])
def test_advancing_ahead_leaves_the_blocks_as_the_update_does(windows):
    """The scheduler alone, two copies stepping the same requests: after advance_ahead one
    holds the blocks the other holds after the step's update (the same tables, the same
    blocks free, the same blocks published), so the step scheduled ahead sees the pool a
    synchronous one would."""
    def make():
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12,
                                              max_model_len=64),
                              num_blocks=64, block_size=4, group_windows=windows)
        for i, n in enumerate((5, 30, 17)):
            scheduler.add_request(Request(str(i), list(range(1, n + 1)), SamplingParams(
                max_tokens=20, temperature=0.0), seed=0, arrival_time=0.0))
        return scheduler

    def blocks(scheduler):
        kv = scheduler.kv_manager
        groups = getattr(kv, "groups", [kv])
        return ([dict(g.block_tables) for g in groups], kv.num_free_blocks,
                sorted(kv.pool.cached.values()))

    synced, ahead = make(), make()
    for step in range(12):
        output = synced.schedule(float(step))
        assert output.scheduled
        ahead_output = ahead.schedule(float(step))
        assert blocks(synced) == blocks(ahead)
        synced.update(output, np.full(len(output.scheduled), 7), float(step))
        advance_ahead(ahead.state, ahead_output)
        assert blocks(synced) == blocks(ahead), step
        ahead.update(ahead_output, np.full(len(ahead_output.scheduled), 7), float(step))


def test_a_server_with_async_scheduling_answers_as_one_without(caplog):
    """`--async-scheduling` behind the OpenAI server (the embedded model): streamed and whole
    completions as the synchronous engine's, and /metrics counts the steps dispatched ahead."""
    from fastapi.testclient import TestClient
    from test_server import ENGINE, PROMPTS

    from pagedjax import LLM
    from pagedjax.serving.app import OpenAIServer

    bodies = [{"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": i, "n": 1}
              for i, prompt in enumerate(PROMPTS)]
    answers = {}
    for async_scheduling in (False, True):
        server = OpenAIServer(LLM(**ENGINE, async_scheduling=async_scheduling).engine, "tiny")
        with TestClient(server.build_app()) as client:
            texts = [client.post("/v1/completions", json=body).json()["choices"][0]["text"]
                     for body in bodies]
            with client.stream("POST", "/v1/completions",
                               json={**bodies[0], "stream": True}) as stream:
                chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
            texts.append("".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks))
            metrics = client.get("/metrics").text
        answers[async_scheduling] = texts
        ahead = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("pagedjax:async_scheduled_steps_total{"))
        assert (ahead > 0) == async_scheduling
    assert answers[True] == answers[False] and answers[True][-1] == answers[True][0]
