"""The model runner: one jit program per (step kind, bucket), the KV cache donated to each step."""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from pagedjax.engine import sampling_step, step_counts, step_functions, step_results
from pagedjax.engine.step_counts import num_step_compiles, num_step_traces  # noqa: F401
from pagedjax.engine.weight_writer import borrowed_leaves
from pagedjax.kv_offload.block_transfers import BlockTransfers
from pagedjax.lora.slot_weights import SlotSpec, device_slots
from pagedjax.models import LlamaForCausalLM, ServingWeights, paged_forward, serving_form
from pagedjax.models.layers.kv_groups import KVCacheGroups
from pagedjax.models.loading.placed_weights import LazyModel
from pagedjax.pallas_kernels import AttentionBackend, init_kv_cache
from pagedjax.pallas_kernels.dispatch import TP_AXIS
from pagedjax.parallel.sharding import (kv_cache_sharding, kv_head_repeats, shard_weights,
                                        weight_sharding)
from pagedjax.scheduler import BatchPlan
from pagedjax.scheduler.plan import padding_plan


class ModelRunner(BlockTransfers):
    """Owns the model's parameters and the KV cache on device and runs steps from BatchPlans."""

    def __init__(self, model: LlamaForCausalLM | LazyModel, *, num_blocks: int, block_size: int,
                 dtype, backend: AttentionBackend = AttentionBackend(),
                 num_top_logprobs: int = 0, scan_layers: bool | None = None,
                 device: jax.Device | None = None, kv_groups: KVCacheGroups | None = None,
                 lora_spec: SlotSpec | None = None, with_logits: bool = True,
                 logprobs_mode: str = "raw_logprobs"):
        """backend.mesh, when set, splits the model over its devices (pagedjax.parallel.sharding);
        otherwise everything lives on device (jax.devices()[0] by default). kv_groups: the KV
        cache groups (pagedjax.models.layers.kv_groups; default: one group of every layer).
        lora_spec: the LoRA adapters' device slots (pagedjax.lora.slot_weights), or None.
        with_logits False: a pooling runner's programs, without the vocabulary projection.
        logprobs_mode: what logprobs report (EngineConfig.logprobs_mode)."""
        config = model.config
        mesh = backend.mesh
        shards = 1 if mesh is None else mesh.shape[TP_AXIS]  # tensor parallelism's
        repeats = kv_head_repeats(config.num_kv_heads, shards)
        # a LazyModel is read from its checkpoint into place below
        abstract = model.abstract if isinstance(model, LazyModel) else model
        self.device = jax.devices()[0] if device is None else device
        if scan_layers is None:  # on the CPU, large layers unrolled
            scan_layers = paged_forward.scan_by_default(abstract, self.device.platform, shards)
        self.graph, params = serving_form(abstract, scan_layers, repeats, kv_groups)
        self.serving_args = (scan_layers, repeats, kv_groups)  # new weights' form (new_weights)
        self.logprobs_mode = logprobs_mode
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
        self.borrowed = frozenset() if isinstance(model, LazyModel) else borrowed_leaves(
            self.params, jax.tree.leaves(nnx.state(model)))
        self._layouts: dict[str, object] = {}  # cached_layout's
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

    # ---- what the engine changes, through the runner (no other module assigns its fields) ----

    def set_params(self, params, borrowed: frozenset | None = None) -> None:
        """Serves params from the next step on (None: no weights on the device; their specs:
        asleep, awaiting new ones). borrowed: the leaves that share a caller's buffers (never
        donated by an update; None keeps the set as it is)."""
        self.params = params
        if borrowed is not None:
            self.borrowed = borrowed

    def drop_kv_cache(self) -> None:
        """The KV cache off the device (sleep); restore_kv_cache brings a zeroed one back."""
        self.kv_cache = None

    def restore_kv_cache(self) -> None:
        self.kv_cache = self._new_kv_cache()

    def swap_kv_cache(self, kv_cache) -> None:
        """The cache a program that took this runner's (donated) returned."""
        self.kv_cache = kv_cache

    def lead(self, channel) -> None:
        """Multi-host: this runner's steps and moves are announced to the followers first."""
        self.channel = channel

    def attach_tier_pool(self, pool) -> None:
        """The prefix cache's host tier (kv_tiers), which a multi-host follower's moves use."""
        self.tier_pool = pool

    def cached_layout(self, name: str, build):
        """build(), once per name: what is derived from the weights' layout alone (their
        sources, their Hugging Face names), which no update or sleep changes."""
        if name not in self._layouts:
            self._layouts[name] = build()
        return self._layouts[name]

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
                                  step_functions.forward_inputs(plan))
            lowered = self.lower_forward(kind, inputs)
            self._logits_shape[num_seqs, num_speculative_tokens] = lowered.out_info[0]
            if self.with_logits or num_speculative_tokens:  # a pooling runner samples nothing
                self._sampler(plan, sampling_step.no_token_mask(num_seqs))
            compiled = lowered.compile()
            # where every forward program takes its token_ids (over a mesh, the token fills'
            # output is put there)
            self._token_ids_sharding = compiled.input_shardings[0][2]["token_ids"]
            return compiled

        return self._once(self._programs, key, build)

    def lower_forward(self, kind: str, inputs: dict) -> jax.stages.Lowered:
        """The forward program of a step kind lowered for abstract inputs (forward_inputs' of
        a padding plan), over this runner's weights, cache and LoRA slots."""
        return step_functions.forward_program.lower(
            self.graph, self.backend, kind, self.num_top_logprobs, *self._abstract_args, inputs,
            self._abstract_lora, with_logits=self.with_logits)

    def write_lora_slot(self, slot: int, arrays: dict) -> None:
        """Writes one adapter's arrays (SlotSpec.host_arrays) into a LoRA slot, in place."""
        self.lora = self._lora_writer(self.lora, np.int32(slot), arrays)

    def fill_program(self, num_tokens: int, num_previous: int) -> jax.stages.Compiled:
        """The program filling a plan's placeholder tokens (i32[num_tokens]) from the previous
        step's sampled ids (i32[num_previous] on this runner's device): async scheduling."""
        def build():
            return step_functions.fill_placeholders.lower(
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
        inputs = step_functions.forward_inputs(plan)
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
            ids, logprobs, top_ids, top_logprobs, ranks = (
                np.asarray(x)[:pending.num_seqs] for x in pending.sampled)
            prompt = tuple(np.asarray(x) for x in pending.prompt) or None
            pooled = np.asarray(pending.pooled[0]) if pending.pooled else None
            return step_results.StepResults(ids, logprobs, top_ids, top_logprobs, ranks, prompt,
                                            pooled)
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
