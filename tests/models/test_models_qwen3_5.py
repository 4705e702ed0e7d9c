"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (models/families/qwen3_5.py, models/layers/gated_deltanet.py)
against transformers on small random configs with every switch on: three Gated DeltaNet layers
before each full-attention one, grouped value heads (4 value heads over 2 key heads, Dk != Dv),
the gated attention output, partial RoPE, q/k norm, experts with a gated shared expert and a
dense layer (Qwen3-Next's mlp_only_layers), Qwen3-Next's fused interleaved projections. Prompts
longer than the chunked rule's 64-token chunk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_models_hf import F32_TOL, hf_logits, randomize_vectors  # noqa: E402

from pagedjax.models.loading.hf import load_hf_model, read_hf_config  # noqa: E402
from pagedjax.models.loading.hf_config import UnsupportedModelError, config_from_hf  # noqa: E402
from pagedjax.models.loading.inspect import inspect_model_dir  # noqa: E402
from pagedjax.models.registry import ARCHITECTURES  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=8, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
              linear_num_value_heads=4, initializer_range=0.1, max_position_embeddings=512,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.25})
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
ARCHS = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=96)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(MOE, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False)),
}


def build(arch: str, directory, seed: int = 0, **overrides):
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    randomize_vectors(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # routers: spread, not near ties
                param.copy_(torch.randn_like(param))
            if name.endswith("norm.weight") and "linear_attn" not in name:
                param.sub_(1.0)  # applied as (1 + weight): scales around 1, not 2
            if name.endswith("embed_tokens.weight"):  # a residual stream of rms ~1: the
                param.copy_(torch.randn_like(param))  # norms then do not amplify rounding
            if name.endswith("A_log"):  # decays from slow to fast: exp(A) in [0.05, 2]
                param.copy_(torch.linspace(-3.0, 0.7, param.shape[0]))
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_config_is_read_whole(arch, tmp_path):
    hf = build(arch, tmp_path)
    config = read_hf_config(str(tmp_path))
    assert ARCHITECTURES[ARCHS[arch][1]].name == "qwen3_5"
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",) * 3 + ("full_attention",)
    assert config.rotary_dim == 4 and config.attn_output_gate and config.norm_unit_offset
    assert config.num_params == sum(p.numel() for p in hf.parameters())
    assert config.linear_fused_projections == (arch == "qwen3_next")
    if arch == "qwen3_next":
        assert config.mlp_types[1] == "dense" and not config.norm_topk_prob
    # KV for the 2 full layers only; the state: 6 layers x (4 x 8 x 12 + 3 x (2*2*8 + 4*12))
    assert config.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4
    assert config.state_bytes_per_sequence(4) == 6 * (4 * 8 * 12 + 3 * 80) * 4
    report = inspect_model_dir(str(tmp_path), kv_dtype="float32")
    assert report["architecture"] == ARCHS[arch][1]
    assert report["kv_bytes_per_token"] == config.kv_bytes_per_token(4)
    assert (report["linear_attention_layers"], report["state_bytes_per_sequence"]) == (
        6, config.state_bytes_per_sequence(4))


# the mixtures' logits: make test-slow (the dense one's here)
MIXTURES_SLOW = [pytest.param(a, marks=() if a == "qwen3_5" else pytest.mark.slow)
                 for a in sorted(ARCHS)]


@pytest.mark.parametrize("arch", MIXTURES_SLOW)
def test_dense_logits_match_transformers(arch, tmp_path):
    hf = build(arch, tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, (2, 70))  # past one 64-token chunk
    ours = np.asarray(load_hf_model(str(tmp_path))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


def test_the_multimodal_model_is_refused_by_name():
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    with pytest.raises(UnsupportedModelError, match="vision tower.*Qwen3_5ForCausalLM"):
        config_from_hf(raw)


def test_capacity_counts_the_attention_kv_a_token_and_the_state_a_sequence(capsys):
    """qwen3.5-9b (24 linear and 8 full layers, 4 KV heads of 256, bf16, block 16): a block is
    a page of each of a group's 8 layers, 2 * 8 * 16 * 4 * 256 * 2 B; a sequence's state is
    24 x (32 x 128 x 128 + 3 x 8192) values, 17 pages of 32,768 in each of the 3 linear groups;
    a 4096-token sequence holds 256 + 51 blocks, against 256 blocks four times as wide with
    every layer keeping KV."""
    from pagedjax.tools.cli import main as cli_main

    cli_main(["capacity", "--model", "qwen3.5-9b", "--kv-memory-gib", "16", "--context",
              "4096"])
    out = capsys.readouterr().out
    assert "bytes per token      32,768" in out  # 8 attention layers of 4 x 256, bf16
    assert f"state per sequence   {24 * (32 * 128 * 128 + 3 * 8192) * 2:,}" in out
    assert "4 groups of 8 layers (full, linear-attention state, 17 blocks a sequence)" in out
    assert "KV cache groups: bytes per block      524,288" in out
    assert "KV cache groups: a 4096-token sequence  307 blocks" in out
    assert f"KV cache groups: sequences of 4096 tokens  {32767 // 307}" in out
    assert "every layer full: sequences of 4096 tokens  31 " in out  # 8191 // 256


def test_linear_layer_fields_are_checked_and_a_model_of_linear_layers_alone_refused():
    import dataclasses

    from pagedjax.models import get_config
    from pagedjax.models.layers.kv_groups import kv_cache_groups
    config = get_config("qwen3.5-9b")
    for field, value, words in (("linear_num_key_heads", 0, "linear_num_key_heads must be"),
                                ("linear_conv_kernel_dim", 2.5, "linear_conv_kernel_dim must"),
                                ("linear_num_value_heads", 24, "divisible by")):
        with pytest.raises(ValueError, match=words):
            dataclasses.replace(config, **{field: value})
    linear_only = dataclasses.replace(config, layer_types=("linear_attention",) * 32)
    with pytest.raises(ValueError, match="beside attention layers"):
        kv_cache_groups(linear_only)
    groups = kv_cache_groups(config)
    assert groups.windows == (None, "linear_attention", "linear_attention", "linear_attention")
    assert groups.num_slots == 8 and groups.layer_group[:4] == (1, 1, 1, 0)
