"""Engine-wide counters: KV usage, waste at peak, preemptions, steps and tokens."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    num_blocks: int = 0  # usable blocks in the pool
    block_size: int = 0
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0  # counted by the engine as each token is appended
    num_finished: int = 0
    num_aborted: int = 0
    num_failed: int = 0  # requests dropped alone because their part of a step failed
    num_preemptions: int = 0
    peak_used_blocks: int = 0
    peak_used_tokens: int = 0  # token slots filled at the block-usage peak (shared once)
    max_running: int = 0  # most sequences holding KV at once
    step_time_s: float = 0.0  # wall time inside runner.step, summed
    num_prefix_query_tokens: int = 0  # prompt tokens looked up at first admission
    num_prefix_hit_tokens: int = 0  # of those, found in the prefix cache (any tier)
    num_prefix_host_hit_tokens: int = 0  # of the hits, loaded from the host tier
    # The tiers under the device cache (pagedjax.kv_offload.tiers.KVTiers.counters): tier name
    # -> its running totals; empty without tiers.
    kv_tiers: dict = dataclasses.field(default_factory=dict)
    # LoRA adapters (LoRAManager.stats): running / waiting adapter names, max_loras, slot
    # loads, evictions and load time; empty without them.
    loras: dict = dataclasses.field(default_factory=dict)
    num_evictions: int = 0  # cached blocks reused for other content
    num_swap_outs: int = 0  # preemptions that moved KV to the host pool
    num_recomputed_tokens: int = 0  # computed tokens thrown away by recompute preemption
    # Prompt tokens computed by steps (prefix-cache hits excluded, recomputation included).
    num_prompt_tokens_computed: int = 0
    num_allocation_failures: int = 0  # KV block allocations the free blocks could not meet
    num_oom: int = 0  # steps that ran out of device memory
    # async scheduling: steps scheduled and dispatched before the previous step's results
    num_ahead_steps: int = 0
    # Speculative decoding (vLLM's spec_decode counters; scheduler.state.SchedulerState's)
    num_spec_drafts: int = 0  # rows that verified drafts
    num_spec_draft_tokens: int = 0  # drafts verified
    num_spec_accepted_tokens: int = 0  # drafts the target accepted
    spec_accepted_per_position: tuple = ()  # accepted drafts by their position in a row

    def record_step(self, decode: bool, num_scheduled_tokens: int, advanced, state,
                    num_prompt_tokens: int = 0) -> None:
        """Counts one step: its kind and tokens (num_prompt_tokens of them at prompt positions),
        the samples it advanced (Requests), and the scheduler state's running totals after it
        (preemptions, prefix hits, swaps, ...)."""
        self.num_steps += 1
        if decode:
            self.num_decode_steps += 1
        else:
            self.num_prefill_steps += 1
        self.num_scheduled_tokens += num_scheduled_tokens
        self.num_prompt_tokens_computed += num_prompt_tokens
        self.num_allocation_failures = state.kv_manager.num_allocation_failures
        self.num_finished += sum(r.status.finished and r.sample_index == 0 for r in advanced)
        self.num_preemptions = state.num_preemptions
        self.num_prefix_query_tokens = state.num_prefix_query_tokens
        self.num_prefix_hit_tokens = state.num_prefix_hit_tokens
        self.num_prefix_host_hit_tokens = state.num_prefix_host_hit_tokens
        self.num_evictions = state.kv_manager.num_evictions
        self.num_swap_outs = state.num_swap_outs
        self.num_recomputed_tokens = state.num_recomputed_tokens
        self.max_running = max(self.max_running, len(state.running))
        self.num_spec_drafts = state.num_spec_drafts
        self.num_spec_draft_tokens = state.num_spec_draft_tokens
        self.num_spec_accepted_tokens = state.num_spec_accepted_tokens
        self.spec_accepted_per_position = tuple(state.spec_accepted_per_position)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts / drafts verified (vLLM's draft acceptance rate)."""
        drafted = self.num_spec_draft_tokens
        return self.num_spec_accepted_tokens / drafted if drafted else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verifying row produced on average: its accepted drafts and the target's
        own (vLLM's mean acceptance length); 0 before any."""
        rows = self.num_spec_drafts
        return 1.0 + self.num_spec_accepted_tokens / rows if rows else 0.0

    @property
    def num_device_hit_tokens(self) -> int:
        """Prefix hits the device pool held (vLLM's prefix_cache_hits: its local cache's)."""
        return self.num_prefix_hit_tokens - self.num_prefix_host_hit_tokens

    @property
    def num_external_query_tokens(self) -> int:
        """Prompt tokens looked up below the device (vLLM's external_prefix_cache_queries: a
        KV connector's); 0 without tiers."""
        return self.num_prefix_query_tokens - self.num_device_hit_tokens if self.kv_tiers else 0

    @property
    def prefix_hit_rate(self) -> float:
        queried = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / queried if queried else 0.0

    @property
    def peak_waste(self) -> float:
        """(allocated slots - held tokens) / allocated slots, at the block-usage peak."""
        allocated = self.peak_used_blocks * self.block_size
        return (allocated - self.peak_used_tokens) / allocated if allocated else 0.0


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One engine replica's queue and KV pool right now (a data-parallel engine has several)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    used_blocks: int
    usable_blocks: int

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / max(1, self.usable_blocks)
