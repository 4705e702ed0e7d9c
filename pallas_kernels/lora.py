"""LoRA's shrink and expand for a step's tokens (issue 53): every token adds (x @ a[s]) @ b[s] of
its adapter slot s (-1: none). The jnp references and the grouped Pallas kernels behind one entry,
chosen by implementation (per platform: LORA_IMPLEMENTATIONS by backend name).

- "masked" (reference, the CPU's): every slot's shrink at once as one [T, I] x [I, S * R]
  product, each token's own R columns kept, then one [T, S * R] x [S * R, O] expand. Exact (a
  masked column adds 0); two plain matmuls while S * R is small next to O.
- "gather" (reference): each token's pair gathered ([T, I, R], [T, R, O]), a product per
  token: the same sums another way, what the others are held to.
- "tpu" (pallas_kernels/tpu/lora.py) and "gpu" (pallas_kernels/gpu/triton/lora.py): the tokens
  sorted by slot, each slot's run of rows through its own pair (SGMV): a slot's pair is read
  once a tile, an empty slot costs nothing, base tokens nothing.

Axis letters: T tokens, I a projection's input, O its output, S slots, R max_lora_rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LORA_IMPLEMENTATIONS = ("masked", "gather", "tpu", "gpu")
# the attention backend (pallas_kernels.dispatch) -> the LoRA implementation its step runs
FOR_BACKEND = {"reference": "masked", "tpu": "tpu", "gpu": "gpu", "mosaic_gpu": "gpu"}


def lora_implementation(backend) -> str:
    """The implementation a step on backend (pallas_kernels.AttentionBackend) runs: its
    platform's kernel on one device; over a mesh the masked form, which XLA splits as the
    slots are split (a Pallas call is not partitioned)."""
    return "masked" if backend.mesh is not None else FOR_BACKEND.get(backend.name, "masked")


def lora_delta(x: jax.Array,  # [T, I]
               a: jax.Array,  # [S, I, R]
               b: jax.Array,  # [S, R, O]
               token_slots: jax.Array,  # i32[T], -1: none
               implementation: str = "masked", interpret: bool = False) -> jax.Array:
    """f32[T, O]: (x[t] @ a[s]) @ b[s] for each token t of slot s >= 0, 0 for the others,
    accumulated in f32. interpret: a Pallas implementation through the interpreter."""
    if implementation not in LORA_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {LORA_IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if implementation == "tpu":
        from pagedjax.pallas_kernels.tpu.lora import lora_delta_tpu
        return lora_delta_tpu(x, a, b, token_slots, interpret=interpret)
    if implementation == "gpu":
        from pagedjax.pallas_kernels.gpu.triton.lora import gpu_shapes_fit, lora_delta_gpu
        if gpu_shapes_fit(a.shape[1], b.shape[2], a.shape[2]):
            return lora_delta_gpu(x, a, b, token_slots, interpret=interpret)
        # shapes Triton's dots cannot tile (a rank under 16, features off 64): the reference
    if implementation == "gather":
        return _gathered(x, a, b, token_slots)
    return _masked(x, a, b, token_slots)


def _gathered(x, a, b, token_slots):
    slots = jnp.maximum(token_slots, 0)
    shrunk = jnp.einsum("TI,TIR->TR", x, a[slots].astype(x.dtype),
                        preferred_element_type=jnp.float32)
    out = jnp.einsum("TR,TRO->TO", shrunk, b[slots].astype(jnp.float32))
    return jnp.where((token_slots >= 0)[:, None], out, 0.0)


def _masked(x, a, b, token_slots):
    num_slots, _, rank = a.shape
    wide_a = jnp.moveaxis(a, 0, 1).reshape(a.shape[1], num_slots * rank)  # [I, S * R]
    shrunk = jnp.einsum("TI,IX->TX", x, wide_a.astype(x.dtype),
                        preferred_element_type=jnp.float32)
    mine = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank == token_slots[:, None]
    shrunk = jnp.where(mine, shrunk, 0.0)  # selected: another slot's NaN never passes
    wide_b = b.reshape(num_slots * rank, b.shape[2]).astype(jnp.float32)  # [S * R, O]
    # A token's other slots' columns are 0, and 0 * inf is NaN: a non-finite value in one slot
    # must not reach the tokens of another (the loads refuse them; this holds regardless)
    wide_b = jnp.where(jnp.isfinite(wide_b), wide_b, 0.0)
    out = jnp.einsum("TX,XO->TO", shrunk, wide_b)
    return jnp.where((token_slots >= 0)[:, None], out, 0.0)
