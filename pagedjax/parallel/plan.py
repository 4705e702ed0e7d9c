"""Planning a parallel deployment without its chips: the roofline step-time model of a model
split tensor-parallel (a device's weights and KV from pagedjax.parallel.sharding's formulas, the
collectives on the chip's link), and the data-parallel engine's placement rule for the
simulator's replicas (pagedjax.parallel.routing_policy, as the engine and the router use it)."""

from __future__ import annotations

from typing import Sequence

from pagedjax.models import LlamaConfig
from pagedjax.parallel.routing_policy import Backend, RoutingPolicy, prompt_chunks
from pagedjax.parallel.sharding import (check_tensor_parallel, kv_bytes_per_block_per_device,
                                        weight_bytes_per_device)
from pagedjax.scheduler.chips import Chip
from pagedjax.scheduler.cost_model import RooflineCost

ACTIVATION_BYTES = 2  # bf16 hidden states all-reduced
LOGIT_BYTES = 4  # f32 logits gathered for sampling


def roofline_cost(config: LlamaConfig, chip: Chip, tensor_parallel_size: int = 1,
                  kv_dtype: str = "bfloat16", **utilisation) -> RooflineCost:
    """A RooflineCost for one replica of config over tensor_parallel_size chips (bf16 weights;
    KV in kv_dtype); utilisation: flops_util, bw_util, overhead_s."""
    tp = tensor_parallel_size
    check_tensor_parallel(config, tp, check_devices=False)
    expert_bytes = (config.num_sparse_layers * config.num_experts * 3 * config.hidden_size
                    * config.expert_intermediate_size * 2 // tp)  # bf16, F split TP ways
    return RooflineCost(
        chip, config.num_active_params, weight_bytes_per_device(config, tp, 2),
        kv_bytes_per_block_per_device(config, 1, tp, kv_dtype,
                                      num_slots=config.num_attention_layers),
        2 * config.num_attention_layers * config.num_heads * sum(config.attended_dims),
        tensor_parallel_size=tp,
        allreduce_bytes_per_token=2 * config.num_layers * config.hidden_size * ACTIVATION_BYTES,
        gather_bytes_per_seq=config.vocab_size * LOGIT_BYTES, expert_bytes=expert_bytes,
        expert_share=(config.num_experts_per_tok / config.num_experts
                      if config.num_experts else 0.0), **utilisation)


def prefix_affinity_placer(replicas: int, block_size: int):
    """place(prompt token ids, unfinished requests of each replica) -> replica, by the
    data-parallel engine's rule (kv_aware over block-sized chunks)."""
    backends = [Backend(f"replica:{r}") for r in range(replicas)]
    policy = RoutingPolicy(backends, "kv_aware")

    def place(prompt_token_ids: Sequence[int], loads: list[int]) -> int:
        for backend, load in zip(backends, loads):
            backend.in_flight = load
        chunks = prompt_chunks(prompt_token_ids, ids_chunk=block_size)
        backend, _ = policy.choose(chunks)
        policy.record(backend, chunks)
        return backends.index(backend)

    return place
