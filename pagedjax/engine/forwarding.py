"""An engine's controls that its parts own, named on the engine: `update_weights =
forward_to("weights", WeightUpdates.update_weights)` is LLMEngine.update_weights calling
self.weights.update_weights, with the part's signature, types and docstring."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def forward_to(part: str, method: Callable[Concatenate[Any, P], R]
               ) -> Callable[Concatenate[Any, P], R]:
    """A method calling the same-named method of the object in attribute `part`."""
    name = method.__name__

    @functools.wraps(method)
    def forwarded(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return forwarded


def forward_property(part: str, name: str, doc: str | None = None) -> property:
    """A read-only property reading the attribute `name` of the object in attribute `part`."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)
