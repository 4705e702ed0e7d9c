"""Automatic prefix caching: same outputs as without it, exact hit counts, salts, eviction."""

import numpy as np
import pytest
from helpers import check_kv_invariants, make_request, until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def engine(model, **kwargs):
    base = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32, min_seq_bucket=8,
                block_size=BLOCK)
    return LLMEngine(model, EngineConfig(**{**base, **kwargs}))


def run(engine, requests, *, one_by_one=False):
    """requests: (prompt, params[, salt]); one_by_one finishes each before adding the next."""
    outputs, ids = {}, []

    def drain():
        for _ in until_done(engine):
            outputs.update({o.request_id: o for o in engine.step() if o.finished})

    for prompt, params, *salt in requests:
        ids.append(engine.add_request(prompt, params, cache_salt=salt[0] if salt else None))
        if one_by_one:
            drain()
    drain()
    return [outputs[i] for i in ids]


def shared_prefix_workload():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 256, 24).tolist()  # 6 full blocks
    prompts = [
        rng.integers(0, 256, 13).tolist(),  # shares nothing
        system + rng.integers(0, 256, 9).tolist(),  # shares 6 blocks
        system[:10] + rng.integers(0, 256, 7).tolist(),  # shares 2 blocks (and half a block)
        system + [7],  # all but the last token cached: 6 blocks hit
        list(system),  # exactly 6 blocks: the hit stops at 5 so the last token is computed
        system + rng.integers(0, 256, 9).tolist(),
    ]
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11)
    return [(p, greedy if i % 2 else sampled) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("one_by_one", [True, False])
def test_outputs_equal_with_and_without_caching(tiny_model, one_by_one):
    workload = shared_prefix_workload()
    off = run(engine(tiny_model, enable_prefix_caching=False), workload, one_by_one=one_by_one)
    eng = engine(tiny_model)
    on = run(eng, workload, one_by_one=one_by_one)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    if one_by_one:  # every request finds what the earlier ones published
        # request 1 publishes the system prompt's 6 blocks; 2 shares 2 of them; 3 hits all 6;
        # 4 is exactly the 6 blocks, so its hit stops at 5; 5 hits all 6.
        assert [o.metrics.num_cached_tokens for o in on] == [0, 0, 8, 24, 20, 24]
        assert eng.stats.num_prefix_hit_tokens == 76
        assert eng.stats.num_prefix_query_tokens == sum(len(p) for p, _ in workload)
    assert eng.scheduler.kv_manager.num_used_blocks == 0


def test_multi_turn_continuation_hits_the_whole_conversation(tiny_model):
    eng = engine(tiny_model)
    turn1 = list(range(1, 18))  # 17 tokens
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = run(eng, [(turn1, params)])[0]
    # Turn 1 computed 17 + 7 = 24 tokens of KV (the last sampled token's KV is not computed).
    turn2 = turn1 + first.output_token_ids + [5, 6, 7]
    second = run(eng, [(turn2, params)])[0]
    assert second.metrics.num_cached_tokens == 24
    plain = run(engine(tiny_model, enable_prefix_caching=False), [(turn2, params)])[0]
    assert second.output_token_ids == plain.output_token_ids


def test_salts_isolate_tenants(tiny_model):
    eng = engine(tiny_model)
    prompt = list(range(30, 50))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    run(eng, [(prompt, params, "tenant-a")])
    b = run(eng, [(prompt, params, "tenant-b")])[0]
    a = run(eng, [(prompt, params, "tenant-a")])[0]
    assert b.metrics.num_cached_tokens == 0
    assert a.metrics.num_cached_tokens == 16


def test_eviction_under_pressure_keeps_outputs_equal(tiny_model):
    rng = np.random.default_rng(3)
    system = rng.integers(0, 256, 20).tolist()
    workload = [((system if i % 2 else []) + rng.integers(0, 256, 15 + i).tolist(),
                 SamplingParams(max_tokens=12, temperature=0.0)) for i in range(10)]
    # 25 usable blocks: live requests and cached blocks compete, so cached blocks get evicted.
    eng = engine(tiny_model, num_blocks=26)
    on = run(eng, workload, one_by_one=True)
    off = run(engine(tiny_model, num_blocks=26, enable_prefix_caching=False), workload,
              one_by_one=True)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    assert eng.stats.num_evictions > 0
    assert eng.stats.num_prefix_hit_tokens > 0


def scheduler(num_blocks=20, **kwargs):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                             **kwargs)
    return Scheduler(config, num_blocks, BLOCK)


def finish(sched, now=1.0):
    for _ in until_done(sched):
        output = sched.schedule(now)
        sched.update(output, [9] * len(output.scheduled), now)
        check_kv_invariants(sched.kv_manager)
        now += 1


def test_freed_blocks_stay_cached_and_are_evicted_tail_first():
    sched = scheduler(num_blocks=9)  # 8 usable blocks
    a = make_request("a", 16, 1, token=3)  # 4 full blocks, published after its prefill
    sched.add_request(a)
    finish(sched)
    pool = sched.kv_manager.pool
    assert len(pool.cached) == 4 and pool.num_free_blocks == 8
    b = make_request("b", 20, 1, token=5)  # needs 5 blocks: evicts 1 cached block
    sched.add_request(b)
    sched.update(sched.schedule(10.0), [9], 10.0)
    assert pool.num_evictions == 1
    # a's tail block went first: its first three blocks still hit.
    assert len(sched.kv_manager.find_cached_prefix(make_request("c", 17, 1, token=3))) == 3


def test_readmission_after_preemption_is_not_counted_as_a_hit():
    sched = scheduler(num_blocks=7)
    sched.add_request(make_request("a", 8, 14, token=1))
    sched.add_request(make_request("b", 8, 14, token=2))
    finish(sched)
    state = sched.state
    assert state.num_preemptions > 0
    assert state.num_prefix_query_tokens == 16  # only the first admissions were counted
    assert state.num_prefix_hit_tokens == 0


def test_hit_is_capped_one_token_short():
    sched = scheduler()
    sched.add_request(make_request("a", 12, 1, token=4))
    finish(sched)
    again = make_request("b", 12, 1, token=4)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks hit.
    assert len(sched.kv_manager.find_cached_prefix(again)) == 2
    sched.add_request(again)
    output = sched.schedule(5.0)
    assert output.scheduled[0].start == 8 and output.scheduled[0].num_new_tokens == 4


def test_block_hashes_are_chained_to_their_prefix():
    """A block whose tokens equal a cached block's, after a different prefix, is not a hit: its
    K/V depends on everything before it (unchained hashes would find every block here)."""
    from pagedjax.scheduler import Request, SamplingParams

    def request(request_id, *blocks):
        tokens = [t for b in blocks for t in [b] * BLOCK] + [9]
        return Request(request_id, tokens, SamplingParams(max_tokens=1, temperature=0.0),
                       seed=0, arrival_time=0.0)

    sched = scheduler()
    sched.add_request(request("a", 1, 2, 3))
    finish(sched)
    find = sched.kv_manager.find_cached_prefix
    assert len(find(request("same", 1, 2, 3))) == 3
    assert find(request("swapped", 2, 1, 3)) == []
    assert len(find(request("repeated", 1, 1, 1))) == 1
    assert len(find(request("diverged", 1, 2, 1))) == 2
