"""The engine interface (issue 72): what the front-ends (LLM, the engine driver under
AsyncLLMEngine and the engine core process) and the server read of an engine, one Protocol that
LLMEngine, DataParallelEngine and EncoderEngine implement. Code that takes an engine reads these
members directly (no probing for what one kind lacks); a control added to the engines is added
here, so a kind that lacks it fails tests/frontend/test_engine_protocol.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pagedjax.engine.config import EngineConfig
    from pagedjax.engine.request_checks import PromptSpec
    from pagedjax.engine.stats import EngineStats


@runtime_checkable
class Engine(Protocol):
    config: "EngineConfig"
    model_config: Any
    tokenizer: Any
    stats: "EngineStats"
    runner_type: str  # "generate" or "pooling": the routes a server over it serves
    pooling_model: Any  # pagedjax.pooling.pooling_model.PoolingModel
    memory_budget: Any  # how the KV pool was sized (memory_budget.MemoryBudget), or None
    request_groups: Mapping  # request id -> its samples (scheduler Requests), until finished

    @property
    def replicas(self) -> list:
        """The engines that hold devices: a data-parallel engine's replicas, else [itself]."""

    @property
    def held_memory(self) -> tuple[int, int]: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def weight_version(self) -> str: ...

    def add_requests(self, specs: Sequence["PromptSpec"], admit=None) -> list[str]: ...

    def step(self, final_only: bool = False) -> list: ...

    def abort(self, request_id: str) -> Any: ...

    def has_unfinished(self) -> bool: ...

    def fail_all(self, error: BaseException) -> list: ...

    def load(self) -> list: ...

    def scheduler_states(self) -> list: ...

    def blocks_for(self, num_tokens: int) -> int: ...

    def clock(self) -> float: ...

    def close(self) -> None: ...
