"""LazyModel: a checkpoint checked but not read, which an engine reads straight into its devices'
shardings (pagedjax.models.loading.placed_weights builds them; the quantized loaders wrap them)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import LlamaForCausalLM


@dataclasses.dataclass(eq=False)
class LazyModel:
    """A checked checkpoint, not read: `config`, `abstract` (the model, shapes only) and
    place(weights, placement) -> the serving-form weights, each leaf built in
    placement(path, leaf)."""

    config: LlamaConfig
    abstract: LlamaForCausalLM
    place: Callable
    source: str

    @property
    def dtype(self):
        return self.abstract.dtype
