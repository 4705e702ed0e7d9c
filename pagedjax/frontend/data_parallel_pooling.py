"""Pooling requests over data-parallel replicas (a mixin of DataParallelEngine): every replica
serves the one PoolingModel LLM sets, and a pooling request is placed by the prefix-affinity
rule as any other (a shared instruction prefix goes where its blocks are cached) and pooled on
its replica (pagedjax.engine.pooling_requests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedjax.engine.pooling_requests import add_pooling_request, check_pooling_params, pooling_spec
from pagedjax.pooling.pooling_model import PoolingModel

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine


class DataParallelPooling:
    """(DataParallelEngine has replicas, config, model_config and add_requests.)"""

    replicas: list[LLMEngine]

    pooling_spec = pooling_spec
    check_pooling_params = check_pooling_params
    add_pooling_request = add_pooling_request

    @property
    def runner_type(self) -> str:
        return self.replicas[0].runner_type

    @property
    def pooling_model(self) -> PoolingModel:
        return self.replicas[0].pooling_model

    @pooling_model.setter
    def pooling_model(self, value: PoolingModel) -> None:
        for replica in self.replicas:
            replica.pooling_model = value
