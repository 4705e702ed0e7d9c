"""Model configuration: one frozen dataclass for every family (the named configs: named_configs)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pagedjax.models import config_checks, param_count

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # pagedjax.models.layers.basic.ACTIVATIONS
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
MLP_TYPES = ("sparse", "dense")  # a layer's MLP: experts (models/layers/moe.py) or one dense MLP
EXPERT_LAYOUTS = ("split", "interleaved")
# DeepSeek's routers (models/layers/grouped_routing.py): V2's softmax greedy or group-limited,
# V3's sigmoid with a correction bias
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")  # gate/up/down per expert, or gpt-oss's fused form


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `linear` divides positions by factor; `llama3` (Llama 3.1) keeps
    high frequencies, divides low ones by factor and interpolates smoothly between the two bands,
    which are set by low/high_freq_factor relative to original_max_position_embeddings. `yarn`
    (gpt-oss, DeepSeek): the dims that turn fewer than beta_slow times over the original context
    divided by factor, those turning more than beta_fast times kept, a linear ramp between
    (its ends rounded out when truncate), and cos/sin times attention_factor (None: 0.1 ln(factor)
    + 1, or DeepSeek's ratio of that with mscale and mscale_all_dim)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)
                and self.factor > 0):
            raise ValueError(f"rope factor must be a finite number > 0, got {self.factor!r}")
        if self.rope_type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"yarn rope needs beta_fast ({self.beta_fast}) > beta_slow "
                             f"({self.beta_slow}) > 0")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"llama3 rope needs high_freq_factor ({self.high_freq_factor}) > "
                             f"low_freq_factor ({self.low_freq_factor})")



@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K; N == K is MHA, K == 1 is MQA, otherwise GQA
    # H; None (the default) is hidden_size // num_heads, set at construction: an int after it
    head_dim: int = None  # type: ignore[assignment]
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # one id or several (any of them stops)
    sliding_window: int | None = None  # Mistral-style: a token sees the last sliding_window
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama's attention_bias sets o too)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    model_type: str = "llama"  # the family member the weights came from (models.registry)
    # Gemma 2 / 3 (models/families/gemma.py); the defaults are Llama's.
    hidden_act: str = "silu"  # the gated MLP's activation (HIDDEN_ACTS)
    norm_unit_offset: bool = False  # RMSNorm weights applied as (1 + weight)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # norms after attention and around the MLP too
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5 (else head_dim's)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Per layer: "sliding_attention" layers see sliding_window tokens, "full_attention" all;
    # None: sliding_window (if any) applies to every layer.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3)
    # Mixture of experts (models/layers/moe.py); num_experts 0: every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 2  # k: the experts a token's router picks
    moe_intermediate_size: int | None = None  # an expert's MLP dim (None: intermediate_size)
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an MLP every token takes, gated
    # Per layer: "sparse" (experts) or "dense" (intermediate_size MLP); None: all sparse.
    mlp_types: tuple[str, ...] | None = None
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection, not a head (OLMoE)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] (OLMoE)
    # Qwen3.5 / Qwen3-Next (models/families/qwen3_5.py): RoPE on the first
    # head_dim * partial_rotary_factor dims, the attention output gated by sigmoid(x @ W_gate)
    # (q_proj twice as wide), and "linear_attention" layers (Gated DeltaNet,
    # models/layers/gated_deltanet.py) of these shapes.
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_fused_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba layout
    # gpt-oss (models/families/gpt_oss.py): a learned sink logit a head in every softmax, a
    # router bias, experts "interleaved" (gate_up_proj with gate and up column by column, biases,
    # the clamped SwiGLU of swiglu_alpha / swiglu_limit: models/layers/moe.InterleavedExperts).
    attention_sinks: bool = False
    router_bias: bool = False
    expert_layout: str = "split"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V2 / V3 (models/families/deepseek.py): multi-head latent attention when
    # kv_lora_rank > 0 (models/layers/mla.py): K and V of a token compressed into one latent of
    # kv_lora_rank values plus a shared RoPE key of qk_rope_head_dim, what the cache holds (one
    # "KV head", num_kv_heads 1); the query through a q_lora_rank bottleneck when set; per head
    # qk_nope_head_dim + qk_rope_head_dim query/key dims (head_dim) and v_head_dim value dims.
    # rope_interleave: the RoPE dims in interleaved pairs (DeepSeek's checkpoints).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek's routers (models/layers/grouped_routing.py): None is the softmax top-k of the
    # other families; "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3, with a learned
    # e_score_correction_bias) with n_group / topk_group and routed_scaling_factor.
    topk_method: str | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True  # Qwen2-MoE's shared expert is gated; DeepSeek's is not

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an integer >= 1, "
                             f"got {self.sliding_window!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be None or a RopeScaling, "
                             f"got {type(self.rope_scaling).__name__}")
        if isinstance(self.eos_token_id, (list, tuple)):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check_family_fields()
        ids = [("bos_token_id", self.bos_token_id)] + [("eos_token_id", i)
                                                       for i in self.eos_token_ids]
        for name, value in ids:
            if value is not None and (not isinstance(value, int)
                                      or not 0 <= value < self.vocab_size):
                raise ValueError(f"{name} must be in [0, vocab_size={self.vocab_size}), "
                                 f"got {value!r}")

    def _check_family_fields(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0
                                          and math.isfinite(value)):
                raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
        self._check_moe_fields()
        if self.kv_lora_rank:
            config_checks.check_mla_fields(self)
        if self.layer_types is None:
            return
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(
                LAYER_TYPES):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the "
                             f"{self.num_layers} layers, got {self.layer_types!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_attention layers need a sliding_window")
        if "linear_attention" in self.layer_types:
            config_checks.check_linear_fields(self)

    def _check_moe_fields(self) -> None:
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, "
                             f"got {self.expert_layout!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"num_experts must be an integer >= 0, got {self.num_experts!r}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv must be None or > 0, got {self.clip_qkv!r}")
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole needs qk_norm")
        if not self.num_experts:
            if (self.mlp_types is not None or self.shared_expert_intermediate_size
                    or self.topk_method is not None):
                raise ValueError("mlp_types, shared_expert_intermediate_size and topk_method "
                                 "need experts (num_experts > 0)")
            return
        k = self.num_experts_per_tok
        if not isinstance(k, int) or not 1 <= k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be an integer in [1, num_experts="
                             f"{self.num_experts}], got {k!r}")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0
                                      or (value == 0 and name == "moe_intermediate_size")):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.topk_method is not None:
            config_checks.check_grouped_routing(self)
        if self.mlp_types is not None:
            object.__setattr__(self, "mlp_types", tuple(self.mlp_types))
            if len(self.mlp_types) != self.num_layers or not set(self.mlp_types) <= set(
                    MLP_TYPES):
                raise ValueError(f"mlp_types must name one of {MLP_TYPES} for each of the "
                                 f"{self.num_layers} layers, got {self.mlp_types!r}")

    def layer_is_linear(self, layer: int) -> bool:
        """Whether a layer is linear attention (a Gated DeltaNet: a fixed-size state, no KV)."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def num_attention_layers(self) -> int:
        """The layers that keep KV (every layer but the linear-attention ones)."""
        return self.num_layers - sum(map(self.layer_is_linear, range(self.num_layers)))

    @property
    def rotary_dim(self) -> int:
        """The head dims RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """The channels of a linear-attention layer's causal conv1d: q, k and v."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def linear_state_values(self) -> int:
        """The values one sequence's state holds in one linear-attention layer: the recurrent
        matrix (value heads x key dim x value dim) and the conv window's last kernel - 1
        inputs."""
        return (self.linear_num_value_heads * self.linear_key_head_dim
                * self.linear_value_head_dim
                + (self.linear_conv_kernel_dim - 1) * self.linear_conv_dim)

    def layer_is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts."""
        return bool(self.num_experts) and (self.mlp_types is None
                                           or self.mlp_types[layer] == "sparse")

    @property
    def num_sparse_layers(self) -> int:
        """The layers whose MLP is a mixture of experts."""
        return sum(map(self.layer_is_moe, range(self.num_layers)))

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def layer_window(self, layer: int) -> int | None:
        """The attention window of a layer (None: the whole context)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None  # full (or linear: no window, no KV)

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of a layer: sliding layers take rope_local_theta when set."""
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def shared_window(self) -> int | None:
        """The window every layer has (the KV blocks before it can be freed); None when any
        layer sees the whole context."""
        if self.layer_types is not None and "full_attention" in self.layer_types:
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """head_dim ** -0.5 (or query_pre_attn_scalar's); multi-head latent attention under
        YaRN with mscale_all_dim: times mscale(factor, mscale_all_dim) ** 2, DeepSeek's."""
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        scaling = self.rope_scaling
        if (self.kv_lora_rank and scaling is not None and scaling.rope_type == "yarn"
                and scaling.mscale_all_dim and scaling.factor > 1):
            mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
            scale *= mscale * mscale
        return scale

    @property
    def attended_dims(self) -> tuple[int, int]:
        """(dims a query head dots with a key, dims of the value it sums) as served: head_dim
        twice, or latent attention's absorbed (kv_lora_rank + qk_rope_head_dim, kv_lora_rank)."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
        return self.head_dim, self.head_dim

    @property
    def kv_planes(self) -> int:
        """The cache's planes: K and V (2), or the latent alone (1: V is its first
        kv_lora_rank values; pallas_kernels.layout)."""
        return 1 if self.kv_lora_rank else 2

    @property
    def kv_head_dim(self) -> int:
        """The values a token's cache row holds a KV head: head_dim, or the latent and its
        RoPE key (kv_lora_rank + qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, tuple):
            return self.eos_token_id
        return (self.eos_token_id,)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LlamaConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown LlamaConfig field(s) {unknown}")
        data = dict(data)
        if isinstance(data.get("rope_scaling"), dict):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV-cache bytes of one token across the attention layers: 2 * L * K * H * itemsize,
        L * (kv_lora_rank + qk_rope_head_dim) * itemsize for latent attention (linear-attention
        layers keep a fixed state instead: state_bytes_per_sequence)."""
        return (self.kv_planes * self.num_attention_layers * self.num_kv_heads
                * self.kv_head_dim * itemsize)

    def state_bytes_per_sequence(self, itemsize: int) -> int:
        """The fixed state of one sequence across the linear-attention layers (0 without)."""
        linear = self.num_layers - self.num_attention_layers
        return linear * self.linear_state_values() * itemsize

    @property
    def num_params(self) -> int:
        """Every parameter (all experts)."""
        return param_count.num_params(self, self.num_experts)

    @property
    def num_active_params(self) -> int:
        """The parameters one token's forward reads: its k experts, not all (the roofline's
        FLOPs a token)."""
        return param_count.num_params(self, self.num_experts_per_tok)
