"""pagedjax: an LLM inference engine in JAX built on PagedAttention.

The public names load on first use (PEP 562), so `import pagedjax.scheduler` stays NumPy-only
(the scheduler is tested, replayed and simulated without jax) and `pagedjax --help` is quick.
"""

import importlib
import importlib.metadata

from pagedjax import _source_tree

_source_tree.install()

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

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted({*globals(), *__all__})
