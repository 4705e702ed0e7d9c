"""The step's programs as pure functions (the model's forward, the whole step) and their jitted
forms, which ModelRunner compiles one of per (step kind, bucket): the KV cache donated to each."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from pagedjax.engine import prompt_logprobs, sampling_step, step_counts
from pagedjax.models import ServingGraph, ServingWeights, paged_forward
from pagedjax.models.layers.lora import StepLoRA
from pagedjax.models.quantization.schemes import chunked_products
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, copy_blocks
from pagedjax.pallas_kernels.lora import lora_implementation
from pagedjax.pooling.step_states import pooled_states
from pagedjax.scheduler import ARRAY_FIELDS, DECODE, FORWARD_FIELDS, STATIC_FIELDS, BatchPlan

jax.tree_util.register_dataclass(BatchPlan, data_fields=list(ARRAY_FIELDS),
                                 meta_fields=list(STATIC_FIELDS))

def forward_fn(graph: ServingGraph, backend: AttentionBackend, kind: str, num_top_logprobs: int,
               params: ServingWeights, kv_cache, inputs: dict, lora: dict | None = None,
               with_logits: bool = True):
    """The model's part of a step as a pure function: returns (logits f32[B, V], (prompt,
    pooled), kv_cache). inputs: the plan's FORWARD_FIELDS (kind is static: DECODE runs the
    decode kernels); prompt is () or, when the plan has prompt_targets, prompt_logprobs.compute's
    arrays for every query token (num_top_logprobs of them a token); pooled is () or, when the
    plan has pooling_rows, (pooled_states,). lora: the LoRA adapters' device slots
    (pagedjax.lora.slot_weights), each token's in inputs["lora_slots"]; None without them.
    with_logits False (a pooling runner's: its tokens are nobody's): no vocabulary projection,
    the logits are zeros of max(1, num_top_logprobs) columns."""
    step_counts.count("traces")  # runs at trace time only
    blocks_per_layer = kv_cache.shape[2] // graph.num_kv_slots
    kv_cache = copy_blocks(kv_cache, inputs["copy_src"], inputs["copy_dst"],
                           inputs["num_copies"], backend, num_blocks=blocks_per_layer)
    metadata = AttentionMetadata(
        slot_mapping=inputs["slot_mapping"], block_tables=inputs["block_tables"],
        kv_lens=inputs["kv_lens"], cu_q_lens=inputs["cu_q_lens"], num_seqs=inputs["num_seqs"],
        decode_only=kind == DECODE, group_slot_mapping=inputs["group_slot_mapping"],
        group_block_tables=inputs["group_block_tables"]).with_logical_group_tables()
    # quantized weights: large products in cache-sized chunks on the CPU reference only
    with chunked_products(backend.name == "reference" and backend.mesh is None):
        step_lora = None if lora is None else StepLoRA(
            inputs["lora_slots"], lora, lora_implementation(backend), backend.interpret,
            jax.numpy.any(inputs["lora_slots"] >= 0), backend.mesh)
        hidden, kv_cache = paged_forward.forward_paged(
            graph, params, kv_cache, inputs["token_ids"], inputs["positions"], metadata, backend,
            step_lora)
        logits = paged_forward.logits(graph, params, hidden[inputs["logits_indices"]])  # f32[B, V]
        if not with_logits:
            logits = jax.numpy.zeros((logits.shape[0], max(1, num_top_logprobs)), logits.dtype)
        if backend.mesh is not None:  # vocab-split: one all-gather, so every device holds
            # whole rows for the sampler
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(backend.mesh, P()))
        prompt: tuple = ()
        if inputs["prompt_targets"].shape[0]:
            prompt = prompt_logprobs.compute(graph, params, hidden, inputs["prompt_targets"],
                                             num_top_logprobs, backend.mesh)
        pooled: tuple = ()
        if inputs["pooling_rows"].shape[0]:
            pooled = (pooled_states(graph, params, hidden, inputs["pooling_rows"], backend.mesh),)
    return logits, (prompt, pooled), kv_cache


def forward_inputs(plan: BatchPlan) -> dict:
    return {name: getattr(plan, name) for name in FORWARD_FIELDS}


def step_fn(graph: ServingGraph, backend: AttentionBackend, num_top_logprobs: int,
            params: ServingWeights, kv_cache, plan: BatchPlan, lora: dict | None = None):
    """One whole engine step as one pure function (the runner runs it as two programs, forward
    and sampler; ahead-of-time analyses compile it whole): returns (sampled, kv_cache) where
    sampled is (ids i32[B], logprobs f32[B], top ids i32[B, K], top logprobs f32[B, K],
    ranks i32[B])."""
    logits, _, kv_cache = forward_fn(graph, backend, plan.kind, num_top_logprobs, params,
                                     kv_cache, forward_inputs(plan), lora)
    sampled = sampling_step.sample_fn(num_top_logprobs, "raw_logprobs", logits,
                                      sampling_step.sampling_inputs(plan),
                                      jax.numpy.asarray(
                                          sampling_step.no_token_mask(logits.shape[0])))
    return sampled, kv_cache


@jax.jit
def fill_placeholders(token_ids, previous):
    """token_ids (i32[T], from the host) with each placeholder -(row + 1) replaced by
    previous[row]: the token the step before sampled for it, never brought to the host."""
    rows = jax.numpy.maximum(-token_ids - 1, 0)
    return jax.numpy.where(token_ids < 0, previous[rows], token_ids)


# graph, backend, kind and K are static; the KV cache is donated so XLA updates it in place.
forward_program = jax.jit(forward_fn, static_argnums=(0, 1, 2, 3),
                          static_argnames=("with_logits",), donate_argnums=(5,))
step_program = jax.jit(step_fn, static_argnums=(0, 1, 2), donate_argnums=(4,))
