"""Hugging Face config.json -> LlamaConfig: what every family's reader shares (the fields all
decoders have, RoPE in both config formats, EOS ids, the refusals), and config_from_hf, which
hands a config to its family's reader through pagedjax.models.registry (what the readers share
themselves is pagedjax.models.families.hf_fields)."""

from __future__ import annotations

from typing import Any

from pagedjax.models.config import ROPE_TYPES, LlamaConfig
from pagedjax.models.families.hf_fields import UnsupportedModelError  # noqa: F401
from pagedjax.models.families.hf_fields import architecture_of, refuse as family_refusal
from pagedjax.models.registry import ARCHITECTURES

# Why some well-known architectures are refused (others get the generic reason).
KNOWN_UNSUPPORTED = {
    "mamba": "state-space (Mamba) layers keep a recurrent state, not a paged KV cache",
    "mamba2": "state-space (Mamba) layers keep a recurrent state, not a paged KV cache",
    "jamba": "hybrid attention + Mamba layers",
    "zamba2": "hybrid attention + Mamba layers",
    "falcon_h1": "hybrid attention + Mamba layers",
    "qwen3_5": "the multimodal Qwen3.5 (vision tower); its text model, Qwen3_5ForCausalLM, is",
    "qwen3_5_moe": "the multimodal Qwen3.5-MoE (vision tower); its text model, "
                   "Qwen3_5MoeForCausalLM, is",
    "rwkv": "RWKV linear-attention recurrence",
    "bloom": "ALiBi position bias instead of RoPE",
    "mpt": "ALiBi position bias instead of RoPE",
    "falcon": "ALiBi or parallel attention blocks",
    "gemma": "Gemma 1 (GeGLU with (1 + weight) RMSNorm but no sandwich norms) is not wired",
    "gemma3": "the multimodal Gemma 3 (vision tower); its text model, Gemma3ForCausalLM, is",
    "phi3": "fused qkv/gate_up projections",
}


def supported_summary() -> str:
    return ", ".join(ARCHITECTURES)


def with_summary(error: UnsupportedModelError) -> UnsupportedModelError:
    """A family's refusal, naming what is supported."""
    return UnsupportedModelError(f"{error}; supported architectures: {supported_summary()} "
                                 f"(RoPE types {', '.join(ROPE_TYPES)})")


def refuse(architecture: str, what: str) -> UnsupportedModelError:
    return with_summary(family_refusal(architecture, what))


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def check_common(raw: dict[str, Any], architecture: str, model_type: str,
                 hidden_acts: tuple[str, ...]) -> None:
    """What no family reads: a model_type other than the architecture's, quantized weights, an
    activation the family does not have, a position encoding other than RoPE."""
    if raw.get("model_type", model_type) != model_type:
        raise refuse(architecture, f"model_type {raw.get('model_type')!r}")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        if method not in ("compressed-tensors", "mxfp4"):
            raise refuse(architecture, f"a quantized checkpoint ({method})")
        from pagedjax.models.loading import compressed_tensors, mxfp4_checkpoint
        try:
            (mxfp4_checkpoint if method == "mxfp4" else compressed_tensors).read(raw)
        except ValueError as e:
            raise refuse(architecture, f"a quantized checkpoint ({e})") from None
    field = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
    act = raw.get(field) or hidden_acts[0]
    if act not in hidden_acts:
        raise refuse(architecture, f"{field} {act!r} (this family's MLP: {', '.join(hidden_acts)})")
    if raw.get("alibi") or raw.get("position_embedding_type", "rope") != "rope":
        raise refuse(architecture, "a non-RoPE position encoding")


def common_fields(raw: dict[str, Any], generation_config: dict[str, Any] | None) -> dict:
    """The LlamaConfig fields every decoder's config.json gives."""
    eos = eos_ids(raw.get("eos_token_id"))
    for token_id in eos_ids((generation_config or {}).get("eos_token_id")):
        if token_id not in eos:
            eos += (token_id,)
    try:
        heads = raw["num_attention_heads"]
        return dict(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            # (a model of experts alone, Qwen3.5-MoE, declares only moe_intermediate_size)
            intermediate_size=raw.get("intermediate_size") or raw["moe_intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            initializer_range=raw.get("initializer_range", 0.02),
            bos_token_id=raw.get("bos_token_id"), eos_token_id=eos or None)
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None


SEQUENCE_CLASSIFIER = "ForSequenceClassification"
# reward models with a head of their own (vLLM's names) -> the causal family they build on
REWARD_MODELS = {"Qwen2ForRewardModel": "Qwen2ForCausalLM",
                 "Qwen2ForProcessRewardModel": "Qwen2ForCausalLM"}


def is_sequence_classifier(raw: dict[str, Any]) -> bool:
    """A transformers <X>ForSequenceClassification config.json (reward models, rerankers), or
    a reward model of REWARD_MODELS: a base model and a head, no language-model head."""
    architecture = architecture_of(raw)
    return architecture.endswith(SEQUENCE_CLASSIFIER) or architecture in REWARD_MODELS


def as_causal_lm(raw: dict[str, Any]) -> dict[str, Any]:
    """A sequence classifier's config.json (transformers' <X>ForSequenceClassification, or a
    REWARD_MODELS architecture: its base model and a `score` head, no language-model head) as
    its family's <X>ForCausalLM with tied embeddings (the vocabulary projection a pooling model
    never runs; the head is pagedjax.pooling.checkpoint_heads'); any other config as it is."""
    architecture = architecture_of(raw)
    causal = REWARD_MODELS.get(architecture,
                               architecture[:-len(SEQUENCE_CLASSIFIER)] + "ForCausalLM")
    if not is_sequence_classifier(raw) or causal not in ARCHITECTURES:
        return raw
    return {**raw, "architectures": [causal], "tie_word_embeddings": True}


def config_from_hf(raw: dict[str, Any],
                   generation_config: dict[str, Any] | None = None) -> LlamaConfig:
    """The LlamaConfig for a parsed config.json (its family's reader, models.registry), or
    UnsupportedModelError naming what is not supported."""
    raw = as_causal_lm(raw)
    architecture = architecture_of(raw)
    family = ARCHITECTURES.get(architecture)
    if family is None:
        reason = KNOWN_UNSUPPORTED.get(str(raw.get("model_type")),
                                       "not a model family implemented in models/")
        raise UnsupportedModelError(f"architecture {architecture} is not supported ({reason}); "
                                    f"supported architectures: {supported_summary()}")
    model_type = family.model_types[architecture]
    check_common(raw, architecture, model_type, family.hidden_acts)
    try:
        return family.read_config(raw, architecture, model_type,
                                  common_fields(raw, generation_config))
    except UnsupportedModelError as e:
        raise with_summary(e) from None
