"""pagedjax: an LLM inference engine in JAX built on PagedAttention.

The public names load on first use (PEP 562), so `import pagedjax.scheduler` stays NumPy-only
(the scheduler is tested, replayed and simulated without jax) and `pagedjax --help` is quick.
"""

import importlib
import importlib.metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time __getattr__ loads them
    from pagedjax.engine.beam_search import BeamSearchParams, BeamSequence
    from pagedjax.engine.config import EngineConfig
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.engine.outputs import (CompletionOutput, PoolingRequestOutput, RequestMetrics,
                                         RequestOutput)
    from pagedjax.frontend.llm import LLM, load_model
    from pagedjax.lora.request import LoRARequest
    from pagedjax.pooling.params import PoolingParams
    from pagedjax.scheduler import (RequestOutputKind, SamplingParams, StructuredOutputs,
                                    StructuredOutputs as StructuredOutputsParams)
    from pagedjax.scheduler.request import Logprob

# name -> (module, attribute)
_EXPORTS = {
    "BeamSearchParams": ("pagedjax.engine.beam_search", "BeamSearchParams"),
    "BeamSequence": ("pagedjax.engine.beam_search", "BeamSequence"),
    "EngineConfig": ("pagedjax.engine.config", "EngineConfig"),
    "LLMEngine": ("pagedjax.engine.llm_engine", "LLMEngine"),
    "CompletionOutput": ("pagedjax.engine.outputs", "CompletionOutput"),
    "RequestMetrics": ("pagedjax.engine.outputs", "RequestMetrics"),
    "RequestOutput": ("pagedjax.engine.outputs", "RequestOutput"),
    "LLM": ("pagedjax.frontend.llm", "LLM"),
    "LoRARequest": ("pagedjax.lora.request", "LoRARequest"),
    "load_model": ("pagedjax.frontend.llm", "load_model"),
    "SamplingParams": ("pagedjax.scheduler", "SamplingParams"),
    "RequestOutputKind": ("pagedjax.scheduler", "RequestOutputKind"),
    "PoolingParams": ("pagedjax.pooling.params", "PoolingParams"),
    "PoolingRequestOutput": ("pagedjax.engine.outputs", "PoolingRequestOutput"),
    "StructuredOutputs": ("pagedjax.scheduler", "StructuredOutputs"),
    "StructuredOutputsParams": ("pagedjax.scheduler", "StructuredOutputs"),  # vLLM's name
    "Logprob": ("pagedjax.scheduler.request", "Logprob"),
}

try:
    __version__ = importlib.metadata.version("pagedjax")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# the names _EXPORTS loads, spelled out for static tools (tests/project/test_structure.py keeps them equal)
__all__ = ["BeamSearchParams", "BeamSequence", "EngineConfig", "LLMEngine", "CompletionOutput",
           "RequestMetrics", "RequestOutput", "LLM", "LoRARequest", "load_model",
           "SamplingParams", "RequestOutputKind", "PoolingParams", "PoolingRequestOutput", "StructuredOutputs",
           "StructuredOutputsParams", "Logprob", "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted({*globals(), *__all__})
