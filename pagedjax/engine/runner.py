"""The model runner: one jit program per (step kind, bucket), the KV cache donated to each step."""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from pagedjax.engine import prompt_logprobs, sampling_step, step_counts, step_results
from pagedjax.engine.step_counts import num_step_compiles, num_step_traces  # noqa: F401
from pagedjax.engine.weight_writer import borrowed_leaves
from pagedjax.kv_offload.block_transfers import BlockTransfers
from pagedjax.lora.slot_weights import SlotSpec, device_slots
from pagedjax.models import (LlamaForCausalLM, ServingGraph, ServingWeights, paged_forward,
                             serving_form)
from pagedjax.models.layers.kv_groups import KVCacheGroups
from pagedjax.models.layers.lora import StepLoRA
from pagedjax.models.loading.placed_weights import LazyModel
from pagedjax.models.quantization.schemes import chunked_products
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, copy_blocks, init_kv_cache
from pagedjax.pallas_kernels.dispatch import TP_AXIS
from pagedjax.pallas_kernels.lora import lora_implementation
from pagedjax.parallel.sharding import (kv_cache_sharding, kv_head_repeats, shard_weights,
                                        weight_sharding)
from pagedjax.pooling.step_states import pooled_states
from pagedjax.scheduler import ARRAY_FIELDS, DECODE, FORWARD_FIELDS, STATIC_FIELDS, BatchPlan
from pagedjax.scheduler.plan import padding_plan

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
        prompt = ()
        if inputs["prompt_targets"].shape[0]:
            prompt = prompt_logprobs.compute(graph, params, hidden, inputs["prompt_targets"],
                                             num_top_logprobs, backend.mesh)
        pooled = ()
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
                                      sampling_step.no_token_mask(logits.shape[0]))
    return sampled, kv_cache


@jax.jit
def _fill_placeholders(token_ids, previous):
    """token_ids (i32[T], from the host) with each placeholder -(row + 1) replaced by
    previous[row]: the token the step before sampled for it, never brought to the host."""
    rows = jax.numpy.maximum(-token_ids - 1, 0)
    return jax.numpy.where(token_ids < 0, previous[rows], token_ids)


# graph, backend, kind and K are static; the KV cache is donated so XLA updates it in place.
_forward = jax.jit(forward_fn, static_argnums=(0, 1, 2, 3), static_argnames=("with_logits",),
                   donate_argnums=(5,))
_step = jax.jit(step_fn, static_argnums=(0, 1, 2), donate_argnums=(4,))


class ModelRunner(BlockTransfers):
    """Owns the model's parameters and the KV cache on device and runs steps from BatchPlans."""

    def __init__(self, model: LlamaForCausalLM | LazyModel, *, num_blocks: int, block_size: int,
                 dtype, backend: AttentionBackend = AttentionBackend(),
                 num_top_logprobs: int = 0, scan_layers: bool | None = None,
                 device: jax.Device | None = None, kv_groups: KVCacheGroups | None = None,
                 lora_spec: SlotSpec | None = None, with_logits: bool = True):
        """backend.mesh, when set, splits the model over its devices (pagedjax.parallel.sharding);
        otherwise everything lives on device (jax.devices()[0] by default). kv_groups: the KV
        cache groups (pagedjax.models.layers.kv_groups; default: one group of every layer).
        lora_spec: the LoRA adapters' device slots (pagedjax.lora.slot_weights), or None.
        with_logits False: a pooling runner's programs, without the vocabulary projection."""
        config = model.config
        mesh = backend.mesh
        shards = 1 if mesh is None else mesh.shape[TP_AXIS]  # tensor parallelism's
        repeats = kv_head_repeats(config.num_kv_heads, shards)
        lazy = isinstance(model, LazyModel)  # read from its checkpoint into place below
        abstract = model.abstract if lazy else model
        self.device = jax.devices()[0] if device is None else device
        if scan_layers is None:  # on the CPU, large layers unrolled
            scan_layers = paged_forward.scan_by_default(abstract, self.device.platform, shards)
        self.graph, params = serving_form(abstract, scan_layers, repeats, kv_groups)
        self.serving_args = (scan_layers, repeats, kv_groups)  # new weights' form (new_weights)
        self.logprobs_mode = "raw_logprobs"  # what logprobs report (EngineConfig.logprobs_mode)
        self.with_logits = with_logits  # fixed: every program compiles with it (forward_fn)
        self.num_kv_groups = 1 if kv_groups is None else kv_groups.num_groups
        self.num_blocks = num_blocks
        self.backend = backend
        self.num_top_logprobs = num_top_logprobs
        self.vocab_size, self.block_size = config.vocab_size, block_size
        self._cache_spec = (self.graph.num_kv_slots, num_blocks, block_size,
                            config.num_kv_heads * repeats, config.kv_head_dim, dtype, backend.name,
                            config.kv_planes)
        # Parameters and caches committed to their devices, whatever their source (random init
        # is uncommitted, a checkpoint loader's device_put is committed): the step's outputs
        # are committed, so mixed inputs would compile every program a second time.
        self.params = self._place(model, params)
        # the leaves sharing the buffers of the model given (update_weights never donates them)
        self.borrowed = frozenset() if lazy else borrowed_leaves(
            self.params, jax.tree.leaves(nnx.state(model)))
        self.weight_sources = None  # where each leaf's values come from (new_weights)
        self.weight_names = None  # their Hugging Face names (named_weights)
        self.kv_cache = self._new_kv_cache()
        self._abstract_args = self._abstract()
        self.lora_spec = lora_spec  # the LoRA adapters' slots (pagedjax.lora.slot_weights)
        self.lora, self._abstract_lora, self._lora_writer = device_slots(lora_spec,
                                                                        self.device, mesh)
        self.step_shapes: set[tuple[str, int, int]] = set()  # the shapes steps have run
        self.channel = None  # multi-host leader: a multihost.LeaderChannel
        self.tier_pool = None  # the prefix cache's host tier (kv_tiers), for the followers
        # (kind, T, B, prompt logprobs?, K, pooling?) -> its forward program, compiled ahead of
        # time from abstract arguments (nothing runs: a warmup thread compiles while the engine
        # steps), each shape once, under its lock.
        self._programs: dict[tuple, jax.stages.Compiled] = {}
        # (B, K) -> the forward's logits (B * (K + 1) rows)
        self._logits_shape: dict[tuple[int, int], jax.ShapeDtypeStruct] = {}
        self._program_locks: dict[tuple, threading.Lock] = {}
        self._fills: dict[tuple[int, int], jax.stages.Compiled] = {}  # fill_program's
        self._block_copies: dict[tuple[str, int], jax.stages.Compiled] = {}  # block_copy's
        self._token_ids_sharding = None  # the forward programs' token_ids' (program())
        self._locks_lock = threading.Lock()

    def _place(self, model, params) -> ServingWeights:
        """The serving weights on this device, or split over the mesh (a LazyModel: read there)."""
        mesh, vocab_size = self.backend.mesh, model.config.vocab_size
        if isinstance(model, LazyModel):
            placement = (weight_sharding(mesh, vocab_size, self.backend.expert_parallel)
                         if mesh is not None else
                         lambda path, leaf: SingleDeviceSharding(self.device))
            return model.place(params, placement)
        if mesh is None:
            return jax.device_put(params, self.device)
        return shard_weights(params, mesh, vocab_size, self.backend.expert_parallel)

    def _abstract(self):
        """The params' and the cache's shapes, dtypes and shardings (programs compile from them)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            (self.params, self.kv_cache))

    @property
    def weight_specs(self):
        """The weights' shapes, dtypes and shardings the programs compiled for (new weights')."""
        return self._abstract_args[0]

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Replaces the pool with one of num_blocks blocks, before any step program is compiled
        (memory_budget sizes it once the weights are placed)."""
        if self._programs:
            raise RuntimeError("the KV pool cannot be resized once step programs are compiled")
        self.num_blocks = num_blocks
        self._cache_spec = (self._cache_spec[0], num_blocks) + self._cache_spec[2:]
        self.kv_cache = None  # freed before the new one is allocated
        self.kv_cache = self._new_kv_cache()
        self._abstract_args = self._abstract()

    def _new_kv_cache(self):
        """A zeroed cache, on one device or split over the mesh's devices (allocated there)."""
        if self.backend.mesh is None:
            return jax.device_put(init_kv_cache(*self._cache_spec), self.device)
        return jax.jit(lambda: init_kv_cache(*self._cache_spec),
                       out_shardings=kv_cache_sharding(self.backend.mesh))()

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed KV cache (after a step that failed lost the donated one)."""
        if self.channel is not None:
            self.channel.reset()
        self.kv_cache = self._new_kv_cache()

    @property
    def kv_cache_lost(self) -> bool:
        """Nothing can be retried: the donated cache is gone (or, multi-host, the group)."""
        if self.channel is not None and self.channel.error is not None:
            return True
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.kv_cache))

    @property
    def num_programs(self) -> int:
        """Step programs compiled so far."""
        return len(self._programs)

    def program(self, kind: str, num_tokens: int, num_seqs: int,
                table_widths: tuple[int, int], with_prompt_logprobs: bool = False,
                num_speculative_tokens: int = 0,
                with_pooling: bool = False) -> jax.stages.Compiled:
        """The forward program of a shape, compiled on first use (from the persistent
        compilation cache when an earlier process compiled it), with its plain sampler; once
        a shape, thread-safe. with_prompt_logprobs: the variant returning every query token's
        prompt logprobs; table_widths: the block tables' (ShapeBuckets.table_widths);
        num_speculative_tokens: K of a speculative step (K + 1 logits a row, verified by the
        sampler); with_pooling: the variant returning the pooled rows' states."""
        key = (kind, num_tokens, num_seqs, with_prompt_logprobs, num_speculative_tokens,
               with_pooling)

        def build():
            step_counts.count("compiles")
            plan = padding_plan(kind, num_tokens, num_seqs, table_widths[0],
                                with_prompt_logprobs, self.num_kv_groups, table_widths[1],
                                num_speculative_tokens, with_pooling)
            inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                  forward_inputs(plan))
            lowered = _forward.lower(self.graph, self.backend, kind, self.num_top_logprobs,
                                     *self._abstract_args, inputs, self._abstract_lora,
                                     with_logits=self.with_logits)
            self._logits_shape[num_seqs, num_speculative_tokens] = lowered.out_info[0]
            if self.with_logits or num_speculative_tokens:  # a pooling runner samples nothing
                self._sampler(plan, sampling_step.no_token_mask(num_seqs))
            compiled = lowered.compile()
            # where every forward program takes its token_ids (over a mesh, the token fills'
            # output is put there)
            self._token_ids_sharding = compiled.input_shardings[0][2]["token_ids"]
            return compiled

        return self._once(self._programs, key, build)

    def write_lora_slot(self, slot: int, arrays: dict) -> None:
        """Writes one adapter's arrays (SlotSpec.host_arrays) into a LoRA slot, in place."""
        self.lora = self._lora_writer(self.lora, np.int32(slot), arrays)

    def fill_program(self, num_tokens: int, num_previous: int) -> jax.stages.Compiled:
        """The program filling a plan's placeholder tokens (i32[num_tokens]) from the previous
        step's sampled ids (i32[num_previous] on this runner's device): async scheduling."""
        def build():
            return _fill_placeholders.lower(
                jax.ShapeDtypeStruct((num_tokens,), np.int32),
                jax.ShapeDtypeStruct((num_previous,), np.int32,
                                     sharding=SingleDeviceSharding(self.device))).compile()

        return self._once(self._fills, (num_tokens, num_previous), build)

    def _once(self, store: dict, key, build) -> jax.stages.Compiled:
        """store[key], made by build() on first use: thread-safe, once per key (a warmup
        thread and the engine's may ask at once)."""
        program = store.get(key)
        if program is not None:
            return program
        with self._locks_lock:
            lock = self._program_locks.setdefault(key, threading.Lock())
        with lock:
            if key not in store:
                store[key] = build()
        return store[key]

    def sampler_variants(self, plan: BatchPlan, penalty_width: int, mask_words: int) -> None:
        """Compiles the sampler programs a step of plan's shape may need besides its plain
        one: with a token mask (W = mask_words words a row), with penalties (their tokens
        penalty_width wide), with both. A pooling runner needs none (dispatch_sample)."""
        if not self.with_logits and not plan.num_speculative_tokens:
            return
        rows = plan.padded_num_seqs * (plan.num_speculative_tokens + 1)
        penalized = dataclasses.replace(
            plan, penalty_tokens=np.full((plan.padded_num_seqs, penalty_width), -1, np.int32))
        mask = np.zeros((rows, mask_words), np.int32)
        for variant, token_mask in ((plan, mask), (penalized, mask), (
                penalized, sampling_step.no_token_mask(plan.padded_num_seqs))):
            self._sampler(variant, token_mask)

    def _sampler(self, plan: BatchPlan, token_mask: np.ndarray) -> jax.stages.Compiled:
        return sampling_step.program(self.num_top_logprobs,
                                     self._logits_shape[plan.padded_num_seqs,
                                                        plan.num_speculative_tokens],
                                     sampling_step.sampling_inputs(plan), token_mask,
                                     self.device, self.logprobs_mode)

    def step(self, plan: BatchPlan, token_mask: np.ndarray | None = None) -> tuple:
        """Runs one step; returns, for the first num_seqs rows, the sampled ids, their logprobs,
        the num_top_logprobs most likely tokens with their logprobs, and the sampled ids'
        ranks; then the prompt logprobs of every query token (None when the plan has no
        prompt_targets) and the pooling rows' hidden states (None without pooling_rows)."""
        return self.fetch(self.dispatch(plan, token_mask))

    def dispatch(self, plan: BatchPlan, token_mask: np.ndarray | None = None) -> "PendingStep":
        """Starts one step and returns at once (JAX's asynchronous dispatch): the device works
        while the caller dispatches other replicas' steps; fetch() waits for its results."""
        return self.dispatch_sample(plan, self.dispatch_forward(plan), token_mask)

    def dispatch_forward(self, plan: BatchPlan,
                         previous: jax.Array | None = None) -> tuple[jax.Array, tuple]:
        """Starts a step's forward; returns its (logits, prompt logprob arrays or ()), on
        device, not waited for. previous: the sampled ids (i32[B'], on device) of the step
        dispatched before this one, which plan's placeholder tokens (-(row + 1): async
        scheduling, scheduler.async_steps) are read from, on the device."""
        program = self.program(plan.kind, plan.padded_num_tokens, plan.padded_num_seqs,
                               plan.table_widths, bool(plan.prompt_targets.shape[0]),
                               plan.num_speculative_tokens, bool(plan.pooling_rows.shape[0]))
        inputs = forward_inputs(plan)
        if previous is not None:
            if self.channel is not None:
                raise ValueError("async scheduling is not supported multi-host")
            fill = self.fill_program(plan.padded_num_tokens, previous.shape[0])
            inputs["token_ids"] = fill(plan.token_ids, previous)
            if self.backend.mesh is not None:  # from this runner's device to the mesh's
                inputs["token_ids"] = jax.device_put(inputs["token_ids"],
                                                     self._token_ids_sharding)
        if self.channel is None:
            logits, extras, self.kv_cache = program(self.params, self.kv_cache, inputs,
                                                    self.lora)
        else:  # multi-host: the followers run it too (multihost.py); a failure is the group's
            self.channel.step(plan)
            try:
                logits, extras, self.kv_cache = program(self.params, self.kv_cache, inputs,
                                                        self.lora)
            except Exception as error:
                raise self.channel.broken(error) from error
        self.step_shapes.add((plan.kind, plan.padded_num_tokens, plan.padded_num_seqs))
        return logits, extras

    def dispatch_sample(self, plan: BatchPlan, forward: tuple[jax.Array, tuple],
                        token_mask: np.ndarray | None = None) -> "PendingStep":
        """Starts the sampler on a dispatched forward's logits, on this runner's device (over a
        mesh the logits are replicated: its copy there), token_mask (i32[B, W], W = ceil(V / 32),
        or None) limiting what each row may sample."""
        logits, (prompt, pooled) = forward
        if not self.with_logits and not plan.num_speculative_tokens:  # tokens nobody reads
            return PendingStep(sampling_step.unsampled(plan.padded_num_seqs,
                                                       self.num_top_logprobs),
                               int(plan.num_seqs), prompt, pooled)
        if token_mask is None:
            token_mask = sampling_step.no_token_mask(plan.padded_num_seqs)
        if not logits.is_fully_addressable or len(logits.devices()) > 1:
            logits = next(s.data for s in logits.addressable_shards if s.device == self.device)
        program = self._sampler(plan, token_mask)
        sampled = program(logits, sampling_step.sampling_inputs(plan), token_mask)
        return PendingStep(sampled, int(plan.num_seqs), prompt, pooled)

    def fetch(self, pending: "PendingStep") -> step_results.StepResults:
        """A dispatched step's results on the host (waits for the device): the sampler's five
        arrays for the real rows, the prompt logprob arrays or None, the pooled states or None."""
        try:
            sampled = tuple(np.asarray(x)[:pending.num_seqs] for x in pending.sampled)
            prompt = tuple(np.asarray(x) for x in pending.prompt) or None
            pooled = np.asarray(pending.pooled[0]) if pending.pooled else None
            return step_results.StepResults(*sampled, prompt, pooled)
        except Exception as error:
            if self.channel is not None:
                raise self.channel.broken(error) from error
            raise


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A dispatched step: its outputs (not waited for), the rows that are real, and the
    forward's prompt logprob arrays and pooled hidden states (each empty when it has none)."""

    sampled: tuple
    num_seqs: int
    prompt: tuple = ()
    pooled: tuple = ()
