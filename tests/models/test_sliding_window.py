"""Sliding-window attention: the paged engine against a dense windowed reference, and blocks
outside every window released as sequences grow."""

import dataclasses

import numpy as np
import pytest
from helpers import until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models import get_config, init_model
from pagedjax.models.training.generate import dense_greedy_generate

WINDOW = 10
BLOCK = 4


@pytest.fixture(scope="module")
def window_model():
    return init_model(dataclasses.replace(get_config("debug-tiny"), sliding_window=WINDOW), seed=0)


def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, n).tolist() for n in (3, 25, 40, 9, 17)]


@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(max_num_batched_tokens=8),  # chunks smaller than the window
    dict(num_blocks=16, max_num_batched_tokens=16),  # preemption with the window
    dict(attention_backend="gpu", attention_interpret=True),
    # each step dispatched before the previous one's results: blocks out of the window freed
    # as the scheduler is advanced past the step in flight
    dict(num_blocks=16, max_num_batched_tokens=16, async_scheduling=True),
], ids=["plain", "chunked", "preemption", "gpu_kernels", "async_scheduling"])
@pytest.mark.quick_variant('chunked')  # the others: make test-slow
def test_greedy_equals_dense_windowed_recompute(window_model, engine_kwargs):
    dense = dense_greedy_generate(window_model, prompts(), 16)
    config = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                  min_seq_bucket=8, block_size=BLOCK)
    engine = LLMEngine(window_model, EngineConfig(**{**config, **engine_kwargs}))
    ids = [engine.add_request(p, SamplingParams(max_tokens=16, temperature=0.0))
           for p in prompts()]
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == dense
    assert engine.scheduler.kv_manager.num_used_blocks == 0


def test_window_changes_the_output(window_model, tiny_model):
    """The window is real: without it the same weights give other tokens."""
    assert dense_greedy_generate(window_model, prompts(), 16) != dense_greedy_generate(
        tiny_model, prompts(), 16)


def test_blocks_outside_the_window_are_released(window_model):
    engine = LLMEngine(window_model, EngineConfig(max_model_len=64, max_num_seqs=2,
                                                  max_num_batched_tokens=32, block_size=BLOCK,
                                                  enable_prefix_caching=False))
    engine.add_request(list(range(1, 31)), SamplingParams(max_tokens=30, temperature=0.0))
    kv = engine.scheduler.kv_manager
    most = 0
    for _ in until_done(engine):
        engine.step()
        most = max(most, kv.num_used_blocks)
    # A query sees the last 10 positions: at most 3 full blocks plus the one being written.
    assert most <= -(-WINDOW // BLOCK) + 1
