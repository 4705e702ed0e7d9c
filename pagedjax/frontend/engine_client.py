"""The interface the server depends on, wherever the engine runs: AsyncLLMEngine (the engine in
a thread of the server's process, pagedjax.frontend.async_engine) and CoreClient (the engine
core in a process of its own, pagedjax.frontend.core_client) implement it, and the server reads
nothing else of them. (The engines themselves implement pagedjax.engine.engine_protocol.Engine.)
A control added to the front-ends is added here; tests/frontend/test_engine_protocol.py fails for a
front-end that lacks it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagedjax.engine.request_checks import PromptSpec

if TYPE_CHECKING:
    from pagedjax.engine.outputs import RequestOutput
    from pagedjax.frontend.admission_control import AdmissionLimits
    from pagedjax.frontend.async_engine import RequestGroup
    from pagedjax.scheduler import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    # the engine (an Engine), or, for an engine core, its description (core_client.EngineView)
    engine: Any

    @property
    def limits(self) -> AdmissionLimits:
        """Admission control's rules (replaced between steps: degradation does)."""

    @limits.setter
    def limits(self, limits: AdmissionLimits) -> None: ...

    @property
    def num_live(self) -> int:
        """Requests admitted and not finished (nor aborted)."""

    @property
    def running(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    def dead_reason(self) -> str: ...

    def start(self) -> Any: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    async def add_requests(self, prompts: Sequence[PromptSpec],
                           streamed: bool = True) -> RequestGroup:
        """Validates and admits prompts together, all or none; their outputs come through the
        returned group."""
        ...

    async def control(self, name: str, **kwargs) -> Any:
        """An engine control (pagedjax.frontend.engine_control) run between two steps."""

    async def abort(self, request_id: str) -> None: ...

    def abort_soon(self, request_id: str) -> None: ...

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       request_id: str | None = None, prompt_text: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """One request's outputs until the finished one (see add_requests)."""
        group = await self.add_requests(
            [PromptSpec(prompt_token_ids, params, request_id, prompt_text, cache_salt)])
        async with group:
            async for out in group:
                yield out
