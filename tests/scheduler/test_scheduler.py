"""The scheduler and plan builder, host only: budgets, chunking, preemption, order, padding."""

import hypothesis.strategies as st
import numpy as np
import pytest
from helpers import make_request, simulate
from hypothesis import given, settings

from pagedjax.scheduler import (DECODE, DECODE_FIRST, NULL_BLOCK, POLICIES, PREFILL, PREFILL_FIRST,
                                Scheduler, SchedulerConfig, ShapeBuckets)


def make_scheduler(*, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=128, prefill_seqs="bucketed", **kwargs):
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, **kwargs)
    buckets = ShapeBuckets.create(max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  block_size=block_size, min_token_bucket=8,
                                  prefill_seqs=prefill_seqs)
    return Scheduler(config, num_blocks, block_size), buckets


def check_plan(output, plan, scheduler, buckets):
    config = scheduler.config
    block_size = scheduler.kv_manager.block_size
    num_seqs = len(output.scheduled)
    num_tokens = output.num_scheduled_tokens
    assert num_tokens <= config.max_num_batched_tokens
    assert num_seqs <= config.max_num_seqs
    # Shapes come from the bucket set.
    assert plan.padded_num_seqs in buckets.seq_buckets
    if plan.kind == DECODE:
        assert plan.padded_num_tokens == plan.padded_num_seqs
        assert all(s.num_new_tokens == 1 for s in output.scheduled)
    else:
        assert plan.padded_num_tokens in buckets.token_buckets
        assert (plan.padded_num_tokens, plan.padded_num_seqs) in buckets.prefill_shapes()
    assert plan.token_ids.shape == (plan.padded_num_tokens,)
    assert plan.block_tables.shape == (plan.padded_num_seqs, buckets.max_blocks_per_seq)
    # Padding rows and slots touch only the null block.
    assert int(plan.num_seqs) == num_seqs
    assert np.all(plan.block_tables[num_seqs:] == NULL_BLOCK)
    assert np.all(plan.kv_lens[num_seqs:] == 0)
    assert np.all(plan.cu_q_lens[num_seqs:] == num_tokens)
    assert np.all(plan.slot_mapping[num_tokens:] // block_size == NULL_BLOCK)
    # Real tokens write distinct slots inside their own sequence's blocks.
    real_slots = plan.slot_mapping[:num_tokens]
    assert len(set(real_slots.tolist())) == num_tokens
    for i, seq in enumerate(output.scheduled):
        lo, hi = plan.cu_q_lens[i], plan.cu_q_lens[i + 1]
        assert hi - lo == seq.num_new_tokens
        table = scheduler.kv_manager.get_block_table(seq.request.request_id)
        assert np.all(plan.block_tables[i, :len(table)] == table)
        assert np.all(plan.block_tables[i, len(table):] == NULL_BLOCK)
        assert set((real_slots[lo:hi] // block_size).tolist()) <= set(table)
        assert np.array_equal(plan.positions[lo:hi], np.arange(seq.start, seq.start + hi - lo))
        assert plan.kv_lens[i] == seq.start + seq.num_new_tokens
        assert plan.logits_indices[i] == hi - 1


workloads = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20)), min_size=1, max_size=24)


@settings(max_examples=40, deadline=None)
@given(workload=workloads, policy=st.sampled_from(POLICIES),
       num_blocks=st.integers(21, 80), block_size=st.sampled_from([1, 4, 16]),
       chunked=st.booleans(), victim=st.sampled_from(["lifo", "fewest_computed"]),
       prefill_seqs=st.sampled_from(["bucketed", "per_token_bucket"]))
def test_every_request_finishes_within_limits(workload, policy, num_blocks, block_size, chunked,
                                              victim, prefill_seqs):
    max_model_len = 80
    num_blocks = max(num_blocks, -(-max_model_len // block_size) + 1)
    scheduler, buckets = make_scheduler(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
        max_num_batched_tokens=80 if not chunked else 32, policy=policy,
        enable_chunked_prefill=chunked, victim_policy=victim, prefill_seqs=prefill_seqs)
    requests = [make_request(i, p, m, arrival_time=float(i)) for i, (p, m) in enumerate(workload)]
    for request in requests:
        scheduler.add_request(request)
    simulate(scheduler, buckets,
             on_step=lambda out, plan: check_plan(out, plan, scheduler, buckets))
    for request, (_, max_tokens) in zip(requests, workload):
        assert request.status.finished
        assert request.num_output_tokens == max_tokens
    assert scheduler.kv_manager.num_free_blocks == num_blocks - 1, "blocks leaked"


def test_chunked_prefill_splits_and_resumes():
    scheduler, buckets = make_scheduler(max_num_batched_tokens=32)
    request = make_request(0, 100, 3)
    scheduler.add_request(request)
    outputs = simulate(scheduler, buckets)
    chunks = [(o.scheduled[0].start, o.scheduled[0].num_new_tokens) for o in outputs]
    assert chunks == [(0, 32), (32, 32), (64, 32), (96, 4), (100, 1), (101, 1)]
    assert [o.kind for o in outputs] == [PREFILL] * 4 + [DECODE] * 2
    assert request.num_output_tokens == 3


def test_partial_prefill_samples_are_discarded():
    scheduler, _ = make_scheduler(max_num_batched_tokens=32)
    request = make_request(0, 40, 2)
    scheduler.add_request(request)
    output = scheduler.schedule(1.0)
    scheduler.update(output, [7], 1.0)
    assert request.output_token_ids == [] and request.num_computed_tokens == 32
    output = scheduler.schedule(2.0)
    assert output.scheduled[0].num_new_tokens == 8
    scheduler.update(output, [7], 2.0)
    assert request.output_token_ids == [7]


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    scheduler, buckets = make_scheduler(max_num_batched_tokens=128, enable_chunked_prefill=False)
    for i, n in enumerate([100, 60]):
        scheduler.add_request(make_request(i, n, 2))
    first = scheduler.schedule(1.0)
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("0", 100)]


def test_mixed_policy_lets_decodes_ride_with_prefill_chunks():
    scheduler, _ = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(make_request(0, 4, 10))
    scheduler.update(scheduler.schedule(1.0), [1], 1.0)
    scheduler.add_request(make_request(1, 50, 2))
    output = scheduler.schedule(2.0)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("0", 1), ("1", 31)]


@pytest.mark.parametrize("policy", [PREFILL_FIRST, DECODE_FIRST])
def test_split_policies_never_mix_phases(policy):
    scheduler, buckets = make_scheduler(max_num_batched_tokens=32, policy=policy)
    for i in range(6):
        scheduler.add_request(make_request(i, 10 + 7 * i, 5))
    saw = set()

    def no_mixing(output, plan):
        phases = {s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens
                  and s.num_new_tokens == 1 for s in output.scheduled}
        assert len(phases) == 1, f"{policy} mixed decodes and prefills: {output.scheduled}"
        saw.add(output.kind)

    simulate(scheduler, buckets, on_step=no_mixing)
    assert saw == {DECODE, PREFILL}


def test_decode_first_runs_decodes_while_any_can_decode():
    scheduler, _ = make_scheduler(policy=DECODE_FIRST)
    scheduler.add_request(make_request(0, 4, 10))
    scheduler.update(scheduler.schedule(1.0), [1], 1.0)
    scheduler.add_request(make_request(1, 8, 2))
    assert [s.request.request_id for s in scheduler.schedule(2.0).scheduled] == ["0"]


def test_prefill_first_admits_before_decoding():
    scheduler, _ = make_scheduler(policy=PREFILL_FIRST)
    scheduler.add_request(make_request(0, 4, 10))
    scheduler.update(scheduler.schedule(1.0), [1], 1.0)
    scheduler.add_request(make_request(1, 8, 2))
    assert [s.request.request_id for s in scheduler.schedule(2.0).scheduled] == ["1"]


def test_fcfs_order_is_kept():
    scheduler, buckets = make_scheduler(max_num_seqs=1)
    requests = [make_request(i, 5 + (7 * i) % 13, 3, arrival_time=float(i)) for i in range(8)]
    for request in requests:
        scheduler.add_request(request)
    simulate(scheduler, buckets)
    finish_order = sorted(requests, key=lambda r: r.finish_time)
    assert [r.request_id for r in finish_order] == [r.request_id for r in requests]


def test_tiny_pool_preempts_and_still_finishes_everything():
    # 12 usable blocks of 4 tokens hold 48 tokens; 10 requests want up to 43 each.
    scheduler, buckets = make_scheduler(num_blocks=13, block_size=4, max_model_len=48)
    requests = [make_request(i, 10 + i, 20 + i % 5) for i in range(10)]
    for request in requests:
        scheduler.add_request(request)
    preempted = []
    simulate(scheduler, buckets, on_step=lambda out, plan: preempted.extend(out.preempted))
    assert preempted, "the pool was meant to force preemption"
    assert scheduler.state.num_preemptions == len(preempted)
    assert sum(r.num_preemptions for r in requests) == len(preempted)
    assert all(r.status.finished and r.num_output_tokens == r.sampling_params.max_tokens
               for r in requests)


def test_preempted_request_recomputes_prompt_and_outputs():
    scheduler, _ = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)
    a, b = make_request("a", 6, 10), make_request("b", 6, 10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    now = 0.0
    for _ in range(100):  # bounded: a victim policy that picks the wrong request fails here
        if b.num_preemptions or a.num_preemptions:
            break
        now += 1
        scheduler.update(scheduler.schedule(now), [3] * 2, now)
    assert b.num_preemptions == 1 and a.num_preemptions == 0  # lifo: the newest goes
    assert b.num_computed_tokens == 0 and scheduler.kv_manager.get_block_table("b") == []
    num_tokens = b.num_tokens
    for _ in range(100):
        if b.num_computed_tokens:
            break
        now += 1
        output = scheduler.schedule(now)
        scheduler.update(output, [3] * len(output.scheduled), now)
    assert b.num_output_tokens >= 1 and b.num_computed_tokens >= num_tokens - 1


def test_abort_frees_blocks_at_once_and_unknown_is_noop():
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("a", 20, 5))
    scheduler.update(scheduler.schedule(1.0), [1], 1.0)
    assert scheduler.kv_manager.num_used_blocks == 5  # 20 prompt tokens in blocks of 4
    assert scheduler.abort("nope", 2.0) is None
    aborted = scheduler.abort("a", 2.0)
    assert aborted.status.value == "abort"
    assert scheduler.kv_manager.num_used_blocks == 0 and not scheduler.has_unfinished()


@pytest.mark.parametrize("kwargs, field", [
    (dict(policy="fastest"), "policy"),
    (dict(victim_policy="random"), "victim_policy"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(watermark=1.5), "watermark"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_scheduler(**kwargs)


def test_buckets_bound_the_program_count():
    buckets = ShapeBuckets.create(max_num_batched_tokens=100, max_num_seqs=64, max_model_len=256,
                                  block_size=16, min_token_bucket=16)
    assert buckets.token_buckets == (16, 32, 64, 100)
    assert buckets.seq_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert buckets.max_blocks_per_seq == 16
    assert (100, 64) in buckets.prefill_shapes() and (16, 32) not in buckets.prefill_shapes()
    assert buckets.num_programs == len(buckets.prefill_shapes()) + 7
    per_t = ShapeBuckets.create(max_num_batched_tokens=100, max_num_seqs=64, max_model_len=256,
                                block_size=16, min_token_bucket=16,
                                prefill_seqs="per_token_bucket")
    assert per_t.prefill_shapes() == [(16, 16), (32, 32), (64, 64), (100, 64)]
    assert per_t.num_programs == 4 + 7
    assert per_t.padded_prefill_seqs(3, 32) == 32 and per_t.padded_prefill_seqs(40, 32) == 64
    with pytest.raises(ValueError, match="prefill_seqs"):
        ShapeBuckets.create(max_num_batched_tokens=100, max_num_seqs=64, max_model_len=256,
                            block_size=16, prefill_seqs="fixed")


def test_token_padding_gap_pads_as_vllm_tpu():
    """token_padding_gap (vLLM TPU's bucket padding gap): powers of two up to the gap, then
    its multiples from there; 0 keeps powers of two; a gap under the smallest bucket is
    refused by name."""
    from pagedjax.scheduler.buckets import token_paddings

    gapped = ShapeBuckets.create(max_num_batched_tokens=2048, max_num_seqs=64,
                                 max_model_len=4096, block_size=16, token_padding_gap=256)
    assert gapped.token_buckets == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792,
                                    2048)
    assert gapped.padded_num_tokens(1152) == 1280 and gapped.padded_num_tokens(300) == 512
    assert token_paddings(16, 2048, 100)[:5] == (16, 32, 64, 164, 264)  # vLLM's: 64 + 100 k
    assert token_paddings(16, 1000, 256)[-2:] == (768, 1000)
    assert token_paddings(16, 2048, 0) == token_paddings(16, 2048, 4096) == (
        16, 32, 64, 128, 256, 512, 1024, 2048)
    for gap in (8, -1, True):
        with pytest.raises(ValueError, match="token_padding_gap"):
            token_paddings(16, 2048, gap)


def test_preempted_request_waits_until_its_whole_recompute_fits():
    """Anti-thrash: readmission needs blocks for every token to recompute, plus one block of
    headroom per running sequence, not just room for the next chunk."""
    scheduler, _ = make_scheduler(num_blocks=11, block_size=4, max_num_batched_tokens=8,
                                  max_model_len=40, enable_prefix_caching=False)
    runner = make_request("r", 23, 10)  # 6 blocks once prefilled; its decodes fit in block 6
    scheduler.add_request(runner)
    for now in (1.0, 2.0, 3.0):
        scheduler.update(scheduler.schedule(now), [1], now)
    assert runner.num_output_tokens == 1 and scheduler.kv_manager.num_free_blocks == 4
    victim = make_request("v", 16, 4)
    victim.num_preemptions = 1  # as if preempted before: 16 tokens = 4 blocks to recompute
    scheduler.add_request(victim)
    # Its next chunk (7 tokens, 2 blocks) would fit, but 4 blocks + 1 of headroom do not.
    output = scheduler.schedule(4.0)
    assert [s.request.request_id for s in output.scheduled] == ["r"]
    scheduler.update(output, [1], 4.0)
    victim.num_preemptions = 0  # a first admission needs only its chunk (2 of 3 free blocks)
    output = scheduler.schedule(5.0)
    assert [s.request.request_id for s in output.scheduled] == ["r", "v"]
