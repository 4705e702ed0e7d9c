"""The paged engine against dense full-recompute greedy decoding of the same model."""

import numpy as np
import pytest
from helpers import until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models.training.generate import dense_greedy_generate

PROMPT_LENS = [3, 17, 1, 40, 9, 25, 64, 2]
MAX_TOKENS = 12
# The TPU interpreter simulates every DMA and semaphore (~3 s a step on 2 cores): its run stops
# at 6 tokens, past the chunked prefills and into mixed and decode steps, and is held to the
# first 6 of the dense tokens.
TPU_INTERPRET_MAX_TOKENS = 6


def prompts():
    rng = np.random.default_rng(42)
    return [rng.integers(0, 256, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def dense_outputs(tiny_model):
    return dense_greedy_generate(tiny_model, prompts(), MAX_TOKENS)


def run_engine(model, max_tokens=MAX_TOKENS, num_prompts=None, **kwargs):
    base = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64, min_seq_bucket=8)
    engine = LLMEngine(model, EngineConfig(**{**base, **kwargs}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts()[:num_prompts]]
    outputs = {}
    for _ in until_done(engine):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return [outputs[i].output_token_ids for i in ids], engine


@pytest.mark.parametrize("engine_kwargs", [
    dict(block_size=1),
    dict(block_size=4),
    dict(block_size=16),
    dict(block_size=4, max_num_batched_tokens=16),  # every prompt over 16 tokens is chunked
    dict(block_size=4, policy="prefill_first"),
    dict(block_size=4, policy="decode_first", max_num_batched_tokens=32),
    # Every step on the ragged programs (no decode programs), decodes padded like prefills.
    dict(block_size=4, step_programs="ragged"),
    # The GPU Pallas kernels through the interpreter, chunked prefill and mixed steps included.
    dict(block_size=8, max_num_batched_tokens=16, attention_backend="gpu",
         attention_interpret=True),
    # Blocks of 16, TPU-sized: few simulated DMAs a 128-key compute block (12 s: make
    # test-slow; the TPU kernels' own tests and the other families' TPU engine cases stay in
    # make test).
    pytest.param(dict(block_size=16, max_num_batched_tokens=32, attention_backend="tpu",
                      attention_interpret=True), marks=pytest.mark.slow),
], ids=["bs1", "bs4", "bs16", "chunked", "prefill_first", "decode_first", "ragged", "gpu_kernels",
        "tpu_kernels"])
@pytest.mark.quick_variant('chunked')  # the others: make test-slow
def test_greedy_equals_dense_recompute(tiny_model, dense_outputs, engine_kwargs):
    max_tokens = (TPU_INTERPRET_MAX_TOKENS if engine_kwargs.get("attention_backend") == "tpu"
                  else MAX_TOKENS)
    outputs, engine = run_engine(tiny_model, max_tokens=max_tokens, **engine_kwargs)
    assert outputs == [tokens[:max_tokens] for tokens in dense_outputs]
    assert engine.scheduler.kv_manager.num_used_blocks == 0, "blocks leaked"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_equals_dense_under_preemption(tiny_model, dense_outputs, async_scheduling):
    """Async scheduling too: each step dispatched while the one before runs, its tokens read
    on the device, chunked prefills and preemption (of requests the step in flight runs)."""
    # 22 usable blocks of 4 tokens: the 76-token request alone needs 19 of them.
    outputs, engine = run_engine(tiny_model, block_size=4, num_blocks=23,
                                 max_num_batched_tokens=16, async_scheduling=async_scheduling)
    assert engine.stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert outputs == dense_outputs
    if async_scheduling:
        assert engine.stats.num_ahead_steps > engine.stats.num_steps // 2


def test_chunked_prefill_really_chunked(tiny_model):
    _, engine = run_engine(tiny_model, block_size=4, max_num_batched_tokens=16)
    # The 64-token prompt alone needs 4 prefill steps at 16 tokens per step.
    assert engine.stats.num_prefill_steps >= 4
    assert all(t <= 16 for kind, t, _ in engine.runner.step_shapes if kind == "prefill")
