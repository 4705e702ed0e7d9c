"""After warmup(), a long mixed trace compiles nothing new; a compiled step keeps the cache in
place."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import until_done

from benchmarks.aot.xla_tpu import whole_copies
from pagedjax import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedjax.engine.step_counts import num_step_compiles, num_step_traces
from pagedjax.engine.step_functions import step_program as _step
from pagedjax.engine.warmup import warmup_shapes
from pagedjax.models import get_config, init_model
from pagedjax.scheduler import DECODE
from pagedjax.scheduler.plan import padding_plan
from pagedjax.text.tokenizer import ByteTokenizer


@pytest.mark.slow  # 10 s: make test-slow (every request kind after warm-up stays in make test)
def test_no_compilation_after_warmup(tiny_model):
    # Token buckets 16/32, sequence buckets 2/4: six step programs to compile (the test's
    # cost), then 120 requests of lengths up to the model's 128 through them.
    config = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                          min_token_bucket=16, min_seq_bucket=2, block_size=8, num_blocks=48)
    engine = LLMEngine(tiny_model, config)
    num_shapes = engine.warmup()
    # the step programs and their prompt-logprobs variants (one a prefill shape)
    assert num_shapes == engine.num_compiled_programs == engine.buckets.num_programs + len(
        engine.buckets.prefill_shapes())
    traces_after_warmup, compiles_after_warmup = num_step_traces(), num_step_compiles()

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
    assert num_step_traces() == traces_after_warmup, "a step program traced after warmup"
    assert num_step_compiles() == compiles_after_warmup, "a step program compiled after warmup"
    assert engine.num_compiled_programs == num_shapes


class BackendCompiles:
    """Counts XLA backend compiles (any program: steps, samplers, fills, a stray jnp op) while
    it is on (JAX's monitoring event; the suite runs without the persistent cache)."""

    def __init__(self):
        self.on, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event, duration, **kwargs):
        if self.on and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


@pytest.fixture(scope="module")
def backend_compiles():
    return BackendCompiles()


# the synchronous engine's in make test-slow (11 s: make test's time); the async one here
@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["sync", "async"])
def test_no_request_compiles_anything_after_warmup(async_scheduling, backend_compiles):
    """After warmup() requests of every kind (prompt logprobs, penalties, a grammar, allowed
    tokens, logit bias, min_p, logprobs, n > 1, best_of) of every length compile nothing at
    all: no step program, no sampler variant, no token fill, nothing else."""
    byte = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    config = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                          min_token_bucket=16, min_seq_bucket=2, block_size=8,
                          async_scheduling=async_scheduling)
    engine = LLMEngine(init_model(byte, seed=5), config, tokenizer=ByteTokenizer())
    engine.warmup()
    backend_compiles.on = True
    try:
        kinds = [dict(), dict(temperature=0.8, top_k=20, top_p=0.9), dict(logprobs=3),
                 dict(prompt_logprobs=2), dict(repetition_penalty=1.2, presence_penalty=0.3),
                 dict(logit_bias={5: 2.0}), dict(min_p=0.1), dict(allowed_token_ids=[97, 98]),
                 dict(structured_outputs={"regex": "[a-z]{2,6}"}), dict(n=2, seed=1),
                 dict(best_of=3, seed=2), dict(min_tokens=3)]
        rng = np.random.default_rng(1)
        for i, kind in enumerate(kinds * 2):
            prompt = rng.integers(0, 256, int(rng.integers(1, 90))).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 30)),
                                                      **kind))
            if i % 3 == 2:
                engine.step()
        for _ in until_done(engine):
            engine.step()
    finally:
        backend_compiles.on = False
    assert engine.stats.num_finished == 2 * len(kinds)
    assert backend_compiles.count == 0, f"{backend_compiles.count} compiles after warmup"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.quick_variant('auto')  # the others: make test-slow
def test_compiled_step_updates_the_cache_in_place(tiny_model, kv_cache_dtype):
    """The layers run under one scan with the whole cache carried through: XLA must keep the
    donated pool where it lies (the output aliases it, no copy of it, temporaries that do not
    grow with it), or every step would move the whole pool."""
    temps = []
    for num_blocks in (256, 1024):
        config = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                              block_size=8, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
        runner = LLMEngine(tiny_model, config).runner
        plan = padding_plan(DECODE, 4, 4, max_blocks_per_seq=8)
        compiled = _step.lower(runner.graph, runner.backend, 0, runner.params, runner.kv_cache,
                               plan).compile()
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= sum(
            leaf.nbytes for leaf in jax.tree.leaves(runner.kv_cache))
        temps.append(memory.temp_size_in_bytes)
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner.kv_cache)
        assert whole_copies(compiled.as_text(), args) == {}
    assert temps[0] == temps[1], temps


@pytest.mark.slow  # every program compiled in the background: make test-slow
def test_background_warmup_serves_meanwhile_and_compiles_each_program_once(tiny_model):
    """start_warmup compiles in a thread while the engine steps: requests are answered as
    they would be without it, every shape compiles exactly once (whichever thread comes
    first), and after the warmup no step compiles."""
    config = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                          min_token_bucket=16, min_seq_bucket=2, block_size=8, num_blocks=48)
    prompts = [list(range(1, 1 + n)) for n in (5, 19, 40)]
    params = SamplingParams(max_tokens=8, temperature=0)
    reference = [o.output_token_ids for o in LLM(tiny_model, **vars_of(config)).generate(
        prompts, params, use_tqdm=False)]
    engine = LLMEngine(tiny_model, config)
    compiles = num_step_compiles()
    warmup = engine.start_warmup()
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    for _ in until_done(engine):
        for output in engine.step():
            outputs[output.request_id] = output
    assert warmup.wait(timeout=300) and warmup.error is None
    assert [outputs[i].output_token_ids for i in ids] == reference
    assert engine.num_compiled_programs == warmup.num_programs == len(
        warmup_shapes(engine.buckets, variants=True))
    assert num_step_compiles() - compiles == warmup.num_programs  # none twice
    engine.add_request(prompts[1], params)
    for _ in until_done(engine):
        engine.step()
    assert num_step_compiles() - compiles == warmup.num_programs


def vars_of(config: EngineConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@pytest.mark.slow  # make test-slow
def test_block_moves_compile_nothing_after_warmup(tiny_model, backend_compiles, tmp_path):
    """Swap preemption and the tiered prefix cache move whole blocks (a gather and a scatter a
    power of two of them): warmup compiles those too."""
    config = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                          min_token_bucket=16, min_seq_bucket=2, block_size=8, num_blocks=30,
                          preemption_mode="swap", swap_space_bytes=64 * 4096,
                          kv_offload_bytes=8 * 4096, kv_disk_dir=str(tmp_path),
                          kv_disk_bytes=1 << 22)
    engine = LLMEngine(tiny_model, config)
    engine.warmup(variants=False)
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 256, int(rng.integers(40, 90))).tolist() for _ in range(5)]
    backend_compiles.on = True
    try:
        for turn in range(3):
            for i, doc in enumerate(docs):
                engine.add_request(doc + [turn, i], SamplingParams(
                    max_tokens=int(rng.integers(4, 30)), temperature=0.0))
            for _ in until_done(engine):
                engine.step()
    finally:
        backend_compiles.on = False
    stats = engine.stats
    assert stats.num_swap_outs > 0 and stats.kv_tiers["host"]["hits"] > 0
    assert stats.kv_tiers["disk"]["hits"] > 0
    assert backend_compiles.count == 0, f"{backend_compiles.count} compiles after warmup"
    engine.close()


@pytest.mark.slow  # make test-slow
def test_token_padding_gap_runs_steps_of_its_buckets(tiny_model):
    """EngineConfig.token_padding_gap (--token-padding-gap): a 40-token prefill runs in a
    48-token step (gap 16) instead of 64, with the default buckets' tokens; a bad gap is
    refused by name."""
    from pagedjax.tools.engine_args import add_engine_args, engine_kwargs

    base = dict(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=64, block_size=8)
    prompt = list(range(3, 43))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    outputs = {}
    for gap in (0, 16):
        llm = LLM(tiny_model, **base, token_padding_gap=gap)
        outputs[gap] = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        prefill_tokens = {t for kind, t, _ in llm.engine.runner.step_shapes if kind != DECODE}
        assert prefill_tokens == {64 if gap == 0 else 48}
    assert outputs[16] == outputs[0]
    with pytest.raises(ValueError, match="token_padding_gap"):
        EngineConfig(**base, token_padding_gap=4)
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--token-padding-gap", "256"]))[
        "token_padding_gap"] == 256
