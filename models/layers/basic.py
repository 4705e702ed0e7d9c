"""Layers the model families share: RMSNorm, rotary embeddings, linear projections and the gated
MLP. A family's module (models/families/llama.py, models/families/gemma.py) builds its decoder layer from these and
models/layers/attention.py."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import LlamaConfig, RopeScaling
from pagedjax.models.layers.lora import row_parallel

# config.json hidden_act -> the function (gelu_pytorch_tanh: GELU's tanh approximation, Gemma's)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class RMSNorm(nnx.Module):
    """RMSNorm computed in f32. unit_offset: the weight is stored as an offset from 1 and applied
    as (1 + weight) (Gemma's), initialised to 0."""

    def __init__(self, dim: int, eps: float, *, param_dtype, unit_offset: bool = False):
        init = jnp.zeros if unit_offset else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight = self.weight[...].astype(jnp.float32)
        return (normed * (1.0 + weight if self.unit_offset else weight)).astype(x.dtype)


def rms_norm(config: LlamaConfig, dim: int, param_dtype) -> RMSNorm:
    """The family's RMSNorm of dim features."""
    return RMSNorm(dim, config.rms_norm_eps, param_dtype=param_dtype,
                   unit_offset=config.norm_unit_offset)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: RopeScaling | None = None) -> np.ndarray:
    """f32[H/2] rotary frequencies, with linear or Llama-3.1 scaling (computed in float64 on the
    host: a constant of the traced step)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # llama3: wavelengths above original_len / low_freq_factor are divided by factor, those below
    # original_len / high_freq_factor kept, and the band between interpolated linearly in 1/freq.
    original = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor,
                      np.where(wavelen < original / scaling.high_freq_factor, inv_freq,
                               interpolated))
    return scaled.astype(np.float32)


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, theta: float,
                   scaling: RopeScaling) -> np.ndarray:
    """YaRN (transformers' _compute_yarn_parameters): per frequency a mix of the original
    (extrapolated) and the divided-by-factor (interpolated) one, by a linear ramp over the dims
    between the ones that turn beta_fast and beta_slow times in the original context."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float64)
    mixed = inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation
    return mixed.astype(np.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other scaling)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor,
                                                               scaling.mscale_all_dim)
    return mscale(scaling.factor)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding, rotate-half convention (as Hugging Face Llama). x: [..., L, heads, H]."""
    inv_freq = jnp.asarray(rope_inv_freq(x.shape[-1], theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., L, H/2]
    factor = rope_attention_factor(scaling)
    cos = (jnp.cos(angles) * factor)[..., None, :]
    sin = (jnp.sin(angles) * factor)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def linear(din: int, dout: int, config: LlamaConfig, rngs: nnx.Rngs, dtype, param_dtype,
           use_bias: bool = False) -> nnx.Linear:
    init = nnx.initializers.normal(config.initializer_range)
    return nnx.Linear(din, dout, use_bias=use_bias, kernel_init=init, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)


class MLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (Llama) or GeGLU (Gemma), by config.hidden_act."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype,
                 intermediate_size: int | None = None):
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        bias = config.mlp_bias
        self.gate_proj = linear(d, f, config, rngs, dtype, param_dtype, bias)
        self.up_proj = linear(d, f, config, rngs, dtype, param_dtype, bias)
        self.down_proj = linear(f, d, config, rngs, dtype, param_dtype, bias)
        self.hidden_act = config.hidden_act

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:
        """lora: a LayerLoRA (models/layers/lora.py) adapting the projections, or None."""
        if lora is None:
            return self.down_proj(ACTIVATIONS[self.hidden_act](self.gate_proj(x))
                                  * self.up_proj(x))
        gate = lora.apply("gate_proj", x, self.gate_proj(x))
        hidden = ACTIVATIONS[self.hidden_act](gate) * lora.apply("up_proj", x, self.up_proj(x))
        return row_parallel(self.down_proj, "down_proj", hidden, lora)
