"""DeepSeek-V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): the Llama decoder with
multi-head latent attention (models/layers/mla.py: a latent of kv_lora_rank values and a shared
RoPE key a token, one plane of the paged cache), the query through a q_lora_rank bottleneck when
set, RoPE on qk_rope_head_dim dims in interleaved pairs (V3: `rope_interleave`), YaRN with
DeepSeek's mscale, and mixtures of experts with DeepSeek's routers
(models/layers/grouped_routing.py: V2 softmax `greedy` / `group_limited_greedy`, V3 sigmoid
`noaux_tc` with a learned correction bias), ungated shared experts
(moe_intermediate_size x n_shared_experts) and the first `first_k_dense_replace` layers dense.

The checkpoints name the shared experts `mlp.shared_experts` and the correction bias
`mlp.gate.e_score_correction_bias`: DEEPSEEK_NAMES maps the generic names to them. A V3
checkpoint's multi-token-prediction layers (`num_nextn_predict_layers`, stored past the last
layer) are not read, as transformers does not."""

from __future__ import annotations

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.hf_fields import refuse, rope_from_params, rope_params

DEEPSEEK_NAMES = ((".mlp.shared_expert.", ".mlp.shared_experts."),
                  (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))
SCORING = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    theta, scaling = rope_from_params(rope_params(raw), architecture)
    v3 = model_type == "deepseek_v3"
    topk_method = "noaux_tc" if v3 else raw.get("topk_method", "greedy")
    if topk_method not in SCORING:
        raise refuse(architecture, f"topk_method {topk_method!r}")
    scoring = raw.get("scoring_func", SCORING[topk_method])
    if scoring != SCORING[topk_method]:
        raise refuse(architecture, f"scoring_func {scoring!r} with topk_method {topk_method!r}")
    num_experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
    if num_experts < 1:
        raise ValueError(f"{architecture} needs n_routed_experts >= 1, got {num_experts}")
    nope, rope_dim = int(raw.get("qk_nope_head_dim", 128)), int(raw.get("qk_rope_head_dim", 64))
    moe = int(raw.get("moe_intermediate_size") or 0)
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    every = int(raw.get("moe_layer_freq") or 1)  # (DeepSeek's code; transformers: 1)
    num_layers = common["num_layers"]
    mlp_types = tuple("sparse" if i >= first_dense and i % every == 0 else "dense"
                      for i in range(num_layers))
    if "sparse" not in mlp_types:
        raise ValueError(f"{architecture} with no sparse layer (first_k_dense_replace "
                         f"{first_dense} of {num_layers} layers)")
    bias = bool(raw.get("attention_bias", False))
    q_lora = raw.get("q_lora_rank")
    return LlamaConfig(
        **{**common, "num_kv_heads": 1, "head_dim": nope + rope_dim},
        rope_theta=theta, rope_scaling=scaling, attention_bias=bias, o_proj_bias=bias,
        mlp_bias=bool(raw.get("mlp_bias", False)), model_type=model_type,
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
        q_lora_rank=None if q_lora is None else int(q_lora),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        v_head_dim=int(raw.get("v_head_dim", 128)),
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
        num_experts=num_experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 6),
        moe_intermediate_size=moe or None,
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        shared_expert_intermediate_size=moe * int(raw.get("n_shared_experts") or 0),
        shared_expert_gate=False, mlp_types=mlp_types if "dense" in mlp_types else None,
        topk_method=topk_method, n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
