"""Which LoRA adapter each of the engine's device slots holds (issue 53), as the scheduler sees it.

A request naming an adapter is admitted only when its adapter is resident or can be made so: a
free slot, or the least recently used slot whose adapter no running request uses (evicted). The
scheduler holds back a request whose adapter cannot get a slot, as it holds back for KV, and
admits the requests behind it that can run (vLLM's skip). A running request's adapter never
moves: its slot is in use. Every slot this step assigned is a load the engine carries out before
the step runs (SchedulerOutput.lora_loads: (slot, adapter id)).
"""

from __future__ import annotations

import collections
from typing import Iterable

NO_LORA_SLOT = -1  # a base-model token's slot in BatchPlan.lora_slots


class LoRASlots:
    """max_loras slots: the adapter id each holds, in least-recently-used order."""

    def __init__(self, max_loras: int):
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {max_loras!r}")
        self.max_loras = max_loras
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first
        self.pending_loads: list[tuple[int, int]] = []  # (slot, adapter id) to load
        self.num_loads = 0
        self.num_evictions = 0

    def can_acquire(self, lora_id: int, in_use: set[int]) -> bool:
        """Whether lora_id is resident or a slot can take it (free, or holding an adapter
        outside in_use)."""
        return (lora_id in self.slot_of or len(self.slot_of) < self.max_loras
                or any(held not in in_use for held in self.slot_of))

    def acquire(self, lora_id: int, in_use: set[int]) -> int:
        """lora_id's slot, marked most recently used; a new one (free, else the least recently
        used outside in_use, evicted) queues a load. Call after can_acquire."""
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if len(self.slot_of) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
        else:
            victim = next(held for held in self.slot_of if held not in in_use)
            slot = self.slot_of.pop(victim)
            self.num_evictions += 1
        self.slot_of[lora_id] = slot
        self.pending_loads.append((slot, lora_id))
        self.num_loads += 1
        return slot

    def evict(self, lora_id: int) -> None:
        """Frees lora_id's slot (an adapter removed; no running request uses it). Between
        two schedules no load is pending (output() takes them all)."""
        self.slot_of.pop(lora_id, None)

    def take_loads(self) -> list[tuple[int, int]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads


def adapters_in_use(requests: Iterable) -> set[int]:
    """The adapter ids requests (running ones) use."""
    return {r.lora_id for r in requests if r.lora_id is not None}
