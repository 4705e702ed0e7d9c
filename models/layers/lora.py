"""LoRA adapters in the serving step (issue 53): many adapters over one base model in one batch.

The engine holds S adapter slots. Each adapted projection of a layer has its slots' pairs
stacked, `a` [S, I, R] and `b` [S, R, O] (R = max_lora_rank: a smaller adapter's pair is zero
past its rank; the adapter's scaling is folded into `b`), and every token of a step names its
slot (-1: the base model alone). A projection y = x @ W then computes

    y[t] = x[t] @ W + (x[t] @ a[s]) @ b[s],   s = token_slots[t]   (nothing added when s < 0)

as shrink (x @ a, [T, R]) then expand (@ b, [T, O]), vLLM's Punica order, by the step's
implementation (pallas_kernels.lora: the masked jnp reference, or the grouped Pallas kernels of
TPU and GPU, chosen by the attention backend).

Axis letters: T tokens, I a projection's input, O its output, S slots, R max_lora_rank.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.pallas_kernels.dispatch import TP_AXIS
from pagedjax.pallas_kernels.lora import lora_delta

# The projections an adapter may adapt, by where they live in a decoder layer.
LORA_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
                "down_proj": "mlp"}


class LayerLoRA(NamedTuple):
    """One layer's adapter slots and the step's slot of each token, passed down the layer's
    forward_paged. pairs: projection name -> (a [S, I, R], b [S, R, O]); a projection
    without an entry is not adapted (a mixture-of-experts layer's MLP)."""

    token_slots: jax.Array  # i32[T]: each token's slot, -1 for the base model
    pairs: dict
    implementation: str = "masked"  # pallas_kernels.lora.LORA_IMPLEMENTATIONS
    interpret: bool = False  # a Pallas implementation through the interpreter
    # bool[]: whether any token of the step has an adapter (None: compute regardless); a
    # step of base-model tokens alone skips every delta
    active: jax.Array | None = None
    mesh: object = None  # the TP mesh the step is split over (row_parallel), or None

    def apply(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (= the base projection of x, [..., O]) plus each token's adapter's delta."""
        pair = self.pairs.get(name)
        if pair is None:
            return y

        def adapted():
            flat = x.reshape(-1, x.shape[-1])
            delta = lora_delta(flat, *pair, self.token_slots, self.implementation,
                               self.interpret)
            return y + delta.reshape(y.shape).astype(y.dtype)

        if self.active is None:
            return adapted()
        return jax.lax.cond(self.active, adapted, lambda: y)


def apply_lora(lora: LayerLoRA | None, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y with lora's delta for projection name added (y itself without adapters)."""
    return y if lora is None else lora.apply(name, x, y)


def row_parallel(linear, name: str, x: jax.Array, lora: LayerLoRA | None) -> jax.Array:
    """linear(x) for a row-parallel projection (o_proj, down_proj: x and the kernel split on
    I over the TP mesh), with lora's delta. Split over a mesh, each device adds its partial
    delta (its slice of a, all of b) to its partial product before the one all-reduce the
    base projection has anyway; elsewhere (one device, a quantized kernel) the plain sum."""
    if (lora is None or lora.mesh is None or name not in lora.pairs
            or type(linear) is not nnx.Linear):
        return apply_lora(lora, name, x, linear(x))
    a, b = lora.pairs[name]

    def partial(x, kernel, a, b, slots):  # one device's [T, O] part, summed over the mesh
        x, kernel = linear.promote_dtype((x, kernel), dtype=linear.dtype)
        y = linear.dot_general(x, kernel, (((1,), (0,)), ((), ())), precision=linear.precision)
        delta = lora_delta(x, a, b, slots, "masked")
        return jax.lax.psum(y + delta.astype(y.dtype), TP_AXIS)

    def adapted():
        flat = x.reshape(-1, x.shape[-1])
        y = jax.shard_map(partial, mesh=lora.mesh, in_specs=(
            P(None, TP_AXIS), P(TP_AXIS, None), P(None, TP_AXIS, None), P(None, None, None),
            P(None)), out_specs=P(None, None), check_vma=False)(
                flat, linear.kernel[...], a, b, lora.token_slots)
        if linear.bias is not None:
            y = y + linear.bias[...].astype(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    if lora.active is None:
        return adapted()
    return jax.lax.cond(lora.active, adapted, lambda: linear(x))


class StepLoRA(NamedTuple):
    """A step's adapters for every layer: the slots' pairs stacked over the layers, (a
    [L, S, I, R], b [L, S, R, O]) by projection name, and each token's slot."""

    token_slots: jax.Array  # i32[T]: -1 for the base model
    pairs: dict
    implementation: str = "masked"
    interpret: bool = False
    active: jax.Array | None = None  # LayerLoRA.active
    mesh: object = None

    def layer(self, index) -> LayerLoRA:
        """Layer index's (an int, or traced inside the layers' scan)."""
        return LayerLoRA(self.token_slots,
                         {name: (a[index], b[index]) for name, (a, b) in self.pairs.items()},
                         self.implementation, self.interpret, self.active, self.mesh)
