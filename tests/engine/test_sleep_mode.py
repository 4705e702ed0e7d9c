"""Sleep mode (issue 52: pagedjax/engine/sleep_mode.py, vLLM's sleep / wake_up): an idle engine
gives its device memory back (JAX's live arrays counted) and takes it again with the same outputs
and no compile; level 2 takes the trainer's next weights through update_weights; a sleeping
engine refuses requests by name."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.engine.runner import num_step_compiles
from pagedjax.engine.sleep_mode import EngineAsleepError
from pagedjax.models import get_config, init_model

ENGINE = dict(tokenizer="byte", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=4, num_blocks=64)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, seed=5, n=2)
PROMPTS = ["sleep and wake ", "another prompt"]


@pytest.fixture(scope="module")
def models():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return init_model(config, seed=1), init_model(config, seed=2)


def answers(llm) -> list:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False) + llm.generate(PROMPTS, SEEDED,
                                                                         use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def engine_bytes(llm) -> int:
    """Device bytes the engine's own arrays hold (its weights are copies: stacked layers; the
    embedding, norm and head alias the model's and stay with it)."""
    runner = llm.engine.runner
    return sum(leaf.nbytes for leaf in jax.tree.leaves((runner.params, runner.kv_cache)))


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_memory_back_and_waking_answers_as_before(models, level):
    old, new = models
    fresh = answers(LLM(new, **ENGINE)) if level == 2 else None  # compiled here, not below
    llm = LLM(old, **ENGINE)
    before = answers(llm)
    awake, live = engine_bytes(llm), live_bytes()
    compiles = num_step_compiles()
    llm.sleep(level)
    assert llm.is_sleeping and engine_bytes(llm) == 0
    # freed on the device: the KV pool and the stacked layers the engine alone held
    freed = live - live_bytes()
    assert freed >= 0.5 * awake, (freed, awake)
    with pytest.raises(EngineAsleepError, match=r"the engine is asleep \(sleep level"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if level == 1:
        llm.wake_up(["weights"])
        assert llm.engine.sleep_level == 1  # the KV pool still sleeps
        with pytest.raises(EngineAsleepError, match="kv_cache off the device"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert answers(llm) == before
    else:
        with pytest.raises(ValueError, match="level 2 dropped the weights: update_weights"):
            llm.wake_up()
        llm.wake_up(["kv_cache"])  # first the pool, then new weights wake the rest
        assert llm.is_sleeping and llm.engine.sleep_level == 2
        llm.update_weights(new, version="after-sleep")
        assert answers(llm) == fresh
        assert llm.weight_version == "after-sleep"
    assert not llm.is_sleeping and llm.engine.sleep_level == 0
    assert num_step_compiles() == compiles


def test_sleep_needs_an_idle_engine_and_a_level(models):
    old, _ = models
    llm = LLM(old, **ENGINE)
    llm.engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="sleep needs an idle engine"):
        llm.sleep()
    for _ in range(50):
        if not llm.engine.has_unfinished():
            break
        llm.engine.step()
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="level must be 1 .* or 2"):
            llm.sleep(bad)
    llm.sleep()  # level 1 by default, as vLLM's
    assert llm.engine.sleep_level == 1 and llm.engine.runner.params is None
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="tags must be among"):
        llm.wake_up(["gpu"])
    llm.wake_up()
    llm.engine.sleep()  # the engine's default too
    assert llm.engine.sleep_level == 1 and llm.engine.sleep_mode._host_weights is not None
