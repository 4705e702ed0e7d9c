"""Qwen3.5 / Qwen3-Next served by the paged engine: their Gated DeltaNet layers' state in the
KV cache's state group (scheduler/state_group.py, pallas_kernels/state_pages.py), against
transformers' greedy tokens: prefill in 4-token chunks (a chunk continues from the state and
conv window the last one left; prefills and decodes in one step), a state spanning several
blocks (block size 4: 624 values a layer over pages of 256), preemption by recompute (the state
rebuilt from zeros) and by swap (copied to host and back), n = 3 seeded samples (the state
forked by copy), and what is refused by name."""

from __future__ import annotations

import pytest
from helpers import until_done

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_models_hf import hf_greedy, prompts  # noqa: E402
from test_models_qwen3_5 import ARCHS, build  # noqa: E402

from pagedjax import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model  # noqa: E402

MAX_TOKENS = 8
BASE = dict(block_size=4, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=4,
            min_seq_bucket=4, enable_prefix_caching=False)


# The MoE variants' runs go to make test-slow (the dense one keeps the engine path in make test).
SLOW = pytest.mark.slow  # the mixtures' engine runs: make test's time budget
ARCH_PARAMS = [pytest.param(arch, marks=() if arch == "qwen3_5" else SLOW)
               for arch in sorted(ARCHS)]


@pytest.fixture(scope="module", params=ARCH_PARAMS)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, directory)
    return hf, load_hf_model(str(directory))


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5")
    hf = build("qwen3_5", directory)
    return hf, load_hf_model(str(directory)), hf_greedy(hf, prompts(), MAX_TOKENS)


def run(model, requests, **config):
    engine = LLMEngine(model, EngineConfig(**{**BASE, **config}))
    ids = [engine.add_request(p, params) for p, params in requests]
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.kv_manager.num_used_blocks == 0, "state blocks leaked"
    return [done[i] for i in ids], engine


def greedy(token_prompts):
    return [(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)) for p in token_prompts]


def test_greedy_tokens_equal_transformers_with_4_token_chunks(pair):
    hf, model = pair
    outputs, engine = run(model, greedy(prompts()))
    assert [o.output_token_ids for o in outputs] == hf_greedy(hf, prompts(), MAX_TOKENS)
    windows = engine.scheduler.kv_manager.windows
    assert [getattr(w, "num_blocks", None) for w in windows] == [None, 3, 3, 3]


@pytest.mark.slow  # make test-slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_tokens(qwen3_5, mode):
    _, model, expected = qwen3_5
    # 2 attention layers a block of 4 tokens and 9 state blocks a request: 40 blocks hold
    # two or three requests at a time, not the five
    outputs, engine = run(model, greedy(prompts()), num_blocks=40, max_num_batched_tokens=16,
                          preemption_mode=mode, swap_space_bytes=4 << 20)
    assert [o.output_token_ids for o in outputs] == expected
    stats = engine.stats
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    if mode == "swap":
        assert stats.num_swap_outs > 0 and stats.num_recomputed_tokens == 0
    else:
        assert stats.num_recomputed_tokens > 0


def test_seeded_samples_each_equal_their_seed_alone(qwen3_5):
    _, model, _ = qwen3_5
    prompt = prompts()[1]  # 40 tokens: ten prefill chunks, then the fork
    sample = lambda seed, n=1: SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5,  # noqa
                                              seed=seed, n=n)
    (together,), _ = run(model, [(prompt, sample(7, n=3))])
    alone, _ = run(model, [(prompt, sample(7 + i)) for i in range(3)])
    assert [o.token_ids for o in together.outputs] == [o.output_token_ids for o in alone]
    assert len({tuple(o.output_token_ids) for o in alone}) == 3, "seeds were meant to differ"


@pytest.mark.parametrize("field, value, words", [
    ("kv_cache_dtype", "int8", "unquantized"),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}, "draft"),
    ("enable_lora", True, "adapters"),
    ("async_scheduling", True, "state copy"),
    ("disable_hybrid_kv_cache_manager", True, "hybrid"),
])
def test_what_cannot_hold_a_state_is_refused_by_name(qwen3_5, field, value, words):
    _, model, _ = qwen3_5
    with pytest.raises(ValueError, match=words):
        LLMEngine(model, EngineConfig(**{**BASE, field: value}))


def test_prefix_caching_is_turned_off_and_said(qwen3_5, caplog):
    _, model, expected = qwen3_5
    with caplog.at_level("WARNING", logger="pagedjax.engine"):
        engine = LLMEngine(model, EngineConfig(**{**BASE, "enable_prefix_caching": True}))
    assert "prefix caching is off" in caplog.text
    assert not engine.scheduler.kv_manager.enable_prefix_caching


@pytest.mark.slow  # two engines of interpreted Pallas kernels (attention and the decode update)
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_the_pallas_backends_serve_the_same_tokens(backend, tmp_path):
    """The TPU and GPU attention kernels and decode updates (pallas_kernels/gated_delta_step.py)
    interpreted: value heads of 32 columns and key heads of 16, shapes Triton's blocks take."""
    hf = build("qwen3_5", tmp_path, linear_key_head_dim=16, linear_value_head_dim=32)
    token_prompts = prompts()[:3]
    outputs, _ = run(load_hf_model(str(tmp_path)), greedy(token_prompts), block_size=16,
                     max_num_batched_tokens=16, attention_backend=backend,
                     attention_interpret=True)
    assert [o.output_token_ids for o in outputs] == hf_greedy(hf, token_prompts, MAX_TOKENS)
