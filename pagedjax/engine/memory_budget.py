"""vLLM's gpu_memory_utilization: the KV pool sized from the memory a device has left.

    budget = utilization x the device's memory limit
             - what is in use once the weights are placed
             - the activations of the largest step programs (XLA's own memory analysis)

The limit is what the backend lets JAX allocate (`Device.memory_stats()["bytes_limit"]`: a
TPU's whole HBM; on a GPU XLA_PYTHON_CLIENT_MEM_FRACTION of it, 75% unless set: set it to .95
for vLLM's meaning of "a fraction of the GPU"). A backend that reports no memory statistics (the
CPU) counts the host's physical memory as the limit and the weights' bytes on the device as what
is in use. The activations are measured, not guessed: the largest prefill program (with prompt
logprobs, its superset), the largest decode program and the sampler are compiled ahead of time
against a provisional two-block cache (their scratch does not depend on the pool's size) and
XLA's memory analysis gives each one's temporary and output bytes; the largest forward plus the
sampler is reserved. Under tensor parallelism every figure is one device's.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from pagedjax.engine import sampling_step
from pagedjax.scheduler import DECODE, PREFILL


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """How a pool was sized (bytes are one device's)."""

    utilization: float
    limit_bytes: int  # what the backend lets JAX allocate (or the host's memory)
    in_use_bytes: int  # weights and anything else allocated before the pool
    activation_bytes: int  # reserved for the largest step programs' scratch and outputs
    kv_cache_bytes: int  # what is left for the pool
    num_blocks: int  # the null block included
    source: str  # "memory_stats" or "host memory"

    def describe(self) -> str:
        gib = 2**30
        return (f"KV pool {self.num_blocks} blocks = {self.utilization:g} x "
                f"{self.limit_bytes / gib:.2f} GiB ({self.source}) - {self.in_use_bytes / gib:.2f}"
                f" GiB in use - {self.activation_bytes / gib:.3f} GiB activations")


def device_memory(device: jax.Device, params) -> tuple[int, int, str]:
    """(limit, in use, source) for device; params are the placed weights (counted as what is in
    use where the backend reports nothing)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)), "memory_stats"
    in_use = sum(shard.data.nbytes for leaf in jax.tree.leaves(params)
                 for shard in leaf.addressable_shards if shard.device == device)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), in_use, "host memory"


def _program_bytes(compiled) -> int:
    """A compiled program's scratch and outputs, less the outputs that alias inputs (the KV
    cache, donated)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return 0
    return max(0, int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)
               - int(stats.alias_size_in_bytes))


def activation_bytes(runner, buckets) -> int:
    """The largest prefill and decode programs' bytes, the larger one, plus the sampler's at the
    most sequences (compiled, not run)."""
    from pagedjax.engine.step_functions import forward_inputs
    from pagedjax.scheduler.plan import padding_plan

    shapes = [(PREFILL, *max(buckets.prefill_shapes()), True)]
    if buckets.decode_programs:
        num_seqs = max(buckets.decode_shapes())
        shapes.append((DECODE, num_seqs, num_seqs, False))
    forward, logits = 0, None
    for kind, num_tokens, num_seqs, prompt in shapes:
        plan = padding_plan(kind, num_tokens, num_seqs, buckets.max_blocks_per_seq, prompt,
                            runner.num_kv_groups, buckets.group_table_width)
        inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                              forward_inputs(plan))
        lowered = runner.lower_forward(kind, inputs)
        forward = max(forward, _program_bytes(lowered.compile()))
        if logits is None or lowered.out_info[0].shape[0] > logits[0].shape[0]:
            logits = (lowered.out_info[0], plan)
    assert logits is not None, "no step shape"  # every engine has a decode bucket
    shape, plan = logits
    sampler = sampling_step.program(runner.num_top_logprobs, shape,
                                    sampling_step.sampling_inputs(plan),
                                    sampling_step.no_token_mask(plan.padded_num_seqs),
                                    runner.device, runner.logprobs_mode)
    return forward + _program_bytes(sampler)


def measure(runner, config, buckets, bytes_per_block: int) -> MemoryBudget:
    """The pool gpu_memory_utilization allows on runner's device (its weights placed, its cache
    provisional); raises ValueError naming the field when not even two blocks fit."""
    utilization = config.gpu_memory_utilization
    limit, in_use, source = device_memory(runner.device, runner.params)
    reserve = activation_bytes(runner, buckets)
    available = int(utilization * limit) - in_use - reserve
    num_blocks = max(0, available) // bytes_per_block
    if num_blocks < 2:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization ({utilization:g}) of {limit / gib:.2f} GiB ({source}) "
            f"leaves {available / gib:.3f} GiB after {in_use / gib:.2f} GiB in use and "
            f"{reserve / gib:.3f} GiB of activations: not two KV blocks of {bytes_per_block} "
            f"bytes; raise it, or give num_blocks / kv_cache_memory_bytes")
    return MemoryBudget(utilization, limit, in_use, reserve, num_blocks * bytes_per_block,
                        num_blocks, source)


def held_memory(engine) -> tuple[int, int]:
    """(weights, KV pool) bytes an engine holds over all its devices (a data-parallel engine's
    replicas summed; under tensor parallelism the pool's repeated KV heads counted)."""
    replicas = engine.replicas
    weights = sum(leaf.nbytes for r in replicas for leaf in jax.tree.leaves(r.runner.params))
    pool = sum(leaf.nbytes for r in replicas for leaf in jax.tree.leaves(r.runner.kv_cache))
    return weights, pool


def describe_held(engine) -> str:
    """What a server holds once started, and what sized its pool (the log's line)."""
    config = engine.config
    weights, pool = held_memory(engine)
    replicas = engine.replicas
    blocks = sum(r.num_blocks - 1 for r in replicas)  # the null block left out
    if not blocks:  # pagedjax.engine.encoder_engine: a dense encoder
        return f"memory: weights {weights / 2**20:,.0f} MiB, no KV cache (a dense encoder)"
    if config.gpu_memory_utilization is not None:
        sized = f"gpu_memory_utilization {config.gpu_memory_utilization:g}"
    elif config.num_blocks is not None or config.kv_cache_memory_bytes is not None:
        sized = "as configured"
    else:
        sized = (f"the full reservation, max_num_seqs {config.max_num_seqs} x max_model_len "
                 f"{config.max_model_len}; --num-blocks, --kv-cache-memory-gib or "
                 f"--gpu-memory-utilization size it")
    mib = 2**20
    return (f"memory: weights {weights / mib:,.0f} MiB, KV pool {pool / mib:,.0f} MiB "
            f"({blocks:,} blocks of {config.block_size} tokens: {sized})")


def memory_in_use(engine) -> tuple[int, int | None, str]:
    """(bytes in use, limit or None, source) over an engine's devices in this process (a
    data-parallel engine's replicas summed; multi-host: this process's devices): the backend's
    memory_stats where it reports them, else what the engine itself holds there (its shards of
    the weights and the KV pool)."""
    replicas = engine.replicas
    here = jax.process_index()
    devices = [d for r in replicas for d in r.devices if d.process_index == here]
    found = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    stats = [s for s in found if s and "bytes_in_use" in s]
    if stats and len(stats) == len(found):
        limits = [s.get("bytes_limit") for s in stats]
        return (sum(int(s["bytes_in_use"]) for s in stats),
                sum(limits) if all(limits) else None, "memory_stats")
    held = 0
    for r in replicas:
        for leaf in jax.tree.leaves((r.runner.params, r.runner.kv_cache)):
            if not leaf.is_deleted():
                held += sum(shard.data.nbytes for shard in leaf.addressable_shards)
    return held, None, "engine"
