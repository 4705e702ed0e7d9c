"""Named model configs: tiny seeded models built in code (tests, the CPU demo) and real shapes
with random weights (capacity planning, shape-accurate benchmarks)."""

from __future__ import annotations

from pagedjax.models.config import LlamaConfig, RopeScaling

CONFIGS: dict[str, LlamaConfig] = {
    # Tiny seeded models built in code: tests and the CPU demo.
    "debug-tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                              initializer_range=0.1, eos_token_id=None),
    "demo-small": LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                              num_layers=4, num_heads=8, num_kv_heads=2,
                              max_position_embeddings=4096, initializer_range=0.05,
                              tie_word_embeddings=True, eos_token_id=None),
    # Real shapes, for capacity planning and shape-accurate benchmarks (random weights).
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3,
                                rope_theta=100000.0, tie_word_embeddings=True,
                                max_position_embeddings=8192),
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                rope_theta=500000.0, tie_word_embeddings=True,
                                max_position_embeddings=131072),
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8,
                              rope_theta=500000.0, max_position_embeddings=8192),
    "llama-3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8,
                               rope_theta=500000.0, max_position_embeddings=8192),
}


def _gemma(num_layers: int, period: int, **fields) -> LlamaConfig:
    """A Gemma config of real shapes: every period-th layer global, the others sliding."""
    types = tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention"
                  for i in range(num_layers))
    return LlamaConfig(num_layers=num_layers, layer_types=types, hidden_act="gelu_pytorch_tanh",
                       norm_unit_offset=True, scale_embeddings=True, sandwich_norms=True,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, **fields)


CONFIGS.update({
    # Gemma 2 / 3 text models (models/families/gemma.py): real shapes, random weights.
    "gemma-2-2b": _gemma(26, 2, vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                         num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=4096,
                         query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                         final_logit_softcapping=30.0, max_position_embeddings=8192,
                         model_type="gemma2"),
    "gemma-3-1b": _gemma(26, 6, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                         num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512,
                         query_pre_attn_scalar=256, rope_theta=1e6, rope_local_theta=1e4,
                         qk_norm=True, max_position_embeddings=32768,
                         model_type="gemma3_text"),
    "gemma-3-4b": _gemma(34, 6, vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                         num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=1024,
                         query_pre_attn_scalar=256, rope_theta=1e6, rope_local_theta=1e4,
                         rope_scaling=RopeScaling("linear", 8.0), qk_norm=True,
                         max_position_embeddings=131072, model_type="gemma3_text"),
    "gemma-3-27b": _gemma(62, 6, vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                          num_heads=32, num_kv_heads=16, head_dim=128, sliding_window=1024,
                          query_pre_attn_scalar=168, rope_theta=1e6, rope_local_theta=1e4,
                          rope_scaling=RopeScaling("linear", 8.0), qk_norm=True,
                          max_position_embeddings=131072, model_type="gemma3_text"),
})


CONFIGS.update({
    # Mixtures of experts (models/layers/moe.py): real shapes, random weights.
    "mixtral-8x7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=1e6,
                                max_position_embeddings=32768, num_experts=8,
                                num_experts_per_tok=2, model_type="mixtral"),
    "qwen3-30b-a3b": LlamaConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                 rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True,
                                 max_position_embeddings=40960, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=768,
                                 model_type="qwen3_moe"),
    "olmoe-1b-7b": LlamaConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                               num_layers=16, num_heads=16, num_kv_heads=16, qk_norm=True,
                               qk_norm_whole=True, max_position_embeddings=4096,
                               num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                               model_type="olmoe"),
})


def get_config(name: str) -> LlamaConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(CONFIGS)}")
    return CONFIGS[name]


def _qwen3_5(num_layers: int, **fields) -> LlamaConfig:
    """A Qwen3.5 / Qwen3-Next config of real shapes: three Gated DeltaNet layers before each
    full-attention one (models/families/qwen3_5.py)."""
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                  for i in range(num_layers))
    return LlamaConfig(num_layers=num_layers, layer_types=types, head_dim=256,
                       partial_rotary_factor=0.25, attn_output_gate=True, qk_norm=True,
                       norm_unit_offset=True, rms_norm_eps=1e-6, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, **fields)


CONFIGS.update({
    # transformers' Qwen3_5TextConfig defaults (its docstring: "Qwen3.5-9B style")
    "qwen3.5-9b": _qwen3_5(32, vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                           num_heads=16, num_kv_heads=4, rope_theta=1e7,
                           max_position_embeddings=262144, model_type="qwen3_5_text"),
    "qwen3-next-80b-a3b": _qwen3_5(
        48, vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_heads=16,
        num_kv_heads=2, rope_theta=1e7, max_position_embeddings=262144, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        linear_fused_projections=True, model_type="qwen3_next"),
})


def _gpt_oss(num_layers: int, num_experts: int) -> LlamaConfig:
    """gpt-oss (models/families/gpt_oss.py): its published config.json, random weights."""
    types = tuple("sliding_attention" if (i + 1) % 2 else "full_attention"
                  for i in range(num_layers))
    yarn = RopeScaling("yarn", 32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                       beta_slow=1.0, truncate=False)
    return LlamaConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=num_layers,
        num_heads=64, num_kv_heads=8, head_dim=64, rope_theta=150000.0, rope_scaling=yarn,
        max_position_embeddings=131072, sliding_window=128, layer_types=types,
        attention_bias=True, o_proj_bias=True, attention_sinks=True, num_experts=num_experts,
        num_experts_per_tok=4, router_bias=True, expert_layout="interleaved",
        model_type="gpt_oss")


CONFIGS.update({"gpt-oss-20b": _gpt_oss(24, 32), "gpt-oss-120b": _gpt_oss(36, 128)})


def _deepseek(first_dense: int, num_layers: int, **fields) -> LlamaConfig:
    """DeepSeek (models/families/deepseek.py): its published config.json, random weights; a
    latent of 512 and a RoPE key of 64 a token, YaRN over an original 4096 context."""
    mscale = fields.pop("mscale")
    yarn = RopeScaling("yarn", 40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                       beta_slow=1.0, mscale=mscale, mscale_all_dim=mscale)
    return LlamaConfig(
        num_layers=num_layers, num_kv_heads=1, head_dim=192, rope_scaling=yarn,
        max_position_embeddings=163840, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, shared_expert_gate=False,
        mlp_types=("dense",) * first_dense + ("sparse",) * (num_layers - first_dense),
        **fields)


CONFIGS.update({
    "deepseek-v2-lite": _deepseek(
        1, 27, vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_heads=16,
        num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        shared_expert_intermediate_size=2 * 1408, norm_topk_prob=False, topk_method="greedy",
        mscale=0.707, rms_norm_eps=1e-6, model_type="deepseek_v2"),
    "deepseek-v3": _deepseek(
        3, 61, vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_heads=128,
        q_lora_rank=1536, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        shared_expert_intermediate_size=2048, norm_topk_prob=True, topk_method="noaux_tc",
        n_group=8, topk_group=4, routed_scaling_factor=2.5, mscale=1.0, rms_norm_eps=1e-6,
        model_type="deepseek_v3"),
})
