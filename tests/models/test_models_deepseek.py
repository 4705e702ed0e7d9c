"""DeepSeek-V2 and V3 (models/families/deepseek.py, models/layers/mla.py) against transformers on
small random configs with every switch on: V2 without a query bottleneck (q_proj) and greedy
routing, V2 with one (q_lora_rank), q/kv/o biases and group-limited routing, V3 with sigmoid
routing by groups, a learned correction bias drawn large enough to change the choice, shared
experts, renormalised weights scaled by routed_scaling_factor; all with YaRN and DeepSeek's mscale
(the softmax scale and the RoPE attention factor both away from 1), the first layer dense and
RoPE in interleaved pairs (V3 also without). The engine serves the absorbed form over a latent
cache of one plane."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import until_done  # noqa: E402
from test_models_hf import (F32_TOL, engine_greedy, hf_greedy, hf_logits, prompts,  # noqa: E402
                            randomize_vectors)

from pagedjax.models.loading.hf import load_hf_model, read_hf_config  # noqa: E402
from pagedjax.models.loading.inspect import inspect_model_dir  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
              kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
              max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 8.0,
                               "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.6},
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
VARIANTS = {
    "v2": dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=1),
    # one group of two kept: both experts from the group of the best (a limit that bites at
    # k = 2, which two groups kept of four would not)
    "v2_q_lora": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                      topk_group=1, n_shared_experts=2, attention_bias=True,
                      routed_scaling_factor=1.5),
    "v3": dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1,
               norm_topk_prob=True, routed_scaling_factor=2.5),
}


def build_deepseek(directory, variant: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    v3 = variant.startswith("v3")
    config_class = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    config = config_class(**{**COMMON, **VARIANTS[variant.split("-")[0]], **overrides})
    config._attn_implementation = "eager"
    model_class = transformers.DeepseekV3ForCausalLM if v3 else transformers.DeepseekV2ForCausalLM
    model = model_class(config).eval()
    randomize_vectors(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.copy_(torch.randn_like(param))  # spread, not near ties
            elif "experts" in name:
                param.copy_(0.3 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # comparable to the sigmoid scores
                buffer.copy_(0.5 * torch.randn_like(buffer))
    model.save_pretrained(directory)
    return model


# The V2 variants in make test-slow (make test's time), V3 (a query bottleneck, groups, the
# correction bias) here
@pytest.fixture(scope="module", params=[pytest.param("v2", marks=pytest.mark.slow),
                                        pytest.param("v2_q_lora", marks=pytest.mark.slow),
                                        "v3"])
def deepseek(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, build_deepseek(directory, request.param), str(directory)


def test_config_is_read_whole(deepseek):
    variant, hf, directory = deepseek
    config = read_hf_config(directory)
    assert config.kv_lora_rank == 32 and config.num_kv_heads == 1 and config.head_dim == 20
    assert config.mlp_types == ("dense", "sparse", "sparse") and config.rope_interleave
    assert config.q_lora_rank == VARIANTS[variant]["q_lora_rank"]
    assert config.topk_method == ("noaux_tc" if variant == "v3"
                                  else VARIANTS[variant]["topk_method"])
    buffers = sum(b.numel() for n, b in hf.named_buffers() if "correction" in n)
    assert config.num_params == sum(p.numel() for p in hf.parameters()) + buffers
    # the cache: the latent and the RoPE key a token a layer, one plane
    assert config.kv_bytes_per_token(2) == 3 * (32 + 8) * 2
    report = inspect_model_dir(directory)
    assert report["kv_bytes_per_token"] == 3 * (32 + 8) * 2  # its default KV dtype: bfloat16


def test_dense_logits_match_transformers(deepseek):
    _, hf, directory = deepseek
    ids = np.random.default_rng(0).integers(0, 128, (2, 40))
    ours = np.asarray(load_hf_model(directory)(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


@pytest.mark.slow  # 4 s: make test-slow
def test_v3_rope_without_interleaving(tmp_path):
    hf = build_deepseek(tmp_path, "v3", rope_interleave=False)
    assert not read_hf_config(str(tmp_path)).rope_interleave
    ids = np.random.default_rng(1).integers(0, 128, (1, 24))
    ours = np.asarray(load_hf_model(str(tmp_path))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


def test_the_routers_switches_bite(deepseek):
    """The group limit (and V3's correction bias) change which experts some tokens take: a
    router that ignored them would pick otherwise (so the token tests can see it)."""
    import jax

    from pagedjax.models.layers.grouped_routing import grouped_route
    variant, hf, directory = deepseek
    if variant == "v2":
        pytest.skip("greedy routing: no groups, no bias")
    config = read_hf_config(directory)
    model = load_hf_model(directory)
    x = jax.random.normal(jax.random.key(0), (256, 64))
    moe = model.layers[1].mlp
    plain = jax.lax.top_k(moe.router_logits(x), 2)[1]
    bias = moe.e_score_correction_bias
    _, experts = grouped_route(moe.router_logits(x), 2, moe.routing,
                               None if bias is None else bias[...])
    changed = np.any(np.sort(np.asarray(plain), -1) != np.sort(np.asarray(experts), -1), -1)
    assert config.n_group == 4 and changed.mean() > 0.1


MAX_TOKENS = 10


def test_engine_greedy_equals_transformers_generate(deepseek):
    """Five prompts of 1 to 43 tokens (two sharing a 20-token prefix: a prefix hit) through the
    absorbed latent attention on a one-plane cache, chunked prefill over 16-token budgets."""
    _, hf, directory = deepseek
    token_prompts = prompts()
    got, engine = engine_greedy(load_hf_model(directory), token_prompts, MAX_TOKENS)
    assert got == hf_greedy(hf, token_prompts, MAX_TOKENS)
    assert engine.stats.num_prefix_hit_tokens > 0
    cache = engine.runner.kv_cache
    assert cache.shape == (1, 1, 3 * engine.num_blocks, 16, 32 + 8)
    assert engine.bytes_per_block == 3 * 16 * (32 + 8) * 4


@pytest.mark.slow  # 10 s: make test-slow
def test_preemption_speculation_and_samples(tmp_path):
    """V3 with preemption in a small pool, speculative decoding with the model its own draft, and n = 3 seeded samples sharing the prompt's blocks, each equal to its
    seed alone."""
    from pagedjax import LLM, SamplingParams
    hf = build_deepseek(tmp_path, "v3")
    model = load_hf_model(str(tmp_path))
    token_prompts = prompts()
    got, engine = engine_greedy(model, token_prompts, MAX_TOKENS, block_size=4, num_blocks=20)
    assert got == hf_greedy(hf, token_prompts, MAX_TOKENS)
    assert engine.scheduler.state.num_preemptions > 0
    # the model its own draft: every greedy draft is accepted, verified (and drafted) through
    # latent caches
    from pagedjax import EngineConfig, LLMEngine
    spec = dict(method="draft_model", model="draft", num_speculative_tokens=3)
    engine = LLMEngine(model, EngineConfig(max_model_len=128, block_size=16, num_blocks=48,
                                           max_num_batched_tokens=32, speculative_config=spec),
                       draft_model=model)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = [engine.add_request(p, greedy) for p in token_prompts[:3]]
    done = {o.request_id: o for _ in until_done(engine) for o in engine.step() if o.finished}
    assert [done[i].output_token_ids for i in outputs] == hf_greedy(hf, token_prompts[:3],
                                                                   MAX_TOKENS)
    assert engine.stats.num_spec_accepted_tokens > 0
    llm = LLM(model, block_size=4, max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=16, num_blocks=96)
    sample = lambda seed, n=1: SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5,  # noqa
                                              seed=seed, n=n)
    [together] = llm.generate([token_prompts[1]], sample(7, n=3), use_tqdm=False)
    alone = [llm.generate([token_prompts[1]], sample(7 + i), use_tqdm=False)[0]
             for i in range(3)]
    assert [o.token_ids for o in together.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(a.outputs[0].token_ids) for a in alone}) == 3, "seeds were meant to differ"


@pytest.mark.slow  # the TPU interpreter: 20-40 s
def test_the_tpu_kernels_serve_transformers_tokens(tmp_path):
    """V3 through the interpreted TPU kernels in the engine: the latent written by the TPU
    write kernel into one plane padded to 128 lanes (40 -> 128), chunked prefill and decode
    reading it whole as the value, the latent's columns kept."""
    hf = build_deepseek(tmp_path, "v3")
    token_prompts = prompts()[:3]
    got, engine = engine_greedy(load_hf_model(str(tmp_path)), token_prompts, 6,
                                attention_backend="tpu", attention_interpret=True)
    assert got == hf_greedy(hf, token_prompts, 6)
    assert engine.runner.kv_cache.shape[0] == 1 and engine.runner.kv_cache.shape[-1] == 128


@pytest.mark.slow  # 7 s: make test-slow (the kernels against the oracle are in make test)
def test_the_gpu_kernels_serve_transformers_tokens(tmp_path):
    """V3 with a RoPE key of 16 (the Triton tiles' least) through the interpreted Triton
    kernels in the engine: the latent written unpadded (32 + 16 = 48, not 64) by the Triton
    write, chunked prefill and decode reading its two parts as two tiles."""
    hf = build_deepseek(tmp_path, "v3", qk_rope_head_dim=16)
    token_prompts = prompts()[:3]
    got, engine = engine_greedy(load_hf_model(str(tmp_path)), token_prompts, 6,
                                attention_backend="gpu", attention_interpret=True)
    assert got == hf_greedy(hf, token_prompts, 6)
    assert engine.runner.kv_cache.shape[0] == 1 and engine.runner.kv_cache.shape[-1] == 48


@pytest.mark.slow  # 10 s: make test-slow (tests/models/test_mla_expanded.py has the layer in make test)
@pytest.mark.parametrize("budget", [16, 64])
def test_the_expanded_prefill_serves_transformers_tokens(tmp_path, budget):
    """--mla-prefill expanded through the engine: fresh first chunks in the expanded form,
    the chunks after them (context in the cache) and decode in the absorbed one; a budget of
    64 takes the prompts whole."""
    hf = build_deepseek(tmp_path, "v3")
    token_prompts = prompts()[:3]
    got, _ = engine_greedy(load_hf_model(str(tmp_path)), token_prompts, 6,
                           mla_prefill="expanded", max_num_batched_tokens=budget)
    assert got == hf_greedy(hf, token_prompts, 6)


@pytest.mark.slow  # make test-slow
@pytest.mark.parametrize("scheme", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_quantized_latent_projections_serve_their_dequantized_tokens(tmp_path, scheme):
    """--quantization on DeepSeek quantizes the latent attention's projections too (q_a, q_b,
    kv_a, kv_b: stored int8 / fp8 with their scales), kv_b_proj read as a weight by the
    absorbed form and dequantized there: the same greedy tokens as the float engine over the
    same weights dequantized in NumPy."""
    from test_quantization import dequantized_reference

    from pagedjax.models.layers.quantized import quantize_model
    build_deepseek(tmp_path, "v3")
    model = load_hf_model(str(tmp_path))
    token_prompts = prompts()[:3]
    got, engine = engine_greedy(model, token_prompts, 6, quantization=scheme)
    attention = engine.runner.params.layers[-1]["self_attn"]  # (layer groups: a tuple)
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        assert attention[name]["kernel"].get_value().dtype != jnp.float32, name
    reference = dequantized_reference(model, quantize_model(model, scheme))
    assert got == engine_greedy(reference, token_prompts, 6)[0]


def test_what_latent_attention_cannot_take_is_refused_by_name(tmp_path, caplog):
    """The Mosaic GPU backend (no latent kernels), the Triton one on dims its tiles cannot take
    (a RoPE key of 8) and LoRA adapters are refused before anything is built; under 'auto' the
    reference serves what the platform's kernels cannot, and says so."""
    from pagedjax import EngineConfig, LLMEngine
    from pagedjax.models import init_model
    from pagedjax.pallas_kernels import AttentionBackend, resolve_backend
    from pagedjax.parallel.placement import model_backend
    config = read_hf_config(_config_only(tmp_path))
    model = init_model(config)
    with pytest.raises(ValueError, match="multi-head latent attention"):  # jax 0.10 or 0.11
        model_backend(config, SimpleNamespace(attention_backend="mosaic_gpu", enable_lora=False),
                      AttentionBackend("mosaic_gpu"))
    for fields, match in ((dict(attention_backend="gpu", attention_interpret=True),
                           "qk_rope_head_dim 8 is not a power of two >= 16"),
                          (dict(enable_lora=True), "LoRA adapters on multi-head latent")):
        with pytest.raises(ValueError, match=match):
            LLMEngine(model, EngineConfig(max_model_len=64, num_blocks=16, **fields))
    auto = EngineConfig(max_model_len=64, num_blocks=16)
    with caplog.at_level("INFO", logger="pagedjax.engine"):
        assert model_backend(config, auto, resolve_backend("gpu")).name == "reference"
    assert "qk_rope_head_dim 8" in caplog.text
    config = read_hf_config(_config_only(tmp_path, qk_rope_head_dim=16))
    assert model_backend(config, auto, resolve_backend("gpu")).name == "gpu"


def _config_only(directory, **overrides) -> str:
    config = transformers.DeepseekV3Config(**{**COMMON, **VARIANTS["v3"], **overrides},
                                           architectures=["DeepseekV3ForCausalLM"])
    config.save_pretrained(directory)
    return str(directory)


def test_the_compressed_kv_splits_latent_first_then_rope(deepseek):
    """kv_a_proj_with_mqa's output is [latent (kv_lora_rank), rope part (qk_rope_head_dim)], as
    transformers splits it: with the rope part's columns zero, k_pe is zero and the latent is
    not; with the latent's zero, the latent is (a direct check: the paged and dense paths share
    the split, so a wrong one passes every comparison between them)."""
    _, _, directory = deepseek
    model = load_hf_model(directory)
    attention = model.layers[0].self_attn
    kernel = np.asarray(attention.kv_a_proj_with_mqa.kernel[...])
    latent_dim = kernel.shape[1] - 8  # qk_rope_head_dim 8
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, kernel.shape[0])), jnp.float32)
    proj = attention.kv_a_proj_with_mqa
    bias = None if proj.bias is None else np.asarray(proj.bias[...])
    for zeroed in ("rope", "latent"):
        part = slice(latent_dim, None) if zeroed == "rope" else slice(0, latent_dim)
        cut = kernel.copy()
        cut[:, part] = 0
        proj.kernel[...] = jnp.asarray(cut)
        if bias is not None:  # q/kv/o biases (v2_q_lora)
            cut_bias = bias.copy()
            cut_bias[part] = 0
            proj.bias[...] = jnp.asarray(cut_bias)
        _, _, latent, k_pe = attention._project(x, jnp.arange(5))
        assert (np.abs(np.asarray(k_pe)).max() == 0) == (zeroed == "rope")
        assert (np.abs(np.asarray(latent)).max() == 0) == (zeroed == "latent")
