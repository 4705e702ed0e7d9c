"""After warmup(), a long mixed trace compiles nothing new."""

from helpers import until_done
import numpy as np

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.runner import num_step_traces


def test_no_compilation_after_warmup(tiny_model):
    # Token buckets 16/32, sequence buckets 2/4: six step programs to compile (the test's
    # cost), then 120 requests of lengths up to the model's 128 through them.
    config = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                          min_token_bucket=16, min_seq_bucket=2, block_size=8, num_blocks=48)
    engine = LLMEngine(tiny_model, config)
    num_shapes = engine.warmup()
    assert num_shapes == engine.buckets.num_programs == engine.num_compiled_programs
    traces_after_warmup = num_step_traces()

    rng = np.random.default_rng(0)
    num_requests = 120
    for i in range(num_requests):
        prompt_len = int(np.clip(rng.lognormal(2.5, 0.9), 1, 100))
        max_tokens = int(np.clip(rng.lognormal(1.5, 0.8), 1, 128 - prompt_len))
        temperature = 0.0 if i % 3 else 0.8
        engine.add_request(rng.integers(0, 256, prompt_len).tolist(),
                           SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                          top_k=20 if i % 2 else -1, seed=i))
        if i % 10 == 9:  # requests keep arriving while others run
            engine.step()
    for _ in until_done(engine):
        engine.step()
    assert engine.stats.num_finished == num_requests
    assert engine.stats.num_prefill_steps > 0 and engine.stats.num_decode_steps > 0
    assert num_step_traces() == traces_after_warmup, "a step program compiled after warmup"
    assert engine.num_compiled_programs <= engine.buckets.num_programs
