"""pagedjax: an LLM inference engine in JAX built on PagedAttention."""

import importlib.metadata

from pagedjax.engine.beam_search import BeamSearchParams, BeamSequence
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedjax.llm import LLM, load_model
from scheduler import SamplingParams, StructuredOutputs
from scheduler.request import Logprob

StructuredOutputsParams = StructuredOutputs  # vLLM's name

try:
    __version__ = importlib.metadata.version("pagedjax")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["BeamSearchParams", "BeamSequence", "EngineConfig", "LLMEngine", "LLM", "load_model",
           "CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams", "Logprob",
           "StructuredOutputs", "StructuredOutputsParams", "__version__"]
