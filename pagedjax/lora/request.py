"""LoRARequest (vLLM's): the adapter a request runs under, and the engine's LoRA limits."""

from __future__ import annotations

import dataclasses

# vLLM's --max-lora-rank choices
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORA_NAME_CHARS = 256


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and path, as vLLM's `LoRARequest(lora_name, lora_int_id,
    lora_path)`: the id (>= 1) keys the engine's slots and host cache, the name is what the
    server's `model` field and the outputs show, the path a PEFT adapter directory
    (pagedjax.lora.peft_adapter). base_model_name: the model it adapts (the server's
    /v1/models `parent`; None: the engine's)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        name = self.lora_name
        if not isinstance(name, str) or not name or len(name) > MAX_LORA_NAME_CHARS:
            raise ValueError(f"lora_name must be a non-empty string of at most "
                             f"{MAX_LORA_NAME_CHARS} characters, got {name!r}")
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {lora_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got "
                             f"{type(self.lora_path).__name__}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string, got "
                             f"{type(self.base_model_name).__name__}")

    # vLLM's property names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def check_lora_limits(max_loras, max_lora_rank, max_cpu_loras) -> None:
    """EngineConfig's LoRA fields: ValueError naming the first out of its range."""
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max_lora_rank not in LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {max_lora_rank!r}")
    if max_cpu_loras is not None:
        if isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int):
            raise ValueError(f"max_cpu_loras must be an integer, got {max_cpu_loras!r}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras "
                             f"({max_loras})")
