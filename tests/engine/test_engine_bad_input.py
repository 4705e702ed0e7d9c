"""Bad input: a clear ValueError naming the field, nothing allocated or queued, others unaffected."""

import dataclasses

import pytest
from helpers import until_done

from pagedjax import LLM, EngineConfig, LLMEngine, SamplingParams

CONFIG = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                      min_seq_bucket=4, block_size=4, num_blocks=12)


def snapshot(engine):
    state = engine.scheduler.state
    return (len(state.waiting), len(state.running), len(state.requests),
            engine.scheduler.kv_manager.num_free_blocks)


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt_token_ids"),
    ([1] * 60, SamplingParams(max_tokens=5), "max_model_len"),
    ([1, 2, 256], SamplingParams(), "vocab_size"),
    ([1, -1], SamplingParams(), "vocab_size"),
    ([[1, 2]], SamplingParams(), "prompt_token_ids"),
    ([1.5, 2.0], SamplingParams(), "integers"),
    ([1] * 40, SamplingParams(max_tokens=10), "whole pool"),  # 50 tokens > 11 blocks of 4
    ([1, 2], SamplingParams(stop_token_ids=(300,)), "stop_token_ids"),
    ([1, 2], "greedy", "sampling_params"),
])
def test_bad_request_changes_nothing(tiny_model, prompt, params, field):
    engine = LLMEngine(tiny_model, CONFIG)
    running = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0))
    engine.step()
    before = snapshot(engine)
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, params)
    assert snapshot(engine) == before
    outputs = {}
    for _ in until_done(engine):
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    reference = LLMEngine(tiny_model, CONFIG)
    ref_id = reference.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0))
    ref_out = {}
    for _ in until_done(reference):
        ref_out.update({o.request_id: o for o in reference.step() if o.finished})
    assert outputs[running].output_token_ids == ref_out[ref_id].output_token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(65)}), "logit_bias"),
    (dict(logit_bias=[(1, 1.0), (1, 2.0)]), "logit_bias"),
    (dict(logit_bias="x"), "logit_bias"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=-1), "seed"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=0), "block_size"),
    (dict(policy="round_robin"), "policy"),
    (dict(dtype="float8"), "dtype"),
    (dict(num_blocks=1), "num_blocks"),
    (dict(num_blocks=10, kv_cache_memory_bytes=10**6), "not num_blocks and kv_cache_memory_bytes"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_seqs"),
    (dict(victim_policy="oldest"), "victim_policy"),
    (dict(num_blocks=True), "num_blocks"),
    (dict(seed=1.5), "seed"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64),
     "max_num_batched_tokens"),
])
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_unknown_config_field_and_backend(tiny_model):
    with pytest.raises(ValueError, match="unknown engine config field"):
        LLM(tiny_model, blok_size=16)
    with pytest.raises(ValueError, match="attention_backend"):
        LLMEngine(tiny_model, dataclasses.replace(CONFIG, attention_backend="cuda-magic"))
    with pytest.raises(ValueError, match="power of two"):
        LLMEngine(tiny_model, dataclasses.replace(CONFIG, attention_backend="gpu", block_size=6,
                                                  attention_interpret=True))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(tiny_model, dataclasses.replace(CONFIG, max_model_len=4096,
                                                  max_num_batched_tokens=4096))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLMEngine(tiny_model, dataclasses.replace(CONFIG, num_blocks=None,
                                                  kv_cache_memory_bytes=100))


def test_generate_rejects_the_whole_call_before_queueing(tiny_model):
    llm = LLM(tiny_model, **dataclasses.asdict(CONFIG))
    with pytest.raises(ValueError, match="vocab_size"):
        llm.generate([[1, 2, 3], [999]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.kv_manager.num_used_blocks == 0
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].output_token_ids) == 2


def test_abort(tiny_model):
    engine = LLMEngine(tiny_model, CONFIG)
    a = engine.add_request([1] * 20, SamplingParams(max_tokens=8))
    b = engine.add_request([2] * 10, SamplingParams(max_tokens=8))
    engine.step()
    used = engine.scheduler.kv_manager.num_used_blocks
    assert used == 8  # 20 + 10 tokens in blocks of 4
    engine.abort("no-such-request")
    assert engine.scheduler.kv_manager.num_used_blocks == used
    engine.abort(a)
    assert engine.scheduler.kv_manager.num_used_blocks == 3
    assert engine.stats.num_aborted == 1
    for _ in until_done(engine):
        engine.step()
    assert engine.scheduler.kv_manager.num_used_blocks == 0
    engine.abort(b)  # finished already: a no-op
    assert engine.stats.num_aborted == 1


def test_duplicate_request_id_is_rejected(tiny_model):
    engine = LLMEngine(tiny_model, CONFIG)
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="x")
    before = snapshot(engine)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([3, 4], SamplingParams(max_tokens=2), request_id="x")
    assert snapshot(engine) == before


def test_abort_of_a_waiting_request(tiny_model):
    engine = LLMEngine(tiny_model, dataclasses.replace(CONFIG, max_num_seqs=1, min_seq_bucket=1))
    first = engine.add_request([1] * 8, SamplingParams(max_tokens=4))
    second = engine.add_request([2] * 8, SamplingParams(max_tokens=4))
    engine.step()
    assert len(engine.scheduler.state.waiting) == 1
    engine.abort(second)
    assert not engine.scheduler.state.waiting
    finished = []
    for _ in until_done(engine):
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [first]
