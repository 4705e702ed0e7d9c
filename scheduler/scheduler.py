"""Scheduler: one object holding a SchedulerState, for callers that want methods (the engine, the
simulator); every method is one of the free functions of schedule.py and lifecycle.py."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pagedjax.scheduler.kv_cache_groups import HybridKVCacheManager
from pagedjax.scheduler.kv_cache_manager import KVCacheManager
from pagedjax.scheduler.lifecycle import abort_request, add_request, check_request, requeue, update
from pagedjax.scheduler.lora_slots import LoRASlots
from pagedjax.scheduler.request import Request, RequestStatus
from pagedjax.scheduler.schedule import schedule
from pagedjax.scheduler.state import SchedulerConfig, SchedulerOutput, SchedulerState


class Scheduler:
    """Convenience object holding a SchedulerState; every method is one of the free functions."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 cache_key: bytes = b"", num_host_blocks: int = 0,
                 sliding_window: int | None = None,
                 group_windows: tuple[int | None, ...] | None = None,
                 num_tier_blocks: int = 0, max_loras: int = 0):
        """group_windows: the KV cache groups' windows (scheduler.kv_cache_groups), when the
        model has several; else one group, sliding_window for all its layers. num_tier_blocks:
        the host tier under the prefix cache (scheduler.host_tier), 0 for none. max_loras: the
        LoRA adapters' device slots (scheduler.lora_slots), 0 for an engine without them."""
        kv_manager: KVCacheManager | HybridKVCacheManager
        if group_windows is not None and len(group_windows) > 1:
            kv_manager = HybridKVCacheManager(
                num_blocks, block_size, group_windows,
                enable_prefix_caching=config.enable_prefix_caching, cache_key=cache_key,
                num_host_blocks=num_host_blocks,
                max_tokens_per_step=config.max_num_batched_tokens,
                num_tier_blocks=num_tier_blocks)
        else:
            window = group_windows[0] if group_windows else sliding_window
            kv_manager = KVCacheManager(num_blocks, block_size, cache_key=cache_key,
                                        enable_prefix_caching=config.enable_prefix_caching,
                                        num_host_blocks=num_host_blocks, sliding_window=window,
                                        num_tier_blocks=num_tier_blocks)
        self.state = SchedulerState(config, kv_manager,
                                    lora_slots=LoRASlots(max_loras) if max_loras else None)

    @property
    def config(self) -> SchedulerConfig:
        return self.state.config

    @property
    def kv_manager(self) -> KVCacheManager | HybridKVCacheManager:
        return self.state.kv_manager

    def check_request(self, request: Request) -> None:
        check_request(self.state, request)

    def add_request(self, request: Request) -> None:
        add_request(self.state, request)

    def schedule(self, now: float) -> SchedulerOutput:
        self.state, output = schedule(self.state, now)
        return output

    def update(self, output: SchedulerOutput, sampled_ids: Sequence[int] | np.ndarray,
               now: float, sampled_logprobs: Sequence[float] | np.ndarray | None = None,
               top_ids=None,
               top_logprobs=None, sampled_ranks=None, on_token=None) -> list[Request]:
        return update(self.state, output, sampled_ids, now, sampled_logprobs, top_ids,
                      top_logprobs, sampled_ranks, on_token)

    def abort(self, request_id: str, now: float,
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        return abort_request(self.state, request_id, now, status)

    def requeue(self, request: Request) -> None:
        requeue(self.state, request)

    def has_unfinished(self) -> bool:
        return bool(self.state.requests)
