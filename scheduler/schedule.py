"""Continuous batching under a token budget: which requests run in the next step, and how much.

`schedule(state, now)` reads only its arguments, does no I/O and no device work, and returns the
state it advanced together with a SchedulerOutput that lists everything that changed. The same
function drives the engine, replays a recorded trace and runs inside a simulator.
"""

from __future__ import annotations

from pagedjax.scheduler.lora_slots import LoRASlots, adapters_in_use
from pagedjax.scheduler.request import Request, RequestStatus
from pagedjax.scheduler.state import (DECODE, MIXED, PREFILL, PREFILL_FIRST, VICTIM_POLICIES,
                                      ScheduledSeq, SchedulerOutput, SchedulerState)


def _is_decode(request: Request) -> bool:
    """In its decode phase: one token (and any speculative drafts after it) to compute."""
    return request.num_tokens - request.num_computed_tokens == 1


class _StepBuilder:
    """Accumulates one step: scheduled sequences, the remaining budget, preemptions."""

    def __init__(self, state: SchedulerState):
        self.state = state
        self.budget = state.config.max_num_batched_tokens
        self.scheduled: list[ScheduledSeq] = []
        self.scheduled_ids: set[str] = set()
        self.preempted: list[Request] = []

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.scheduled.append(ScheduledSeq(request, request.num_computed_tokens, num_new_tokens))
        self.scheduled_ids.add(request.request_id)
        self.budget -= num_new_tokens

    def preempt(self, victim: Request) -> None:
        state = self.state
        victim.spec_token_ids = []
        if state.config.preemption_mode == "swap" and state.kv_manager.swap_out(victim):
            victim.status = RequestStatus.SWAPPED  # keeps num_computed_tokens
            state.num_swap_outs += 1
        else:
            state.kv_manager.free(victim)
            state.num_recomputed_tokens += victim.num_computed_tokens
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
        state.running.remove(victim)
        state.num_followers -= len(victim.followers)
        victim.num_preemptions += 1
        state.num_preemptions += 1
        state.waiting.appendleft(victim)
        self.preempted.append(victim)

    def schedule_running(self, want_decode: bool | None) -> None:
        """Schedules running requests in order; want_decode None takes both phases."""
        state = self.state
        config = state.config
        choose_victim = VICTIM_POLICIES[config.victim_policy]
        i = 0
        while i < len(state.running) and self.budget > 0:
            request = state.running[i]
            i += 1
            if want_decode is not None and _is_decode(request) != want_decode:
                continue
            num_new = min(request.num_tokens + len(request.spec_token_ids)
                          - request.num_computed_tokens, self.budget)
            if num_new <= 0:  # its step in flight finishes it (scheduler.async_steps)
                continue
            while state.kv_manager.allocate_slots(request, num_new) is None:
                if request.spec_token_ids:  # drafts never preempt anyone: run without them
                    request.spec_token_ids = []
                    num_new = min(num_new, request.num_tokens - request.num_computed_tokens)
                    continue
                candidates = [r for r in state.running if r.request_id not in self.scheduled_ids]
                victim = choose_victim(candidates)
                if state.running.index(victim) < i:
                    i -= 1
                self.preempt(victim)
                if victim is request:
                    break
            else:
                self.add(request, num_new)

    def schedule_waiting(self, now: float) -> None:
        state = self.state
        config = state.config
        kv = state.kv_manager
        watermark_blocks = int(config.watermark * kv.pool.num_usable_blocks)
        slots = state.lora_slots
        in_use = adapters_in_use(state.running) if slots is not None else set()
        held_back = []  # requests whose adapter gets no slot: they keep their place
        while state.waiting and self.budget > 0:
            request = state.waiting[0]
            if state.num_seqs + 1 + len(request.followers) > config.max_num_seqs \
                    or request.awaiting_kv:
                break
            if not _adapter_fits(slots, request, in_use):
                held_back.append(state.waiting.popleft())
                continue
            swapped = request.status == RequestStatus.SWAPPED
            cached_blocks = [] if swapped else kv.find_cached_prefix(request)
            num_cached = (request.num_computed_tokens if swapped
                          else len(cached_blocks) * kv.block_size)
            num_new = request.num_tokens - num_cached
            if num_new > self.budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = self.budget
            needed = (kv.num_blocks_for(num_cached + num_new) if swapped
                      else kv.num_new_blocks(request, num_new, cached_blocks))
            margin = watermark_blocks
            if request.num_preemptions:
                # Anti-thrash: a preempted request comes back only when all it has to
                # recompute fits, with a block of headroom for each running sequence.
                needed = max(needed, kv.num_blocks_for(request.num_tokens) - len(cached_blocks))
                margin = max(margin, len(state.running))
            if state.running and needed + margin > kv.num_free_blocks:
                break
            if swapped:
                if kv.swap_in(request, num_new) is None:
                    break
            elif kv.allocate_slots(request, num_new, cached_blocks) is None:
                break
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                state.num_prefix_query_tokens += request.num_tokens
                state.num_prefix_hit_tokens += num_cached
            if not swapped:
                _count_tier_lookups(state, request, cached_blocks)
            state.waiting.popleft()
            if request.lora_id is not None:
                request.lora_slot = _slots(slots).acquire(request.lora_id, in_use)
                in_use.add(request.lora_id)
                for follower in request.followers:
                    follower.lora_slot = request.lora_slot
            state.running.append(request)
            state.num_followers += len(request.followers)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.add(request, num_new)
        state.waiting.extendleft(reversed(held_back))

    def drop_drafts_beside_prefills(self, forks) -> None:
        """Speculative drafts ride only in steps of decodes alone: a step with prefill work
        (or forks) runs its decodes without them, so the speculative programs are the few
        decode shapes a warmup compiles (scheduler.buckets.speculative_shapes). The blocks
        taken for the dropped drafts are given back."""
        rows = self.scheduled
        if not any(s.request.spec_token_ids for s in rows):
            return
        if not forks and all(s.start == s.request.num_tokens - 1 for s in rows):
            return
        for i, (request, start, _) in enumerate(rows):
            if rows[i].drafts:
                rows[i] = ScheduledSeq(request, start, request.num_tokens - start)
                self.state.kv_manager.trim(request, request.num_tokens)
            request.spec_token_ids = []

    def output(self, now: float) -> SchedulerOutput:
        forks = [(s.request, follower) for s in self.scheduled if s.request.followers
                 and s.start + s.num_new_tokens == s.request.num_tokens
                 for follower in s.request.followers]
        self.drop_drafts_beside_prefills(forks)
        num_tokens = sum(s.num_new_tokens for s in self.scheduled)
        kind = DECODE if num_tokens == len(self.scheduled) and not forks else PREFILL
        kv = self.state.kv_manager
        copies = kv.take_pending_copies()
        swap_out, swap_in = kv.take_pending_swaps()
        tier = kv.host_tier
        spills, offloads, overflow, loads = (tier.take_transfers() if tier is not None
                                             else ([], [], [], []))
        slots = self.state.lora_slots
        return SchedulerOutput(self.scheduled, self.preempted, kind, num_tokens, now, forks,
                               copies, swap_out, swap_in, spills, offloads, overflow, loads,
                               lora_loads=slots.take_loads() if slots is not None else [],
                               state_copies=kv.take_pending_state_copies())


def _count_tier_lookups(state: SchedulerState, request: Request, cached_blocks) -> None:
    """An admission's lookups below the device: the prompt blocks the host tier was asked for
    and did not hold (every group's; its hits count as they load), and, at a first admission,
    the prompt tokens it served (a block index counts when any group's block there came from
    it)."""
    tier = state.kv_manager.host_tier
    if tier is None or not state.config.enable_prefix_caching \
            or request.computes_whole_prompt:
        return
    heads = getattr(cached_blocks, "groups", None) or [cached_blocks]
    asked = (request.num_tokens - 1) // state.kv_manager.block_size
    tier.num_misses += (asked - len(cached_blocks)) * len(heads)
    if request.num_preemptions == 0:
        from_host = sum(any(len(head) > i and head[i] < 0 for head in heads)
                        for i in range(len(cached_blocks)))
        state.num_prefix_host_hit_tokens += from_host * state.kv_manager.block_size


def schedule(state: SchedulerState, now: float) -> tuple[SchedulerState, SchedulerOutput]:
    """Chooses the next step's work under the token budget and the configured policy."""
    state.kv_manager.release_host_blocks()  # the previous step has run its swap-ins
    if state.kv_manager.host_tier is not None:
        state.kv_manager.host_tier.release()  # and its host tier transfers
    step = _StepBuilder(state)
    policy = state.config.policy
    if policy == MIXED:
        step.schedule_running(want_decode=None)
        if not step.preempted:
            step.schedule_waiting(now)
    elif policy == PREFILL_FIRST:
        step.schedule_running(want_decode=False)
        if not step.preempted:
            step.schedule_waiting(now)
        if not step.scheduled:
            step.schedule_running(want_decode=True)
    else:  # DECODE_FIRST
        if any(_is_decode(r) for r in state.running):
            step.schedule_running(want_decode=True)
        else:
            step.schedule_running(want_decode=False)
            if not step.preempted:
                step.schedule_waiting(now)
    return state, step.output(now)


def _adapter_fits(slots: LoRASlots | None, request: Request, in_use: set) -> bool:
    """Whether request's LoRA adapter (if it names one) can have a slot now."""
    return request.lora_id is None or _slots(slots).can_acquire(request.lora_id, in_use)


def _slots(slots: LoRASlots | None) -> LoRASlots:
    """The engine's LoRA slots, for a request naming an adapter (intake refuses one when the
    engine serves no LoRA)."""
    if slots is None:
        raise RuntimeError("a LoRA request on a scheduler without LoRA slots")
    return slots
