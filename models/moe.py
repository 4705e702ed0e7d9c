"""Mixture-of-experts MLP layers: a softmax top-k router and dropless experts (Mixtral,
Qwen2-MoE with its gated shared expert, Qwen3-MoE, OLMoE; models/registry.py).

Routing, as transformers computes it: router logits x @ W_gate in f32, softmax in f32, the k
largest probabilities and their experts (ties to the lower expert id, as torch.topk and
lax.top_k), renormalised to sum to 1 when norm_topk_prob. Experts, without a capacity (no token
dropped): the T x k (token, expert) assignments sorted by expert, each expert's run of rows
through its gated MLP, then each row scaled by its routing weight and summed back into its
token. Rows past num_valid (a BatchPlan's padding tokens) route to no expert: they sort last,
outside every group, and cost nothing.

The grouped matmul, by implementation (benchmarks/moe_experts.py measures them):
- "segments": each expert's run cut into tiles of a fixed number of rows, one loop over the
  tiles that exist (at most A / tile + E) running the whole gated MLP of the tile's expert:
  an expert's weights are read once a tile, an expert with no token costs nothing. The CPU's
  and GPU's choice: XLA lowers `ragged_dot` there to every expert on every row.
- "ragged_dot": `lax.ragged_dot`, TPU's native ragged matmul (Mosaic's grouped matmul).
- "dense": every expert on every token, mixed by the routing weights: the reference.

Axis letters: T tokens, D model dim, E experts, F an expert's MLP dim, A = T x k assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LlamaConfig
from models.layers import ACTIVATIONS, MLP, linear


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

EXPERT_IMPLEMENTATIONS = ("segments", "ragged_dot", "dense")


def default_implementation() -> str:
    """The grouped matmul for the platform the step compiles for."""
    return "ragged_dot" if jax.default_backend() == "tpu" else "segments"


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows a tile of the segments loop: about twice an expert's mean share of the rows, a
    power of two in [8, 64] (measured on the CPU: fewer tiles once the groups are full, little
    padding while they are small)."""
    share = 2 * num_assignments // max(num_experts, 1)
    return int(min(64, max(8, 1 << max(share - 1, 0).bit_length())))


def route(router_logits: jax.Array, top_k: int,
          norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights f32[T, k], experts i32[T, k]) from f32[T, E] router logits."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class Experts(nnx.Module):
    """E gated MLPs stacked: gate_proj, up_proj [E, D, F] and down_proj [E, F, D] ([in, out]
    per expert, as nnx.Linear's kernels)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        e, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
        init = nnx.initializers.normal(config.initializer_range)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), param_dtype))
        self.hidden_act = config.hidden_act
        self.dtype = dtype

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array,
                 num_valid: jax.Array | None = None,
                 implementation: str | None = None) -> jax.Array:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for each token t < num_valid
        (every token when None); 0 for the others. [T, D] -> [T, D]. implementation:
        EXPERT_IMPLEMENTATIONS (None: the platform's, default_implementation)."""
        implementation = implementation or default_implementation()
        if implementation not in EXPERT_IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {EXPERT_IMPLEMENTATIONS}, "
                             f"got {implementation!r}")
        if implementation == "dense":
            return self._dense(x, weights, experts, num_valid)
        num_tokens, top_k = experts.shape
        num_experts = self.gate_proj.shape[0]
        flat = experts.reshape(-1)  # [A]
        if num_valid is not None:  # padding tokens: the sentinel expert E, after every group
            valid = jnp.arange(num_tokens * top_k) // top_k < num_valid
            flat = jnp.where(valid, flat, num_experts)
        order = jnp.argsort(flat, stable=True)
        tokens = order // top_k
        group_sizes = jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=0)
        rows = x[tokens].astype(self.dtype)  # [A, D] sorted by expert
        if implementation == "ragged_dot":
            out = self._ragged(rows, group_sizes)
        else:
            out = self._segments(rows, group_sizes)
        scale = weights.reshape(-1)[order]
        if num_valid is not None:
            scale = jnp.where(flat[order] < num_experts, scale, 0.0)
        summed = jnp.zeros((num_tokens, x.shape[-1]), jnp.float32).at[tokens].add(
            out * scale[:, None])
        return summed.astype(x.dtype)

    def _mlp(self, rows, expert, matmul):
        act = ACTIVATIONS[self.hidden_act]
        hidden = act(matmul(rows, self.gate_proj, expert)) * matmul(rows, self.up_proj, expert)
        return matmul(hidden, self.down_proj, expert).astype(jnp.float32)

    def _ragged(self, rows, group_sizes):
        def grouped(lhs, kernel, _):
            return jax.lax.ragged_dot(lhs, kernel[...].astype(self.dtype), group_sizes,
                                      preferred_element_type=jnp.float32).astype(self.dtype)

        return self._mlp(rows, None, grouped)

    def _segments(self, rows, group_sizes):
        """f32[A, D]: rows (sorted by expert, group_sizes[e] of expert e, then rows of no
        expert) through their experts, tile by tile."""
        num_rows, dim = rows.shape
        num_experts = group_sizes.shape[0]
        tile = tile_rows(num_rows, num_experts)
        tiles = (group_sizes + tile - 1) // tile  # each expert's
        last_tile = jnp.cumsum(tiles)
        starts = jnp.cumsum(group_sizes) - group_sizes
        index = jnp.arange(_cdiv(num_rows, tile) + num_experts)
        tile_expert = jnp.minimum(jnp.searchsorted(last_tile, index, side="right"),
                                  num_experts - 1)
        tile_start = starts[tile_expert] + (index - (last_tile - tiles)[tile_expert]) * tile
        tile_end = starts[tile_expert] + group_sizes[tile_expert]
        padded = jnp.concatenate([rows, jnp.zeros((tile, dim), rows.dtype)])

        def matmul(lhs, kernel, expert):
            return jnp.dot(lhs, kernel[expert].astype(self.dtype),
                           preferred_element_type=jnp.float32).astype(self.dtype)

        def body(i, out):
            start, expert = tile_start[i], tile_expert[i]
            y = self._mlp(jax.lax.dynamic_slice_in_dim(padded, start, tile), expert, matmul)
            y = jnp.where((start + jnp.arange(tile) < tile_end[i])[:, None], y, 0.0)
            return jax.lax.dynamic_update_slice_in_dim(
                out, jax.lax.dynamic_slice_in_dim(out, start, tile) + y, start, 0)

        out = jnp.zeros((num_rows + tile, dim), jnp.float32)
        return jax.lax.fori_loop(0, last_tile[-1], body, out)[:num_rows]

    def _dense(self, x, weights, experts, num_valid):
        """Every expert on every token, mixed by the routing weights: the reference."""
        num_experts = self.gate_proj.shape[0]
        xs = x.astype(self.dtype)
        gate = jnp.einsum("td,edf->etf", xs, self.gate_proj[...].astype(self.dtype))
        up = jnp.einsum("td,edf->etf", xs, self.up_proj[...].astype(self.dtype))
        out = jnp.einsum("etf,efd->etd", ACTIVATIONS[self.hidden_act](gate) * up,
                         self.down_proj[...].astype(self.dtype)).astype(jnp.float32)
        mix = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)
                      * weights[..., None], axis=1)  # [T, E]
        if num_valid is not None:
            mix = jnp.where(jnp.arange(x.shape[0])[:, None] < num_valid, mix, 0.0)
        return jnp.einsum("te,etd->td", mix, out).astype(x.dtype)


class SparseMoE(nnx.Module):
    """The MLP of a mixture-of-experts layer: router (`gate`, D -> E, no bias), experts, and
    Qwen2-MoE's shared expert (an MLP every token takes, scaled by sigmoid(x @ W_shared_gate))
    when config.shared_expert_intermediate_size."""

    # EXPERT_IMPLEMENTATIONS, or None: the platform's when traced (default_implementation)
    implementation: str | None = None

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d = config.hidden_size
        self.gate = linear(d, config.num_experts, config, rngs, dtype, param_dtype)
        self.experts = Experts(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        shared = config.shared_expert_intermediate_size
        self.shared_expert = (MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                  intermediate_size=shared) if shared else None)
        self.shared_expert_gate = (linear(d, 1, config, rngs, dtype, param_dtype)
                                   if shared else None)

    def router_logits(self, x: jax.Array) -> jax.Array:
        """f32[..., E]: x @ W_gate accumulated in f32."""
        kernel = self.gate.kernel[...]
        return jnp.einsum("...d,de->...e", x, kernel.astype(x.dtype),
                          preferred_element_type=jnp.float32)

    def __call__(self, x: jax.Array, num_valid: jax.Array | None = None) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = route(self.router_logits(flat), self.top_k, self.norm_topk_prob)
        out = self.experts(flat, weights, experts, num_valid, self.implementation)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(flat).astype(jnp.float32))
            out = out + (gate * self.shared_expert(flat).astype(jnp.float32)).astype(out.dtype)
        return out.reshape(shape)
