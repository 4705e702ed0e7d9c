"""Swap preemption: KV moved to a host pool and back gives the same tokens as no preemption."""

import numpy as np
import pytest
from helpers import make_request, until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models.training.generate import dense_greedy_generate
from pagedjax.scheduler import RequestStatus, Scheduler, SchedulerConfig

PROMPT_LENS = [3, 17, 1, 40, 9, 25, 30, 2]
MAX_TOKENS = 12


def prompts():
    rng = np.random.default_rng(42)
    return [rng.integers(0, 256, n).tolist() for n in PROMPT_LENS]


def run(model, **kwargs):
    config = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=16, min_seq_bucket=8,
                  block_size=4, num_blocks=23, preemption_mode="swap")
    engine = LLMEngine(model, EngineConfig(**{**config, **kwargs}))
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
           for p in prompts()]
    done, swapped = {}, 0
    for _ in until_done(engine):
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
        waiting = engine.scheduler.state.waiting  # the load gauge counts the swapped ones
        assert engine.load()[0].num_swapped == sum(r.status is RequestStatus.SWAPPED
                                                   for r in waiting)
        swapped = max(swapped, engine.load()[0].num_swapped)
    assert swapped > 0 or engine.stats.num_swap_outs == 0
    assert engine.scheduler.kv_manager.num_used_blocks == 0
    assert engine.scheduler.kv_manager.num_free_host_blocks == \
        engine.scheduler.kv_manager.num_host_blocks, "host blocks leaked"
    return [done[i] for i in ids], engine.stats


@pytest.fixture(scope="module")
def dense(tiny_model):
    return dense_greedy_generate(tiny_model, prompts(), MAX_TOKENS)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swap_out_and_in_keeps_outputs(tiny_model, dense, prefix_caching):
    # debug-tiny: 2 * 2 layers * 4 tokens * 2 KV heads * 16 * 4 B = 2048 B per block; 64 on host.
    outputs, stats = run(tiny_model, swap_space_bytes=64 * 2048,
                         enable_prefix_caching=prefix_caching)
    assert stats.num_swap_outs > 0, "the pool was meant to force preemption"
    assert stats.num_recomputed_tokens == 0
    assert outputs == dense


def test_full_host_pool_falls_back_to_recompute(tiny_model, dense):
    outputs, stats = run(tiny_model, swap_space_bytes=2 * 2048)  # 2 host blocks
    assert stats.num_preemptions > stats.num_swap_outs
    assert stats.num_recomputed_tokens > 0
    assert outputs == dense


def test_swapped_request_keeps_its_progress_and_abort_frees_host_blocks():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                             preemption_mode="swap", enable_prefix_caching=False)
    sched = Scheduler(config, num_blocks=7, block_size=4, num_host_blocks=8)
    a, b = make_request("a", 8, 14), make_request("b", 8, 14)
    sched.add_request(a)
    sched.add_request(b)
    now = 0.0
    for _ in range(100):  # bounded
        if b.status == RequestStatus.SWAPPED:
            break
        now += 1
        out = sched.schedule(now)
        sched.update(out, [3] * len(out.scheduled), now)
    kv = sched.kv_manager
    assert b.status == RequestStatus.SWAPPED
    assert b.num_computed_tokens > 0 and kv.get_block_table("b") == []
    held = len(kv.host_tables["b"])
    assert kv.num_free_host_blocks == 8 - held
    sched.abort("b", now)
    assert kv.num_free_host_blocks == 8 and "b" not in kv.host_tables


def test_bad_preemption_config():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space_bytes"):
        EngineConfig(swap_space_bytes=-1)
