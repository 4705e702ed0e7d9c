"""pagedjax: an LLM inference engine in JAX built on PagedAttention."""

from pagedjax.engine.beam_search import BeamSearchParams, BeamSequence
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedjax.llm import LLM, load_model
from scheduler import SamplingParams

__all__ = ["BeamSearchParams", "BeamSequence", "EngineConfig", "LLMEngine", "LLM", "load_model", "CompletionOutput",
           "RequestMetrics", "RequestOutput", "SamplingParams"]
