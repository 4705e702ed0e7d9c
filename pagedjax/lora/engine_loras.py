"""LLMEngine's LoRA controls (a part of the engine; vLLM's add_lora / remove_lora / list_loras, and
update_lora for adapter-only training-to-serving sync): adapters known before any request names
them, dropped, and given new weights in place.

update_lora follows update_weights' rules (pagedjax.engine.weight_updates): the new weights are
checked whole before anything changes; the requests in flight as `mode` says ("wait": they finish
first under the old weights, "abort": they end, "keep": they go on under the new ones); the
adapter's version is bumped, so the prefix cache never serves KV computed under the old weights
to a new request; a resident adapter's slot is written at once, between two steps (the step
programs are untouched: nothing compiles).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedjax.lora.manager import LoRAManager
from pagedjax.lora.peft_adapter import (LoRAAdapter, adapter_from_tensors, check_adapter_values,
                                        read_peft_adapter)
from pagedjax.lora.request import LoRARequest
from pagedjax.scheduler.lora_slots import LoRASlots, adapters_in_use

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine


class LoRAControls:
    """LLMEngine's LoRA controls, a part of the engine (engine.loras), over its lora_manager,
    scheduler and runner."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def manager(self) -> LoRAManager:
        """The engine's adapters (ValueError when it serves none)."""
        if self.engine.lora_manager is None:
            raise ValueError("this engine serves no LoRA adapters; build it with "
                             "enable_lora=True")
        return self.engine.lora_manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads and checks an adapter ahead of its requests (ValueError naming what does not
        fit); True once it is known."""
        self.manager().check(lora_request, revive=True)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Drops an adapter: no new request may name it; requests running under it finish.
        False for an id the engine does not know."""
        manager = self.manager()
        if not manager.knows(lora_id):
            return False
        manager.forget(lora_id, self.release_lora_slot(lora_id))
        return True

    def release_lora_slot(self, lora_id: int) -> bool:
        """Frees the adapter's slot unless a running request uses it; whether any unfinished
        request of this engine names it."""
        state = self.engine.scheduler.state
        if lora_id not in adapters_in_use(state.running):
            _slots(state).evict(lora_id)
        return any(r.lora_id == lora_id for r in state.requests.values())

    def list_loras(self) -> set[int]:
        """The ids of the adapters requests may name."""
        return set(self.manager().ids.values())

    def update_lora(self, name: str, weights, *, mode: str = "wait") -> None:
        """New weights for the adapter `name` (known: named by a request or add_lora):
        a PEFT adapter directory, a LoRAAdapter, or a mapping of PEFT tensor names
        (`base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight` [r, in], lora_B
        [out, r]: what a trainer's adapter state saves) to arrays, for the adapter's own rank,
        alpha and targets (a projection a mapping leaves out is zero)."""
        update_lora(self.engine, [self.engine], name, weights, mode)

    def rewrite_lora(self, lora_id: int, arrays: dict) -> None:
        """An adapter's new weights (its version bumped) into its slot, if resident, and its
        requests that never ran keyed by the new version (not hashed against old KV)."""
        engine = self.engine
        state = engine.scheduler.state
        slot = _slots(state).slot_of.get(lora_id)
        if slot is not None:
            engine.runner.write_lora_slot(slot, arrays)
        for request in state.requests.values():
            if request.lora_id == lora_id and request.first_scheduled_time is None:
                request.lora_key = self.manager().key(lora_id)
                request.block_hashes.clear()


def update_lora(engine, replicas, name, weights, mode: str) -> None:
    """update_lora's one sequence: the new weights checked whole, then engine paused as
    mode says, the adapter's weights replaced once (its version bumped) and each replica's
    slot rewritten, then resumed (unless it was paused before)."""
    manager = replicas[0].loras.manager()
    lora_id = lora_id_of(manager, name)
    adapter, pinned = new_adapter(manager, lora_id, weights, engine.model_config)
    arrays = manager.host_arrays(adapter)  # checked before anything changes
    was_paused = engine.is_paused
    engine.pause_generation(mode)
    try:
        manager.replace(lora_id, adapter, pinned)
        for replica in replicas:
            replica.loras.rewrite_lora(lora_id, arrays)
    finally:
        if not was_paused:
            engine.resume_generation()


def lora_id_of(manager, name) -> int:
    """The id of the adapter named name (ValueError naming the known ones otherwise)."""
    lora_id = manager.ids.get(name) if isinstance(name, str) else None
    if lora_id is None:
        raise ValueError(f"update_lora: no LoRA adapter named {name!r} (known: "
                         f"{sorted(manager.ids)})")
    return lora_id


def new_adapter(manager, lora_id: int, weights, model_config) -> tuple[LoRAAdapter, bool]:
    """(the adapter update_lora's weights give, whether it is held only in memory)."""
    label = f"update_lora({manager.adapters[lora_id].lora_name!r})"
    if isinstance(weights, str):
        return read_peft_adapter(weights, model_config, manager.spec.max_rank), False
    if isinstance(weights, LoRAAdapter):
        if weights.rank > manager.spec.max_rank:
            raise ValueError(f"{label}: rank {weights.rank} is over max_lora_rank "
                             f"({manager.spec.max_rank})")
        return check_adapter_values(weights), True
    if not hasattr(weights, "items"):
        raise ValueError(f"{label}: weights must be a PEFT adapter directory, a "
                         f"LoRAAdapter or a mapping of PEFT tensor names to arrays, got "
                         f"{type(weights).__name__}")
    rank, scaling, targets = manager.shapes[lora_id]
    return adapter_from_tensors(label, dict(weights.items()), model_config, rank,
                                scaling, targets), True


class DataParallelLoRA:
    """A data-parallel engine's LoRA controls (a mixin; it has replicas, model_config and the
    pause controls): one set of adapters, each replica its own slots."""

    replicas: list[LLMEngine]  # DataParallelEngine's

    @property
    def lora_manager(self):
        return self.replicas[0].lora_manager

    def add_lora(self, lora_request) -> bool:
        return self.replicas[0].add_lora(lora_request)

    def list_loras(self) -> set[int]:
        return self.replicas[0].list_loras()

    def remove_lora(self, lora_id: int) -> bool:
        manager = self.replicas[0].loras.manager()
        if not manager.knows(lora_id):
            return False
        in_use = [replica.loras.release_lora_slot(lora_id) for replica in self.replicas]
        manager.forget(lora_id, any(in_use))
        return True

    def update_lora(self, name: str, weights, *, mode: str = "wait") -> None:
        """LLMEngine.update_lora on every replica: checked once, the version bumped once,
        each replica's slot rewritten."""
        update_lora(self, self.replicas, name, weights, mode)


def _slots(state) -> LoRASlots:
    """The scheduler's LoRA slots (an engine built with enable_lora has them)."""
    if state.lora_slots is None:
        raise ValueError("this engine serves no LoRA adapters (enable_lora=False)")
    return state.lora_slots
