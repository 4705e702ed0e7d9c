"""LLMEngine: requests in, one step at a time: schedule, run, postprocess."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from pagedjax.engine import memory_budget
from pagedjax.engine.async_scheduling import AsyncScheduling
from pagedjax.engine.compile_cache import enable_compilation_cache
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.forwarding import forward_property, forward_to
from pagedjax.engine.kv_pool import check_linear_attention, size_kv_pool
from pagedjax.engine.kv_snapshot import KVSnapshot, UsageSample, kv_snapshot
from pagedjax.engine.outputs import EngineOutput
from pagedjax.engine.pooling_requests import (PoolingRequests, add_pooling_request,
                                              check_pooling_params, pooling_spec)
from pagedjax.engine.request_intake import RequestIntake
from pagedjax.engine.request_table import RequestTable
from pagedjax.engine.sleep_mode import SleepMode
from pagedjax.engine.spec_decode.config import SpeculativeConfig
from pagedjax.engine.spec_decode.draft_model import DraftModelProposer
from pagedjax.engine.spec_decode.speculator import Speculator
from pagedjax.engine.stats import EngineStats, ReplicaLoad
from pagedjax.engine.step_outputs import StepOutputs
from pagedjax.engine.step_recovery import StepRecovery
from pagedjax.engine.step_results import StartedStep
from pagedjax.engine.token_masks import TokenMasks, step_rows
from pagedjax.engine.warmup import BackgroundWarmup, warm
from pagedjax.engine.weight_updates import WeightUpdates
from pagedjax.kv_offload.tiers import cached_prefix_blocks, make_kv_tiers
from pagedjax.lora.engine_loras import LoRAControls
from pagedjax.lora.manager import LoRAManager
from pagedjax.models import LlamaForCausalLM
from pagedjax.models.loading.quantized_loading import for_serving as quantized_for_serving
from pagedjax.parallel import multihost
from pagedjax.parallel.placement import place
from pagedjax.pooling.pooling_model import PoolingModel
from pagedjax.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput, build_plan


class LLMEngine:
    """Requests in, one step at a time (docs/architecture.md: one engine step). Its parts, each
    owning its state and handed the engine: intake (requests in, aborts), weights (updates,
    pausing, versions), sleep_mode, loras, pooling, outputs (a step's results into outputs), recovery
    (failed steps); the controls they own are named here (forward_to)."""

    # ---- the controls its parts own ------------------------------------------------------------
    add_requests = forward_to("intake", RequestIntake.add_requests)
    queue_admitted = forward_to("intake", RequestIntake.queue_admitted)
    add_request = forward_to("intake", RequestIntake.add_request)
    make_request = forward_to("intake", RequestIntake.make_request)
    queue = forward_to("intake", RequestIntake.queue)
    set_prompt_text = forward_to("intake", RequestIntake.set_prompt_text)
    abort = forward_to("intake", RequestIntake.abort)
    pooling_spec = pooling_spec
    check_pooling_params = check_pooling_params
    add_pooling_request = add_pooling_request
    update_weights = forward_to("weights", WeightUpdates.update_weights)
    pause_generation = forward_to("weights", WeightUpdates.pause_generation)
    resume_generation = forward_to("weights", WeightUpdates.resume_generation)
    hold_new_requests = forward_to("weights", WeightUpdates.hold_new_requests)
    release_new_requests = forward_to("weights", WeightUpdates.release_new_requests)
    take_held_outputs = forward_to("weights", WeightUpdates.take_held_outputs)
    reset_prefix_cache = forward_to("weights", WeightUpdates.reset_prefix_cache)
    is_paused = forward_property("weights", "is_paused")
    has_work = forward_property("weights", "has_work", WeightUpdates.has_work.__doc__)
    num_in_flight = forward_property("weights", "num_in_flight")
    weight_version = forward_property("weights", "weight_version")
    num_weight_updates = forward_property("weights", "num_weight_updates")
    sleep = forward_to("sleep_mode", SleepMode.sleep)
    wake_up = forward_to("sleep_mode", SleepMode.wake_up)
    check_awake = forward_to("sleep_mode", SleepMode.check_awake)
    is_sleeping = forward_property("sleep_mode", "is_sleeping")
    sleep_level = forward_property("sleep_mode", "level")
    fail_all = forward_to("recovery", StepRecovery.fail_all)
    add_lora = forward_to("loras", LoRAControls.add_lora)
    remove_lora = forward_to("loras", LoRAControls.remove_lora)
    list_loras = forward_to("loras", LoRAControls.list_loras)
    update_lora = forward_to("loras", LoRAControls.update_lora)

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig | None = None, *,
                 tokenizer=None, clock: Callable[[], float] = time.perf_counter,
                 devices: Sequence | None = None, seed_rng: np.random.Generator | None = None,
                 draft_model=None):
        """tokenizer (optional: a pagedjax.text.tokenizer.Tokenizer or ByteTokenizer) adds text to
        the outputs and enables stop strings. (Its vocabulary may exceed the model's, as some
        checkpoints' added tokens do: prompt ids are checked against the model's vocab_size.)
        devices: where the model runs, its first tensor_parallel_size (default: this process's
        devices, or every process's when the model needs more, multi-host; a data-parallel
        engine gives each replica its own group). seed_rng draws the seeds of
        requests that give none (default: seeded by config.seed). draft_model: the draft of
        speculative_config's method draft_model, loaded (LLM loads it from the config's
        path)."""
        config = config or EngineConfig()
        model = quantized_for_serving(model, config.quantization, config.quantize_lm_head)
        model_config = model.config
        if config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({model_config.max_position_embeddings})")
        config = check_linear_attention(model_config, config)
        self.config = config
        self.model_config = model_config
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache)
        self.tokenizer = tokenizer
        self.clock = clock
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size ({config.data_parallel_size}) needs "
                             f"pagedjax.frontend.data_parallel.make_engine (one LLMEngine a replica)")
        self.devices, self.multihost, self.backend = place(model_config, config, devices)
        if config.enable_lora and self.multihost:
            raise ValueError("enable_lora is not supported multi-host yet; serve adapters on "
                             "one host")
        if config.async_scheduling and self.multihost:
            raise ValueError("async_scheduling is not supported multi-host (the followers "
                             "replay the leader's plans); turn it off")
        pool = size_kv_pool(model, config, self.devices, self.backend)
        self.kv_groups, self.layer_windows = pool.kv_groups, pool.layer_windows
        self.bytes_per_block = pool.bytes_per_block
        self.bytes_per_block_per_device = pool.bytes_per_block_per_device
        self.num_blocks, self.buckets = pool.num_blocks, pool.buckets
        self.runner, self.memory_budget = pool.runner, pool.memory_budget
        self.sleep_mode = SleepMode(self)
        self.weights = WeightUpdates(self, model)
        self._init_scheduling(config)
        self._init_requests(tokenizer, model_config, config, seed_rng, draft_model)

    def _init_scheduling(self, config: EngineConfig) -> None:
        """The tiers, the scheduler over the pool, the multi-host channel, the swap space."""
        num_host_blocks = config.swap_space_bytes // self.bytes_per_block
        self.kv_tiers = make_kv_tiers(self.runner, config, self.bytes_per_block)
        self._make_scheduler = lambda: Scheduler(
            config.scheduler_config(), self.num_blocks, config.block_size,
            cache_key=self.weights.cache_key(), num_host_blocks=num_host_blocks,
            group_windows=self.kv_groups.windows,
            num_tier_blocks=0 if self.kv_tiers is None else self.kv_tiers.num_blocks,
            max_loras=config.max_loras if config.enable_lora else 0)
        self.scheduler = self._make_scheduler()
        spec = self.runner.lora_spec  # set when config.enable_lora
        self.lora_manager = None if spec is None else LoRAManager(spec, self.model_config,
                                                                   config.num_cpu_loras)
        self.loras = LoRAControls(self)
        if self.multihost and jax.process_index() == 0:
            self.runner.lead(multihost.LeaderChannel())  # process 0 leads (multihost.py)
        self.stats = EngineStats(num_blocks=self.num_blocks - 1, block_size=config.block_size)
        # The swap space: host arrays like the device cache, num_host_blocks a layer.
        self.host_pool = self.runner.init_host_pool(num_host_blocks)

    def _init_requests(self, tokenizer, model_config, config: EngineConfig, seed_rng,
                       draft_model) -> None:
        """The requests' books and the parts that keep them: intake, the request table, token
        masks, the speculator, pooling, the step's outputs, recovery."""
        self.intake = RequestIntake(self, np.random.default_rng(config.seed)
                                    if seed_rng is None else seed_rng)
        # allowed_token_ids, bad_words, min_tokens, structured outputs: one state a sample
        self.token_masks = TokenMasks(tokenizer, model_config.vocab_size,
                                      model_config.eos_token_ids)
        spec = config.speculative
        assert spec is None or isinstance(spec, SpeculativeConfig)  # EngineConfig checked it
        self.speculator = None if spec is None else Speculator(
            spec, self.token_masks,
            DraftModelProposer.for_engine(self, draft_model) if spec.model else None)
        # every unfinished request (its samples, texts, versions, pool): one entry each
        self.requests = RequestTable(self._forget)
        self.usage_history: collections.deque[UsageSample] = collections.deque(maxlen=100_000)
        self.last_schedule: SchedulerOutput | None = None
        self.async_scheduling = AsyncScheduling(self) if config.async_scheduling else None
        self.recovery = StepRecovery(self)
        self.outputs = StepOutputs(self)
        # the model's pooler and head (LLM sets the model directory's; the engine serves both
        # kinds of request, in the same steps) and what a server over it serves ("auto" is
        # resolved by LLM before the engine)
        self.pooling_model = PoolingModel()
        self.runner_type = "pooling" if config.runner == "pooling" else "generate"
        self.pooling = PoolingRequests(self)

    @property
    def request_groups(self) -> Mapping[str, list[Request]]:
        """request_id -> its samples, for every unfinished request (the request table's view)."""
        return self.requests.groups

    def scheduler_states(self) -> list:
        """The scheduler state of each replica (one here) admission checks a request against."""
        return [self.scheduler.state]

    def fail_request(self, parent_id: str, message: str, now: float) -> None:
        """Ends parent_id's unfinished samples with finish_reason "error" (its output, with
        message, is outputs.request_output's)."""
        for sample in self.requests[parent_id].samples:
            if not sample.status.finished:
                self.scheduler.abort(sample.request_id, now, RequestStatus.FINISHED_ERROR)
        self.stats.num_failed += 1

    def start_over(self) -> None:
        """After every request failed: a new scheduler over an empty pool and prefix cache, no
        token masks, and a fresh KV cache if the failed step lost it."""
        if self.kv_tiers is not None:
            self.kv_tiers.start_over(self.scheduler.kv_manager)
        self.scheduler = self._make_scheduler()
        self.token_masks.clear()
        if self.runner.kv_cache_lost:
            self.runner.reset_kv_cache()

    def has_unfinished(self) -> bool:
        """Requests not finished, or outputs not yet returned (pausing's: step() returns them)."""
        return self.scheduler.has_unfinished() or self.weights.has_held_outputs

    def close(self) -> None:
        """Done serving: a multi-host leader stops its followers' loops (at exit otherwise); a
        disk tier gets the cached blocks it lacks written down (a restart finds them)."""
        if self.runner.channel is not None:
            self.runner.channel.stop()
        if self.kv_tiers is not None:
            self.kv_tiers.close(self.scheduler.kv_manager)

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of a prompt's leading KV blocks (scheduler.block_hash.token_block_hashes)
        any tier of this engine's prefix cache holds (kv_tiers.cached_prefix_blocks)."""
        if not self.config.enable_prefix_caching:
            return 0
        disk = self.kv_tiers.disk if self.kv_tiers is not None else None
        return cached_prefix_blocks(self.scheduler.kv_manager, disk, hashes)

    def blocks_for(self, num_tokens: int) -> int:
        """The most KV blocks a sequence of num_tokens holds (over the KV cache groups)."""
        return self.scheduler.kv_manager.num_blocks_for(num_tokens)

    @property
    def held_memory(self) -> tuple[int, int]:
        """(weights, KV pool) bytes over the engine's devices (memory_budget.held_memory)."""
        return memory_budget.held_memory(self)

    @property
    def hybrid_kv_cache(self) -> bool:
        return self.kv_groups.hybrid

    @property
    def replicas(self) -> list["LLMEngine"]:  # pagedjax.engine.engine_protocol.Engine's
        return [self]

    def load(self) -> list[ReplicaLoad]:
        """The queue and the KV pool now, one entry (a data-parallel engine: one a replica)."""
        state = self.scheduler.state
        kv = state.kv_manager
        swapped = 0 if self.config.preemption_mode != "swap" else sum(  # O(waiting): swap only
            r.status is RequestStatus.SWAPPED for r in state.waiting)
        return [ReplicaLoad(len(state.running), len(state.waiting), swapped,
                            kv.num_used_blocks, kv.pool.num_usable_blocks)]

    # ---- the step ----------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[EngineOutput]:
        """Runs one step; returns an output for every request that got a token this step, or,
        final_only, for every request that finished in it (vLLM's FINAL_ONLY output kind, what
        LLM.generate asks for: an output copies the request's tokens, O(length) a request a
        step otherwise).

        A request whose part of the step fails (its plan rows, its detokenization) is dropped
        alone: it finishes with finish_reason "error" and its error, its blocks are freed, and
        the others go on. Only a failure that loses the KV cache itself is raised.

        With config.async_scheduling the next step is scheduled and dispatched before this
        one's results are waited for (pagedjax.engine.async_scheduling); the outputs are the
        same."""
        held = self.weights.take_held_outputs(final_only)
        if self.weights.is_paused:
            return held
        if self.async_scheduling is not None:
            return held + self.async_scheduling.step(final_only)
        return held + self.finish_step(self.begin_step(), final_only)

    def begin_step(self, after: "StartedStep | None" = None) -> "StartedStep | None":
        """The first half of step(): schedules and dispatches the device step without waiting
        for it (a data-parallel engine starts every replica's before finishing any). None when
        nothing was scheduled. after: the step in flight this one follows before its results
        are in (async scheduling: the scheduler was advanced past it, and this step reads its
        sampled tokens on the device)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.state.running)
        if self.kv_tiers is not None:
            self.kv_tiers.prefetch(self.scheduler.state)
        output = self._schedule()
        self.runner.copy_device_blocks(output.state_copies)  # before the swaps free them
        if not output.scheduled:
            if after is None and self.scheduler.has_unfinished() and not self.weights.holding_new:
                raise RuntimeError("scheduler made no progress with requests pending")
            return None
        self.last_schedule = output  # what the step ran (profiling reads its shape)
        start = time.perf_counter()
        if self.kv_tiers is not None:
            self.kv_tiers.copy_out(output)
        self.runner.swap(output.swap_out, output.swap_in, self.host_pool)
        if self.kv_tiers is not None:
            self.kv_tiers.copy_in(output)
        try:
            if output.lora_loads:
                self.loras.manager().load(self.runner, output.lora_loads)
            return StartedStep(output, start, self.dispatch(output, after))
        except Exception as error:  # noqa: BLE001 - isolated in finish_step, or re-raised
            return StartedStep(output, start, None, error)

    def _schedule(self):
        """The scheduler's next step; while new requests are held (WeightUpdates.holding_new),
        those that never ran are set aside for it (and put back after, in their order)."""
        if not self.weights.holding_new:
            return self.scheduler.schedule(self.clock())
        state = self.scheduler.state
        held = [r for r in state.waiting if r.first_scheduled_time is None]
        if held:
            state.waiting = collections.deque(
                r for r in state.waiting if r.first_scheduled_time is not None)
        try:
            return self.scheduler.schedule(self.clock())
        finally:
            state.waiting.extend(held)

    def dispatch(self, output, after: "StartedStep | None" = None):
        """Dispatches a schedule's forward, builds its token masks on the host meanwhile, then
        dispatches its sampler (runner.PendingStep). after: see begin_step."""
        plan = build_plan(output, self.scheduler.kv_manager, self.buckets)
        previous = None if after is None or after.pending is None else after.pending.sampled[0]
        if previous is not None and plan.token_ids.min() < 0:  # placeholders to fill
            forward = self.runner.dispatch_forward(plan, previous)
        else:
            forward = self.runner.dispatch_forward(plan)
        mask = self.token_masks.build(step_rows(output), plan.padded_num_seqs,
                                      plan.num_speculative_tokens)
        return self.runner.dispatch_sample(plan, forward, mask)

    def finish_step(self, started: "StartedStep | None",
                    final_only: bool = False) -> list[EngineOutput]:
        """The second half of step(): waits for the device step begin_step started and
        advances its requests."""
        if started is None:
            return []
        output = started.output
        try:
            if started.pending is None:  # it stopped before the device (begin_step)
                raise started.error or RuntimeError("the step never reached the device")
            results = self.runner.fetch(started.pending)
        except Exception as error:  # noqa: BLE001 - isolated below, or re-raised
            return self.recovery.recover(output, error)
        return self.complete_step(started, results, final_only)

    def complete_step(self, started: "StartedStep", results,
                      final_only: bool) -> list[EngineOutput]:
        """Advances a step's requests by its fetched results (runner.fetch)."""
        self.stats.step_time_s += time.perf_counter() - started.start
        advanced: list[Request] = []
        outputs = self.outputs.process(started.output, results, advanced, final_only)
        self.outputs.record(started.output, advanced)
        return outputs

    def _forget(self, request_id: str) -> None:
        """A finished sample's state outside the request table: its token masks, its drafter's
        KV."""
        self.token_masks.drop(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def kv_snapshot(self) -> KVSnapshot:
        """The block map of the live requests (for inspection and pictures; O(blocks))."""
        return kv_snapshot(self.scheduler)

    def warmup(self, progress: bool = False, variants: bool = True) -> int:
        """Compiles every program a step can need (loaded from the persistent compilation cache
        when an earlier process compiled them): the step programs the buckets allow and, with
        variants, their prompt-logprobs, token-mask and penalty variants and async scheduling's
        token fills (pagedjax.engine.warmup); returns how many forward programs. Once it is
        done no request waits on a compile (without variants, a request using one of them
        compiles it on first use). progress shows a bar with each program as it compiles."""
        drafter = self.speculator and self.speculator.drafter
        return warm(self.runner, self.buckets, progress, **self._warmup_parts(variants)) + (
            drafter.warmup() if drafter else 0)

    def start_warmup(self, progress: bool = False, variants: bool = True) -> BackgroundWarmup:
        """warmup() behind serving: a background thread compiles every program while steps run
        (done(), wait(timeout), error). Once it is done no step compiles."""
        return BackgroundWarmup(self.runner, self.buckets, progress,
                                **self._warmup_parts(variants))

    def _warmup_parts(self, variants: bool) -> dict:
        moves_blocks = self.kv_tiers is not None or self.scheduler.kv_manager.num_host_blocks
        return dict(fills=variants and self.async_scheduling is not None, variants=variants,
                    block_copies=self.num_blocks - 1 if moves_blocks else 0)

    @property
    def num_compiled_programs(self) -> int:
        return self.runner.num_programs
