"""LLMEngine: requests in, one step at a time: schedule, run, postprocess."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from pagedjax.engine import memory_budget, prompt_logprobs
from pagedjax.engine.async_scheduling import AsyncScheduling
from pagedjax.engine.compile_cache import enable_compilation_cache
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.kv_pool import check_linear_attention, size_kv_pool
from pagedjax.engine.kv_snapshot import KVSnapshot, UsageSample, kv_snapshot, tokens_stored
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.pooling_requests import PoolingRequests
from pagedjax.engine.request_intake import RequestIntake
from pagedjax.engine.request_table import RequestTable
from pagedjax.engine.sleep_mode import SleepMode
from pagedjax.engine.spec_decode.draft_model import DraftModelProposer
from pagedjax.engine.spec_decode.speculator import Speculator
from pagedjax.engine.stats import EngineStats, ReplicaLoad
from pagedjax.engine.step_recovery import StepRecovery, describe
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
from pagedjax.scheduler import DECODE, Request, RequestStatus, Scheduler, build_plan


@dataclasses.dataclass
class _Started:
    """A step begin_step dispatched: its schedule, when it began, the device step in flight
    (or the error that stopped it before the device)."""

    output: object
    start: float
    pending: object
    error: Exception | None = None


class LLMEngine(RequestIntake, PoolingRequests, StepRecovery, WeightUpdates, SleepMode,
                LoRAControls):
    """Requests in, one step at a time (docs/architecture.md: one engine step)."""

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
        self._init_weight_updates(model)
        self._init_sleep_mode()
        self._init_scheduling(config)
        self._init_requests(tokenizer, model_config, config, seed_rng, draft_model)

    def _init_scheduling(self, config: EngineConfig) -> None:
        """The tiers, the scheduler over the pool, the multi-host channel, the swap space."""
        num_host_blocks = config.swap_space_bytes // self.bytes_per_block
        self.kv_tiers = make_kv_tiers(self.runner, config, self.bytes_per_block)
        self._make_scheduler = lambda: Scheduler(
            config.scheduler_config(), self.num_blocks, config.block_size,
            cache_key=self._cache_key(), num_host_blocks=num_host_blocks,
            group_windows=self.kv_groups.windows,
            num_tier_blocks=0 if self.kv_tiers is None else self.kv_tiers.num_blocks,
            max_loras=config.max_loras if config.enable_lora else 0)
        self.scheduler = self._make_scheduler()
        self.lora_manager = LoRAManager(self.runner.lora_spec, self.model_config,
                                        config.num_cpu_loras) if config.enable_lora else None
        if self.multihost and jax.process_index() == 0:
            self.runner.channel = multihost.LeaderChannel()  # process 0 leads (multihost.py)
        self.stats = EngineStats(num_blocks=self.num_blocks - 1, block_size=config.block_size)
        # The swap space: host arrays like the device cache, num_host_blocks a layer.
        self.host_pool = self.runner.init_host_pool(num_host_blocks)

    def _init_requests(self, tokenizer, model_config, config: EngineConfig, seed_rng,
                       draft_model) -> None:
        """The requests' books: ids, the request table, token masks, the speculator."""
        self._seed_rng = np.random.default_rng(config.seed) if seed_rng is None else seed_rng
        self._next_id = 0
        # allowed_token_ids, bad_words, min_tokens, structured outputs: one state a sample
        self.token_masks = TokenMasks(tokenizer, model_config.vocab_size,
                                      model_config.eos_token_ids)
        spec = config.speculative_config
        self.speculator = None if spec is None else Speculator(
            spec, self.token_masks,
            DraftModelProposer.for_engine(self, draft_model) if spec.model else None)
        # every unfinished request (its samples, texts, versions, pool): one entry each
        self.requests = RequestTable(self._forget)
        self.usage_history: collections.deque[UsageSample] = collections.deque(maxlen=100_000)
        self.last_schedule = None
        self.async_scheduling = AsyncScheduling(self) if config.async_scheduling else None
        self._init_pooling()

    def has_unfinished(self) -> bool:
        """Requests not finished, or outputs not yet returned (pausing's: step() returns them)."""
        return self.scheduler.has_unfinished() or bool(self._held_outputs)

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

    def step(self, final_only: bool = False) -> list[RequestOutput]:
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
        held = self.take_held_outputs(final_only)
        if self._paused:
            return held
        if self.async_scheduling is not None:
            return held + self.async_scheduling.step(final_only)
        return held + self.finish_step(self.begin_step(), final_only)

    def begin_step(self, after: "_Started | None" = None) -> "_Started | None":
        """The first half of step(): schedules and dispatches the device step without waiting
        for it (a data-parallel engine starts every replica's before finishing any). None when
        nothing was scheduled. after: the step in flight this one follows before its results
        are in (async scheduling: the scheduler was advanced past it, and this step reads its
        sampled tokens on the device)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.state.running)
        if self.kv_tiers is not None:
            self.kv_tiers.prefetch(self.scheduler.state)
        output = self.schedule_step()
        self.runner.copy_device_blocks(output.state_copies)  # before the swaps free them
        if not output.scheduled:
            if after is None and self.scheduler.has_unfinished() and not self._holding_new:
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
                self.lora_manager.load(self.runner, output.lora_loads)
            return _Started(output, start, self._dispatch(output, after))
        except Exception as error:  # noqa: BLE001 - isolated in finish_step, or re-raised
            return _Started(output, start, None, error)

    def _dispatch(self, output, after: "_Started | None" = None):
        """Dispatches a schedule's forward, builds its token masks on the host meanwhile, then
        dispatches its sampler (runner.PendingStep). after: see begin_step."""
        plan = build_plan(output, self.scheduler.kv_manager, self.buckets)
        if after is not None and plan.token_ids.min() < 0:  # placeholders to fill
            forward = self.runner.dispatch_forward(plan, after.pending.sampled[0])
        else:
            forward = self.runner.dispatch_forward(plan)
        mask = self.token_masks.build(step_rows(output), plan.padded_num_seqs,
                                      plan.num_speculative_tokens)
        return self.runner.dispatch_sample(plan, forward, mask)

    def finish_step(self, started: "_Started | None",
                    final_only: bool = False) -> list[RequestOutput]:
        """The second half of step(): waits for the device step begin_step started and
        advances its requests."""
        if started is None:
            return []
        output = started.output
        try:
            if started.error is not None:
                raise started.error
            results = self.runner.fetch(started.pending)
        except Exception as error:  # noqa: BLE001 - isolated below, or re-raised
            return self._recover(output, error)
        return self.complete_step(started, results, final_only)

    def complete_step(self, started: "_Started", results,
                      final_only: bool = False) -> list[RequestOutput]:
        """Advances a step's requests by its fetched results (runner.fetch)."""
        self.stats.step_time_s += time.perf_counter() - started.start
        advanced: list[Request] = []
        outputs = self._postprocess(started.output, results, advanced, final_only)
        self._record(started.output, advanced)
        return outputs

    def _postprocess(self, output, results, advanced: list[Request],
                     final_only: bool = False) -> list[RequestOutput]:
        """Advances the step's requests by its results (appending them to advanced); one
        output per request that got a token. A request whose detokenization fails is dropped
        alone."""
        now = self.clock()
        prompt_logprobs.record(output, results.prompt, self.tokenizer)
        self.record_pooled(output, results.pooled)
        failed: dict[str, str] = {}
        new = self.scheduler.update(output, results.sampled_ids, now, results.logprobs,
                                    results.top_ids, results.top_logprobs, results.ranks,
                                    lambda sample: self._on_token(sample, failed))
        advanced.extend(new)
        for parent_id, message in failed.items():
            self._fail(parent_id, message, now)
        parents = dict.fromkeys(r.parent_id for r in new)
        if final_only:
            parents = [p for p in parents if self.requests[p].finished]
        return [self._output(parent_id, failed.get(parent_id)) for parent_id in parents]

    def _on_token(self, sample: Request, failed: dict[str, str]) -> RequestStatus | None:
        """After each token the scheduler appends: a grammar complete or a stop string ends the
        sample (FINISHED_STOPPED), a failing detokenization fails it alone (recorded in failed),
        and the token's logprobs get their texts. (A pooling request's token is nobody's.)"""
        if sample.pooling is not None:
            return None
        self.stats.num_generated_tokens += 1
        try:
            stopped = self.token_masks.advance(sample)  # a grammar complete
            if self.tokenizer is not None:
                stopped = self.requests.sample_text(sample).advance(sample) or stopped
                if len(sample.logprobs) == sample.num_output_tokens:  # this token's entry
                    for token_id, logprob in sample.logprobs[-1].items():
                        logprob.decoded_token = self.tokenizer.decode(
                            [token_id], skip_special_tokens=False)
        except Exception as error:  # noqa: BLE001 - this request fails alone
            failed[sample.parent_id] = describe(error)
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if stopped else None

    def _output(self, parent_id: str, error: str | None = None) -> RequestOutput:
        """parent_id's output now; a finished request leaves the table (RequestTable.finish)."""
        state = self.requests[parent_id]
        if state.pooling is not None:
            out = self.pooling_output(state, error)
        else:
            samples = state.samples
            texts = None
            if self.tokenizer is not None:
                texts = {s.request_id: state.texts[s.request_id].visible_text(s.status.finished)
                         for s in samples}
            lora_id = samples[0].lora_id
            out = RequestOutput.from_samples(
                samples, samples[0].sampling_params.n, texts, state.prompt_text, error,
                state.record_version(self.weight_version),
                None if lora_id is None else self.lora_manager.adapters[lora_id])
        if out.finished:
            self.requests.finish(parent_id)
        return out

    def _forget(self, request_id: str) -> None:
        """A finished sample's state outside the request table: its token masks, its drafter's
        KV."""
        self.token_masks.drop(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _record(self, output, advanced) -> None:
        state = self.scheduler.state
        self.stats.record_step(output.kind == DECODE, output.num_scheduled_tokens, advanced,
                               state, sum(max(0, min(s.start + s.num_new_tokens,
                                                     s.request.num_prompt_tokens) - s.start)
                                          for s in output.scheduled))
        if self.kv_tiers is not None:
            self.stats.kv_tiers = self.kv_tiers.counters(state.kv_manager)
        if self.lora_manager is not None:
            self.stats.loras = self.lora_manager.stats(state)
        used_blocks = state.kv_manager.num_used_blocks
        self.usage_history.append(UsageSample(self.stats.num_steps, self.clock(), used_blocks,
                                              len(state.running), len(state.waiting)))
        if used_blocks > self.stats.peak_used_blocks:  # rare once warm: tokens_stored is O(blocks)
            self.stats.peak_used_blocks = used_blocks
            self.stats.peak_used_tokens = tokens_stored(self.scheduler)

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
