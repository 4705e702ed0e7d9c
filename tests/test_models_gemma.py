"""Gemma 2 and Gemma 3 (text) against transformers, on small random configs with every switch
on: soft-capping (attention and final, Gemma 2) at caps the random logits reach, an attention
scale from query_pre_attn_scalar unlike head_dim's, windows shorter than the prompts, Gemma 3's
q/k norms, local RoPE base and scaled global RoPE, a layer pattern with sliding and global
layers. Norm weights are randomised around 0 (Gemma applies 1 + weight), so a norm applied as
plain weight, or left out, shows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.hf import load_hf_model, read_hf_config  # noqa: E402
from models.registry import ARCHITECTURES  # noqa: E402
from test_models_hf import F32_TOL, engine_greedy, hf_logits, prompts  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, initializer_range=0.1,
              max_position_embeddings=256, query_pre_attn_scalar=24, sliding_window=6)
ARCHS = {
    # Gemma 2: alternating sliding / global layers, both soft caps low enough to bite.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=4, attn_logit_softcapping=3.0,
                    final_logit_softcapping=2.0)),
    # Gemma 3: two sliding layers per global one (and a trailing sliding one), local RoPE base
    # 10,000 and a linearly scaled global base.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention",
                                                      "full_attention", "sliding_attention"],
                    rope_parameters={
                        "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                           "factor": 4.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def build_gemma(arch: str, directory, seed: int = 0):
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gemma_config_is_read_whole(arch, tmp_path):
    hf = build_gemma(arch, tmp_path)
    config = read_hf_config(str(tmp_path))
    assert config.num_params == sum(p.numel() for p in hf.parameters())
    assert config.model_type == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[arch]
    assert (config.norm_unit_offset, config.scale_embeddings, config.sandwich_norms) == (
        True, True, True)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.attention_scale == 24 ** -0.5
    if arch == "gemma2":
        assert config.layer_types == ("sliding_attention", "full_attention") * 2
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (3.0, 2.0)
        assert not config.qk_norm and config.layer_rope(0) == config.layer_rope(1)
    else:
        assert config.qk_norm and config.layer_window(2) is None and config.layer_window(3) == 6
        assert config.layer_rope(0) == (1e4, None) and config.layer_rope(2)[0] == 1e6
        assert config.layer_rope(2)[1].factor == 4.0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gemma_dense_logits_match_transformers(arch, tmp_path):
    hf = build_gemma(arch, tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, (2, 40))  # 40 tokens, window 6
    ours = np.asarray(load_hf_model(str(tmp_path))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gemma_paged_engine_greedy_equals_transformers_generate(arch, tmp_path):
    """Prompts of 1 to 40 tokens against a 6-token window, a 16-token budget (chunked prefill),
    two prompts sharing a 20-token prefix (a prefix-cache hit), through the serving form."""
    hf = build_gemma(arch, tmp_path)
    token_prompts = prompts()
    max_tokens = 10
    expected = []
    for p in token_prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                              do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    got, engine = engine_greedy(load_hf_model(str(tmp_path)), token_prompts, max_tokens)
    assert got == expected
    assert engine.stats.num_prefix_hit_tokens >= 16


def test_registry_lists_the_gemma_architectures():
    assert ARCHITECTURES["Gemma2ForCausalLM"].name == "gemma"
    assert ARCHITECTURES["Gemma3ForCausalLM"].name == "gemma"
    assert ARCHITECTURES["LlamaForCausalLM"].name == "llama"
