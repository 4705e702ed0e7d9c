"""What the scheduler works on and hands back: its config (policies, preemption, watermark), its
state (queues, the KV cache manager, counters), the step kinds, and one step's SchedulerOutput."""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, NamedTuple, Sequence

from pagedjax.scheduler.kv_cache_groups import HybridKVCacheManager
from pagedjax.scheduler.kv_cache_manager import KVCacheManager
from pagedjax.scheduler.lora_slots import LoRASlots
from pagedjax.scheduler.request import Request

PREFILL = "prefill"  # ragged: each sequence brings 1..n query tokens (decodes may ride along)
DECODE = "decode"  # every sequence brings exactly one query token

MIXED = "mixed"  # decodes first in the budget, prefill chunks fill the rest (vLLM V1)
PREFILL_FIRST = "prefill_first"  # a step with prefill work runs no decodes (best TTFT)
DECODE_FIRST = "decode_first"  # a step with decode work runs no prefills (best TPOT)
POLICIES = (MIXED, PREFILL_FIRST, DECODE_FIRST)
PREEMPTION_MODES = ("recompute", "swap")

VictimPolicy = Callable[[Sequence[Request]], Request]


def lifo_victim(candidates: Sequence[Request]) -> Request:
    """The most recently admitted request (the tail of the running queue)."""
    return candidates[-1]


def fewest_computed_victim(candidates: Sequence[Request]) -> Request:
    """The request that loses the least work; the latest admitted among equals."""
    return min(reversed(candidates), key=lambda r: r.num_computed_tokens)


VICTIM_POLICIES: dict[str, VictimPolicy] = {"lifo": lifo_victim,
                                           "fewest_computed": fewest_computed_victim}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = MIXED
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    victim_policy: str = "lifo"
    preemption_mode: str = "recompute"  # swap falls back to recompute when the host pool is full
    # New requests are admitted only while this fraction of blocks stays free, so that running
    # requests can grow without an immediate preemption (ignored when nothing runs).
    watermark: float = 0.01

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.victim_policy not in VICTIM_POLICIES:
            raise ValueError(f"victim_policy must be one of {tuple(VICTIM_POLICIES)}, "
                             f"got {self.victim_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}), or a long prompt never fits")


class ScheduledSeq(NamedTuple):
    request: Request
    start: int  # position of the first token computed this step (= num_computed_tokens)
    num_new_tokens: int

    @property
    def drafts(self) -> list[int]:
        """The speculative drafts this row verifies: its query tokens past its request's own."""
        request = self.request
        return request.spec_token_ids[:max(0, self.start + self.num_new_tokens
                                           - request.num_tokens)]


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Request]
    kind: str  # DECODE when every scheduled sequence brings one token, else PREFILL
    num_scheduled_tokens: int
    now: float
    # (leader, follower): parallel samples that take their first token from the leader's
    # prompt logits in this step, then fork the leader's blocks.
    forks: Sequence[tuple[Request, Request]] = ()
    copies: Sequence[tuple[int, int]] = ()  # copy-on-write (src, dst) blocks, before the KV writes
    # Swaps run at the start of the step, outs before ins: (device, host) and (host, device).
    swap_out: Sequence[tuple[int, int]] = ()
    swap_in: Sequence[tuple[int, int]] = ()
    # The host tier's transfers (scheduler.host_tier), run at the start of the step in this
    # order: spills (hash, host slot) read out for the disk tier, offloads (device, host slot)
    # of evicted cached blocks and overflow (device, hash) for the disk tier, loads (host
    # slot, device) of host hits.
    tier_spills: Sequence[tuple[bytes, int]] = ()
    tier_offloads: Sequence[tuple[int, int]] = ()
    tier_overflow: Sequence[tuple[int, bytes]] = ()
    tier_loads: Sequence[tuple[int, int]] = ()
    # LoRA adapters to write into their device slots before the step (slot, adapter id):
    # scheduler.lora_slots.
    lora_loads: Sequence[tuple[int, int]] = ()
    # A state group's fork copies (device src, device dst), whole blocks before everything else
    # of the step (scheduler.state_group).
    state_copies: Sequence[tuple[int, int]] = ()


@dataclasses.dataclass
class SchedulerState:
    config: SchedulerConfig
    kv_manager: KVCacheManager | HybridKVCacheManager
    waiting: collections.deque = dataclasses.field(default_factory=collections.deque)
    running: list = dataclasses.field(default_factory=list)
    requests: dict = dataclasses.field(default_factory=dict)  # request_id -> unfinished Request
    num_preemptions: int = 0
    # Prefix-cache lookups at first admission only: a request readmitted after preemption finds
    # its own blocks again, which would overstate the hit rate.
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_host_hit_tokens: int = 0  # of the hits, blocks loaded from the host tier
    num_followers: int = 0  # parallel samples not forked yet (they count against max_num_seqs)
    num_swap_outs: int = 0
    num_recomputed_tokens: int = 0  # computed tokens thrown away by recompute preemption
    # Speculative decoding (vLLM's spec_decode counters): rows that verified drafts, the drafts
    # they verified, those the target accepted, and accepted drafts by their position
    # (accepted_per_position[j]: rows whose draft j was accepted).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list = dataclasses.field(default_factory=list)
    lora_slots: LoRASlots | None = None  # the adapters' device slots (an engine serving LoRA)

    @property
    def num_seqs(self) -> int:
        return len(self.running) + self.num_followers
