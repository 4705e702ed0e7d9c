"""LoRA adapters in the serving step (issue 53): many adapters over one base model in one batch.

The engine holds S adapter slots. Each adapted projection of a layer has its slots' pairs
stacked, `a` [S, I, R] and `b` [S, R, O] (R = max_lora_rank: a smaller adapter's pair is zero
past its rank; the adapter's scaling is folded into `b`), and every token of a step names its
slot (-1: the base model alone). A projection y = x @ W then computes

    y[t] = x[t] @ W + (x[t] @ a[s]) @ b[s],   s = token_slots[t]   (nothing added when s < 0)

as shrink (x @ a, [T, R]) then expand (@ b, [T, O]), vLLM's Punica order. Implementations:

- "masked" (the jnp reference): every slot's shrink at once as one [T, I] x [I, S * R]
  product, each token's own R columns kept (the others masked to 0), then one
  [T, S * R] x [S * R, O] expand. Exact (a masked column adds 0) and two plain matmuls that
  every backend runs well while S * R is small next to the projection's O.
- "gather": each token's pair gathered ([T, I, R] and [T, R, O]), a batched product per token.
  The same sums another way: the independent check the masked form is held to.

Axis letters: T tokens, I a projection's input, O its output, S slots, R max_lora_rank.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# The projections an adapter may adapt, by where they live in a decoder layer.
LORA_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
                "down_proj": "mlp"}
LORA_IMPLEMENTATIONS = ("masked", "gather")


class LayerLoRA(NamedTuple):
    """One layer's adapter slots and the step's slot of each token, passed down the layer's
    forward_paged. pairs: projection name -> (a [S, I, R], b [S, R, O]); a projection
    without an entry is not adapted (a mixture-of-experts layer's MLP)."""

    token_slots: jax.Array  # i32[T]: each token's slot, -1 for the base model
    pairs: dict
    implementation: str = "masked"

    def apply(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (= the base projection of x, [..., O]) plus each token's adapter's delta."""
        pair = self.pairs.get(name)
        if pair is None:
            return y
        flat = x.reshape(-1, x.shape[-1])
        delta = lora_delta(flat, *pair, self.token_slots, self.implementation)
        return y + delta.reshape(y.shape).astype(y.dtype)


def lora_delta(x: jax.Array,  # [T, I]
               a: jax.Array,  # [S, I, R]
               b: jax.Array,  # [S, R, O]
               token_slots: jax.Array,  # i32[T], -1: none
               implementation: str = "masked") -> jax.Array:  # f32[T, O]
    """(x[t] @ a[s]) @ b[s] for each token t of slot s >= 0, 0 for the others, accumulated
    in f32 (the shrink's [T, R] kept in f32 between the two products)."""
    if implementation not in LORA_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {LORA_IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    num_slots, _, rank = a.shape
    if implementation == "gather":
        slots = jnp.maximum(token_slots, 0)
        shrunk = jnp.einsum("TI,TIR->TR", x, a[slots].astype(x.dtype),
                            preferred_element_type=jnp.float32)
        out = jnp.einsum("TR,TRO->TO", shrunk, b[slots].astype(jnp.float32))
        return jnp.where((token_slots >= 0)[:, None], out, 0.0)
    wide_a = jnp.moveaxis(a, 0, 1).reshape(a.shape[1], num_slots * rank)  # [I, S * R]
    shrunk = jnp.einsum("TI,IX->TX", x, wide_a.astype(x.dtype),
                        preferred_element_type=jnp.float32)
    mine = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank == token_slots[:, None]
    shrunk = jnp.where(mine, shrunk, 0.0)  # a base token (-1) keeps no column
    wide_b = b.reshape(num_slots * rank, b.shape[2])  # [S * R, O]
    return jnp.einsum("TX,XO->TO", shrunk, wide_b.astype(jnp.float32))


def apply_lora(lora: LayerLoRA | None, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y with lora's delta for projection name added (y itself without adapters)."""
    return y if lora is None else lora.apply(name, x, y)


class StepLoRA(NamedTuple):
    """A step's adapters for every layer: the slots' pairs stacked over the layers, (a
    [L, S, I, R], b [L, S, R, O]) by projection name, and each token's slot."""

    token_slots: jax.Array  # i32[T]: -1 for the base model
    pairs: dict

    def layer(self, index) -> LayerLoRA:
        """Layer index's (an int, or traced inside the layers' scan)."""
        return LayerLoRA(self.token_slots,
                         {name: (a[index], b[index]) for name, (a, b) in self.pairs.items()})
