"""gpt-oss (models/families/gpt_oss.py) against transformers on a small random config with every
switch on: attention sinks drawn large enough to take much of each softmax, 8-token windows on
alternate layers (shorter than the prompts), q/k/v/o biases, YaRN, a biased router, experts with
biases and a swiglu_limit low enough that the clamp is reached on both sides."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_models_hf import (F32_TOL, engine_greedy, hf_greedy, hf_logits, prompts,  # noqa: E402
                            randomize_vectors)

from pagedjax.models.loading.hf import load_hf_model, read_hf_config  # noqa: E402
from pagedjax.models.loading.inspect import inspect_model_dir  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
              num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.6,
              max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 64},
              pad_token_id=0, eos_token_id=1, bos_token_id=2)


def build_gpt_oss(directory, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"  # the sinks' reference: eager_attention_forward
    model = transformers.GptOssForCausalLM(config).eval()
    randomize_vectors(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):  # from a small share of the softmax to most of it
                param.copy_(torch.linspace(-1.0, 3.0, param.numel()))
            elif name.endswith("router.weight"):
                param.copy_(torch.randn_like(param))  # spread, not near ties
            elif "experts" in name:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss")
    return build_gpt_oss(directory), str(directory)


def test_config_is_read_whole(gpt_oss):
    hf, directory = gpt_oss
    config = read_hf_config(directory)
    assert config.model_type == "gpt_oss" and config.attention_sinks and config.router_bias
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.sliding_window == 8 and config.rope_scaling.rope_type == "yarn"
    assert config.num_params == sum(p.numel() for p in hf.parameters())
    report = inspect_model_dir(directory)
    assert report["num_experts"] == 4


def test_dense_logits_match_transformers(gpt_oss):
    hf, directory = gpt_oss
    ids = np.random.default_rng(0).integers(0, 128, (2, 40))
    ours = np.asarray(load_hf_model(directory)(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


def test_the_clamp_is_reached(gpt_oss):
    """swiglu_limit 0.6 against expert pre-activations of spread ~1: both clamps bite."""
    hf, _ = gpt_oss
    experts = hf.model.layers[0].mlp.experts
    x = torch.randn(64, 64)
    with torch.no_grad():
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    assert (gate > 0.6).float().mean() > 0.1 and (up.abs() > 0.6).float().mean() > 0.1


MAX_TOKENS = 10


@pytest.mark.parametrize("engine", ["chunked", pytest.param("preemption",  # 5 s
                                                            marks=pytest.mark.slow)])
def test_engine_greedy_equals_transformers_generate(gpt_oss, engine):
    """Five prompts of 1 to 43 tokens (two sharing a 20-token prefix: a prefix hit) through the
    scanned serving form on KV cache groups: chunked prefill over 16-token budgets, windows of 8
    that free pages, preemption in a 16-block pool."""
    hf, directory = gpt_oss
    token_prompts = prompts()
    expected = hf_greedy(hf, token_prompts, MAX_TOKENS)
    config = dict(block_size=4, num_blocks=24) if engine == "preemption" else {}
    got, engine_ = engine_greedy(load_hf_model(directory), token_prompts, MAX_TOKENS, **config)
    assert got == expected
    if engine == "preemption":
        assert engine_.scheduler.state.num_preemptions > 0
    else:  # the second prompt of the shared prefix found its full-attention and window blocks
        assert engine_.stats.num_prefix_hit_tokens > 0


@pytest.fixture(scope="module")
def model(gpt_oss):
    return load_hf_model(gpt_oss[1])


@pytest.mark.slow  # 7 s: make test-slow
def test_ngram_speculative_decoding_keeps_the_greedy_tokens(gpt_oss, model):
    """Drafts verified through the sinks and windows: the tokens are transformers'."""
    hf, _ = gpt_oss
    token_prompts = [p * 2 for p in prompts()[:3]]  # repeated text: the n-gram drafts hit
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                prompt_lookup_max=3)
    got, engine = engine_greedy(model, token_prompts, MAX_TOKENS, speculative_config=spec,
                                max_model_len=160)
    assert got == hf_greedy(hf, token_prompts, MAX_TOKENS)
    assert engine.stats.num_spec_accepted_tokens > 0


@pytest.mark.slow  # 7 s: make test-slow
def test_seeded_samples_each_equal_their_seed_alone(model):
    """n = 3 samples of one prompt share its blocks (copy-on-write at the fork) and each equals
    the same seed's request alone."""
    from pagedjax import LLM, SamplingParams
    llm = LLM(model, block_size=4, max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=16, num_blocks=96)
    prompt = prompts()[1]
    sample = lambda seed, n=1: SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5,  # noqa
                                              seed=seed, n=n)
    [together] = llm.generate([prompt], sample(7, n=3), use_tqdm=False)
    alone = [llm.generate([prompt], sample(7 + i), use_tqdm=False)[0] for i in range(3)]
    assert [o.token_ids for o in together.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(a.outputs[0].token_ids) for a in alone}) == 3, "seeds were meant to differ"


def test_capacity_of_the_published_shapes():
    """gpt-oss-20b at 32k tokens: half its layers keep a 128-token window, so a sequence holds
    about half the KV of every layer keeping the context (that comparison's layers have no
    window at all); its weights with MXFP4 experts are what OpenAI states (12.8 GiB)."""
    from pagedjax.models import get_config
    from pagedjax.parallel.sharding import weight_bytes_per_device
    from pagedjax.tools.capacity_commands import capacity_layouts, kv_capacity

    config = get_config("gpt-oss-20b")
    groups, full = capacity_layouts(config, 16)
    rows = [kv_capacity(config, layout, 16, 16 << 30, 32768, max_tokens_per_step=2048)
            for layout in (groups, full)]  # chunks of 2048 tokens: what a window group holds
    assert rows[1]["blocks_per_seq"] == 2048  # 32768 / 16, every layer, the whole context
    assert rows[1]["kv_bytes_per_seq"] == 32768 * config.kv_bytes_per_token(2)
    assert rows[0]["kv_bytes_per_seq"] < 0.55 * rows[1]["kv_bytes_per_seq"]
    assert rows[0]["sequences"] > 1.8 * rows[1]["sequences"]
    weights = weight_bytes_per_device(config, 1, 2, "mxfp4")
    assert 12.7 < weights / 2**30 < 12.9
    assert weight_bytes_per_device(config, 1, 2) / 2**30 > 38


@pytest.mark.slow  # the Pallas interpreters: 30-60 s
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_the_pallas_kernels_serve_transformers_tokens(gpt_oss, model, backend):
    """The sinks and windows through the Triton and TPU kernels (interpreted) in the engine:
    chunked prefill, decode, and on the TPU a head dim of 16 padded to a 128-lane tile."""
    hf, _ = gpt_oss
    token_prompts = prompts()[:3]
    got, _ = engine_greedy(model, token_prompts, 6, attention_backend=backend,
                           attention_interpret=True,
                           **(dict(block_size=8) if backend == "gpu" else {}))
    assert got == hf_greedy(hf, token_prompts, 6)


def test_a_backend_without_sinks_is_refused_before_anything_is_built(model, monkeypatch):
    """The Mosaic GPU kernels have no sinks: refused by name (past their own checks, which on
    jax 0.10 refuse the backend itself)."""
    from pagedjax import EngineConfig, LLMEngine
    from pagedjax.pallas_kernels import dispatch
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "mosaic_gpu",
                        dispatch.IMPLEMENTATIONS["mosaic_gpu"]._replace(check_config=None))
    with pytest.raises(ValueError, match="attention sinks"):
        LLMEngine(model, EngineConfig(attention_backend="mosaic_gpu", max_model_len=64,
                                      num_blocks=16))
