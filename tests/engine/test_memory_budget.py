"""gpu_memory_utilization (vLLM's): the KV pool takes what the device's memory leaves after the
weights and the largest step programs' activations, measured by XLA's memory analysis."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.engine import memory_budget, sampling_step
from pagedjax.engine.memory_budget import device_memory
from pagedjax.frontend.llm import DEFAULT_MODEL as LLM_DEFAULT
from pagedjax.tools.engine_args import add_engine_args, engine_kwargs

SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128)


def _utilization_for(extra_bytes: int, **config) -> tuple[float, LLM]:
    """A utilization leaving about extra_bytes beyond the weights (the CPU reports no memory
    statistics: the limit is the host's memory), and an engine sized by num_blocks to compare."""
    reference = LLM(**config, num_blocks=64)
    limit, _, _ = device_memory(reference.engine.runner.device, reference.engine.runner.params)
    weights = sum(x.nbytes for x in jax.tree.leaves(reference.engine.runner.params))
    return (weights + extra_bytes) / limit, reference


@pytest.mark.slow  # make test-slow
def test_pool_is_what_the_weights_and_activations_leave():
    utilization, reference = _utilization_for(40 * 2**20, **SMALL)
    llm = LLM(**SMALL, gpu_memory_utilization=utilization)
    budget, engine = llm.engine.memory_budget, llm.engine
    weights = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params))
    assert budget.source == "host memory" and budget.in_use_bytes == weights
    assert budget.activation_bytes > 0
    left = int(utilization * budget.limit_bytes) - weights - budget.activation_bytes
    assert engine.num_blocks == left // engine.bytes_per_block_per_device == budget.num_blocks
    assert sum(x.nbytes for x in jax.tree.leaves(engine.runner.kv_cache)) == \
        engine.num_blocks * engine.bytes_per_block_per_device  # the pool itself, reallocated
    assert engine.scheduler.kv_manager.pool.num_usable_blocks == engine.num_blocks - 1
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["copy:hello=", "rev:paged="]
    assert [o.text for o in llm.generate(prompts, params, use_tqdm=False)] == \
        [o.text for o in reference.generate(prompts, params, use_tqdm=False)]
    # Measured from the programs: four times the token budget reserves more.
    bigger = LLM(**dict(SMALL, max_num_batched_tokens=512), gpu_memory_utilization=utilization)
    assert bigger.engine.memory_budget.activation_bytes > budget.activation_bytes
    assert bigger.engine.num_blocks < engine.num_blocks


def test_reserve_is_the_largest_forward_plus_the_sampler(monkeypatch):
    """The reserve covers both programs a step runs: the largest forward's bytes and, on top,
    the sampler's (its [B, V] scratch), each from XLA's memory analysis of the compiled
    program."""
    engine = LLM(**SMALL, num_blocks=64).engine
    samplers, forwards = [], []
    real_program, real_bytes = sampling_step.program, memory_budget._program_bytes

    def program(*args):
        samplers.append(real_program(*args))
        return samplers[-1]

    def program_bytes(compiled):
        if not any(compiled is s for s in samplers):
            forwards.append(real_bytes(compiled))
        return real_bytes(compiled)

    monkeypatch.setattr(sampling_step, "program", program)
    monkeypatch.setattr(memory_budget, "_program_bytes", program_bytes)
    reserved = memory_budget.activation_bytes(engine.runner, engine.buckets)
    assert len(samplers) == 1 and len(forwards) == 2  # the largest prefill and decode
    sampler = real_bytes(samplers[0])
    assert sampler > 0 and min(forwards) > 0
    assert reserved == max(forwards) + sampler


def test_too_little_memory_and_two_pool_sizes_are_refused_by_name():
    utilization, _ = _utilization_for(0, **SMALL)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization .* not two KV blocks"):
        LLM(**SMALL, gpu_memory_utilization=utilization)
    with pytest.raises(ValueError, match="not num_blocks and gpu_memory_utilization"):
        LLM(**SMALL, num_blocks=10, gpu_memory_utilization=0.5)
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
            LLM(**SMALL, gpu_memory_utilization=bad)


def test_backend_memory_statistics_are_used_where_reported():
    @dataclasses.dataclass
    class Device:  # what a GPU or TPU device answers
        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 3 * 2**30}

    assert device_memory(Device(), params={}) == (80 * 2**30, 3 * 2**30, "memory_stats")


def test_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--gpu-memory-utilization", "0.85"])
    assert engine_kwargs(args)["gpu_memory_utilization"] == 0.85


@pytest.mark.parametrize("num_kv_heads, kv_cache_dtype", [(1, "auto"), (2, "auto"),
                                                         (1, "int8")])
@pytest.mark.quick_variant('2-auto')  # the others: make test-slow
def test_a_step_updates_the_pool_in_place(num_kv_heads, kv_cache_dtype):
    """A decode and a prefill program's temporaries stay below half the KV pool's bytes: the
    donated cache is written in place, not copied. (With one KV head, writing through a
    [2, K, NB * S, H] view of the cache made XLA on the CPU copy the whole pool every step:
    a 26-layer model's decode step went from 47 to 595 ms as its pool grew 13x.)"""

    from pagedjax.engine.config import EngineConfig
    from pagedjax.engine.runner import ModelRunner
    from pagedjax.models import get_config, init_model
    from pagedjax.scheduler import DECODE, PREFILL

    config = dataclasses.replace(get_config("demo-small"), num_layers=2, num_heads=4,
                                 num_kv_heads=num_kv_heads, head_dim=64, hidden_size=256,
                                 intermediate_size=512)
    dtype = EngineConfig(kv_cache_dtype=kv_cache_dtype).kv_np_dtype
    runner = ModelRunner(init_model(config, seed=0), num_blocks=8193, block_size=16,
                         dtype=dtype)
    pool = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.kv_cache))
    for kind, tokens in ((DECODE, 8), (PREFILL, 64)):
        analysis = runner.program(kind, tokens, 8, (33, 33)).memory_analysis()
        assert analysis.temp_size_in_bytes < pool / 2, (kind, analysis.temp_size_in_bytes, pool)


def test_held_memory_is_the_weights_and_the_pool_by_their_formulas():
    """What `pagedjax serve` logs at start: the weights' bytes (the model's parameters, counted
    from the model) and the pool's (num_blocks x the KV-cache formula's bytes a block)."""
    from flax import nnx

    from pagedjax.frontend.llm import load_model

    model = load_model(LLM_DEFAULT, seed=0)
    llm = LLM(model, **SMALL, num_blocks=40)
    weights, pool = memory_budget.held_memory(llm.engine)
    assert weights == sum(x.size * x.dtype.itemsize
                          for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert pool == 40 * llm.engine.bytes_per_block
    from pagedjax.serving.metrics import ServerMetrics  # and in /metrics
    metrics = ServerMetrics(llm.engine.stats, "m", held_memory=llm.engine.held_memory)
    assert (metrics.weights_bytes._value.get(), metrics.kv_cache_pool_bytes._value.get()) == (
        weights, pool)
    line = memory_budget.describe_held(llm.engine)
    assert f"KV pool {pool / 2**20:,.0f} MiB (39 blocks of 16 tokens: as configured)" in line
    full = memory_budget.describe_held(LLM(model, **SMALL).engine)
    assert "the full reservation, max_num_seqs 8 x max_model_len 128" in full
