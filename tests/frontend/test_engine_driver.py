"""The engine driver's running totals (pagedjax/frontend/engine_driver.py, issue 71): the
outstanding tokens admission control and every step's report read are kept without a pass over
every live request (a queue of 20,000 pooled pairs made each step O(queue)), and equal that pass
at every step: through chunked prefill, n > 1, preemption by recompute, aborts and finishes."""

from __future__ import annotations

import dataclasses

from helpers import until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.engine.request_checks import PromptSpec
from pagedjax.frontend.admission_control import AdmissionLimits
from pagedjax.frontend.engine_driver import EngineDriver, remaining_tokens
from pagedjax.models import get_config, init_model
from pagedjax.text.tokenizer import ByteTokenizer


def test_outstanding_tokens_equal_a_pass_over_the_live_requests():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    engine = LLMEngine(init_model(config, seed=2), EngineConfig(
        max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
        num_blocks=14, min_seq_bucket=2), tokenizer=ByteTokenizer())
    driver = EngineDriver(engine, AdmissionLimits())

    def spec(i: int) -> PromptSpec:
        params = SamplingParams(max_tokens=6 + i % 5, temperature=0.0, ignore_eos=True,
                                n=2 if i % 4 == 0 else 1)
        return PromptSpec(list(range(3, 3 + 5 + 7 * (i % 3))), params)

    def brute() -> int:
        return sum(remaining_tokens(live.samples) for live in driver.admitted.values())

    ids = driver.add([spec(i) for i in range(6)], streamed=False)
    assert driver.outstanding_tokens() == brute() > 0
    for step in until_done(engine, 500):
        driver.step()
        assert driver.outstanding_tokens() == brute(), step
        if step == 2:
            driver.abort(ids[3])
            ids += driver.add([spec(i) for i in range(6, 9)], streamed=True)
            assert driver.outstanding_tokens() == brute()
    assert engine.stats.num_preemptions > 0  # the small pool preempted by recompute
    assert driver.outstanding_tokens() == 0 and not driver.admitted
    driver.add([spec(i) for i in range(3)], streamed=False)
    driver.step()
    assert len(driver.drop_all()) == 3  # the engine died: nothing outstanding any more
    assert driver.outstanding_tokens() == 0 == brute()
