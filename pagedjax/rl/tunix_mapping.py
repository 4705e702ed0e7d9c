"""Tunix's Llama 3 and Qwen 3 models (`tunix.models.llama3.model.Llama3`,
`tunix.models.qwen3.model.Qwen3`) in pagedjax's terms: their config as a pagedjax LlamaConfig,
and their parameter state as a pagedjax nnx.State, by a mapping table as Tunix's own rollouts
use (`tunix/models/*/mapping_vllm_jax.py`). Nothing here imports Tunix: a state is read by its
paths.

Tunix keeps attention projections per head (q/k/v `w` [embed, heads, head_dim], o `w` [heads,
head_dim, embed]); pagedjax keeps them as Linear kernels [embed, heads * head_dim] and
[heads * head_dim, embed]: a reshape, no copy. Everything else is the same array under another
name.
"""

from __future__ import annotations

import re
from typing import Any

# Tunix's parameter path ("*": a layer index) -> (pagedjax's, how the array is laid out there)
TUNIX_TO_PAGEDJAX: dict[str, tuple[str, str]] = {
    "embedder.input_embedding": ("embed_tokens.embedding", "same"),
    "layers.*.attn.q_proj.w": ("layers.*.self_attn.q_proj.kernel", "heads_last"),
    "layers.*.attn.k_proj.w": ("layers.*.self_attn.k_proj.kernel", "heads_last"),
    "layers.*.attn.v_proj.w": ("layers.*.self_attn.v_proj.kernel", "heads_last"),
    "layers.*.attn.o_proj.w": ("layers.*.self_attn.o_proj.kernel", "heads_first"),
    "layers.*.attn.q_norm.w": ("layers.*.self_attn.q_norm.weight", "same"),
    "layers.*.attn.k_norm.w": ("layers.*.self_attn.k_norm.weight", "same"),
    "layers.*.mlp.gate_proj.kernel": ("layers.*.mlp.gate_proj.kernel", "same"),
    "layers.*.mlp.up_proj.kernel": ("layers.*.mlp.up_proj.kernel", "same"),
    "layers.*.mlp.down_proj.kernel": ("layers.*.mlp.down_proj.kernel", "same"),
    "layers.*.input_layernorm.w": ("layers.*.input_layernorm.weight", "same"),
    "layers.*.post_attention_layernorm.w": ("layers.*.post_attention_layernorm.weight", "same"),
    "final_norm.w": ("norm.weight", "same"),
    "lm_head.w": ("lm_head.kernel", "same"),
}
_PATTERNS = [(re.compile("^" + re.escape(key).replace(r"\*", r"(\d+)") + "$"), target, layout)
             for key, (target, layout) in TUNIX_TO_PAGEDJAX.items()]
FAMILIES = {"tunix.models.llama3.model": "llama", "tunix.models.qwen3.model": "qwen3"}
QWEN3_ROPE_THETA = 1_000_000.0


def family_of(model) -> str:
    """pagedjax's model_type for a Tunix model (ValueError naming what is not served)."""
    module = type(model).__module__
    if module not in FAMILIES:
        raise ValueError(f"PagedJaxRollout serves Tunix's Llama 3 and Qwen 3 models "
                         f"({', '.join(FAMILIES)}), got {module}.{type(model).__name__}")
    return FAMILIES[module]


def config_of(model):
    """The pagedjax LlamaConfig of a Tunix Llama 3 or Qwen 3 model (its `config`)."""
    from pagedjax.models.config import LlamaConfig

    family, tunix = family_of(model), model.config
    if getattr(tunix, "num_experts", None):
        raise ValueError("PagedJaxRollout: Tunix's Qwen 3 MoE models are not mapped yet "
                         "(num_experts set); serve a dense Qwen 3 or Llama 3")
    tied = tunix.weight_tying if family == "llama" else tunix.use_tied_embedding
    # Tunix's Qwen 3 rotates with its apply_rope's default theta, 1e6 (every Qwen 3's), whatever
    # its config's rope_theta says: the engine computes what the trainer's model computes
    # (tests/frontend/test_tunix_rollout.py holds it to Tunix's own outputs)
    theta = QWEN3_ROPE_THETA if family == "qwen3" else float(tunix.rope_theta)
    return LlamaConfig(
        vocab_size=tunix.vocab_size, hidden_size=tunix.embed_dim,
        intermediate_size=tunix.hidden_dim, num_layers=tunix.num_layers,
        num_heads=tunix.num_heads, num_kv_heads=tunix.num_kv_heads, head_dim=tunix.head_dim,
        rope_theta=theta, rms_norm_eps=tunix.norm_eps,
        tie_word_embeddings=bool(tied), qk_norm=family == "qwen3", model_type=family,
        max_position_embeddings=1 << 20)


def _laid_out(value, layout: str):
    if layout == "heads_last":  # [embed, heads, head_dim] -> [embed, heads * head_dim]
        return value.reshape(value.shape[0], -1)
    if layout == "heads_first":  # [heads, head_dim, embed] -> [heads * head_dim, embed]
        return value.reshape(-1, value.shape[-1])
    return value


def pagedjax_arrays(flat_tunix: dict[str, Any]) -> dict[tuple, Any]:
    """Tunix's arrays by dotted path -> pagedjax's model paths (ValueError naming a path the
    table does not know)."""
    out = {}
    for key, value in flat_tunix.items():
        for pattern, target, layout in _PATTERNS:
            match = pattern.match(key)
            if match:
                path = target.replace("*", match.group(1)) if match.groups() else target
                out[tuple(int(p) if p.isdigit() else p for p in path.split("."))] = (
                    _laid_out(value, layout))
                break
        else:
            raise ValueError(f"PagedJaxRollout: Tunix parameter {key!r} has no pagedjax "
                             f"counterpart (LoRA or another family's)")
    return out


def flat_paths(state) -> dict[str, Any]:
    """An nnx.State's arrays by dotted path."""
    from flax import nnx

    return {".".join(map(str, path)): variable.get_value()
            for path, variable in nnx.to_flat_state(state)}


def pagedjax_state(tunix_state, abstract_model):
    """Tunix's parameter state as the nnx.State of abstract_model (a pagedjax model of
    config_of's config, abstract), every parameter filled (ValueError naming one missing)."""
    from flax import nnx

    arrays = pagedjax_arrays(flat_paths(tunix_state))
    flat = nnx.to_flat_state(nnx.state(abstract_model, nnx.Param))
    for path, variable in flat:
        if path not in arrays:
            raise ValueError(f"PagedJaxRollout: the Tunix state has no value for pagedjax's "
                             f"{'.'.join(map(str, path))}")
        variable.set_value(arrays[path])
    return nnx.from_flat_state(flat)
