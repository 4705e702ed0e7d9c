"""The training-to-serving controls a server sends its engine (pagedjax/serving/weight_routes.py),
by name, run on the engine's thread between two steps: in process through
AsyncLLMEngine.control, in the engine core process through CoreClient.control (its channel
carries the name and plain arguments, never code)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedjax.lora.request import LoRARequest


def _update_weights(engine, path: str, version: str | None, mode: str) -> str:
    """New weights from a checkpoint path, read as LLM reads a model (pagedjax.frontend.llm)."""
    from pagedjax.frontend.llm import checkpoint_for_update

    engine.update_weights(checkpoint_for_update(engine, path), version=version, mode=mode)
    return engine.weight_version


def _weight_info(engine) -> dict:
    return {"weight_version": engine.weight_version, "is_paused": engine.is_paused,
            "is_sleeping": engine.is_sleeping}


CONTROLS: dict[str, Callable[..., Any]] = {
    "update_weights": _update_weights,
    "pause": lambda engine, mode: engine.pause_generation(mode),
    "resume": lambda engine: engine.resume_generation(),
    "hold_new": lambda engine: engine.hold_new_requests(),
    "release_new": lambda engine: engine.release_new_requests(),
    "in_flight": lambda engine: engine.num_in_flight,
    "reset_prefix_cache": lambda engine: engine.reset_prefix_cache(),
    "weight_info": _weight_info,
    "sleep": lambda engine, level: engine.sleep(level),
    "wake_up": lambda engine, tags: engine.wake_up(tags),
    # LoRA adapters (pagedjax/serving/lora_routes.py): plain arguments, the request built here
    "add_lora": lambda engine, lora_name, lora_id, path: engine.add_lora(
        LoRARequest(lora_name, lora_id, path)),
    "remove_lora": lambda engine, lora_id: engine.remove_lora(lora_id),
    "update_lora": lambda engine, lora_name, path: engine.update_lora(lora_name, path),
}


def run_control(engine, name: str, kwargs: dict):
    """CONTROLS[name](engine, **kwargs); ValueError for a name it does not have."""
    control = CONTROLS.get(name)
    if control is None:
        raise ValueError(f"unknown engine control {name!r} (known: {sorted(CONTROLS)})")
    return control(engine, **kwargs)
