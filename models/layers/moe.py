"""Mixture-of-experts MLP layers: a softmax top-k router and dropless experts (Mixtral,
Qwen2-MoE with its gated shared expert, Qwen3-MoE, OLMoE; models/registry.py).

Routing, as transformers computes it: router logits x @ W_gate in f32, softmax in f32, the k
largest probabilities and their experts (ties to the lower expert id, as torch.topk and
lax.top_k), renormalised to sum to 1 when norm_topk_prob. Experts, without a capacity (no token
dropped): the T x k (token, expert) assignments sorted by expert, each expert's run of rows
through its gated MLP, then each row scaled by its routing weight and summed back into its
token. Rows past num_valid (a BatchPlan's padding tokens) route to no expert: they sort last,
outside every group, and cost nothing.

The grouped matmul: models/layers/moe_experts.py.

Axis letters: T tokens, D model dim, E experts, F an expert's MLP dim, A = T x k assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.layers.basic import ACTIVATIONS, MLP, linear
from pagedjax.models.layers.grouped_routing import GroupedRouting, grouped_route
from pagedjax.models.layers.moe_experts import dropless_experts, sharded_experts


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

    # the stacked kernels, in kernels() order
    PROJECTIONS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        e, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
        init = nnx.initializers.normal(config.initializer_range)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), param_dtype))
        self.hidden_act = config.hidden_act
        self.dtype = dtype

    def kernels(self) -> tuple:
        """(gate_proj, up_proj, down_proj): arrays, or (a quantized model's) QArrays."""
        return (self.gate_proj[...], self.up_proj[...], self.down_proj[...])

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array,
                 num_valid: jax.Array | None = None, implementation: str | None = None,
                 mesh: jax.sharding.Mesh | None = None,
                 expert_parallel: bool = False) -> jax.Array:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for each token t < num_valid
        (every token when None); 0 for the others. [T, D] -> [T, D]. implementation:
        pagedjax.models.layers.moe_experts.EXPERT_IMPLEMENTATIONS (None: the platform's). mesh: the experts
        split over its TP axis, whole experts a device when expert_parallel, else each
        expert's MLP (moe_experts.sharded_experts)."""
        act = ACTIVATIONS[self.hidden_act]
        return self._run(x, weights, experts, num_valid, implementation, mesh, expert_parallel,
                         glu=lambda gate, up: act(gate) * up)

    def _run(self, x, weights, experts, num_valid, implementation, mesh, expert_parallel,
             **run):
        run.update(dtype=self.dtype, implementation=implementation)
        if mesh is not None:
            return sharded_experts(x, weights, experts, num_valid, self.kernels(), mesh,
                                   expert_parallel, **run)
        return dropless_experts(x, weights, experts, num_valid, self.kernels(), **run)


class InterleavedExperts(Experts):
    """gpt-oss's experts: gate_up_proj [E, D, 2F] (gate and up interleaved column by column)
    and down_proj [E, F, D], each with a bias ([E, 2F], [E, D]), and the clamped SwiGLU: gate
    clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""

    PROJECTIONS: tuple[str, ...] = ("gate_up_proj", "down_proj")

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        e, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
        init = nnx.initializers.normal(config.initializer_range)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, d, 2 * f), param_dtype))
        self.gate_up_proj_bias = nnx.Param(init(rngs.params(), (e, 2 * f), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), param_dtype))
        self.down_proj_bias = nnx.Param(init(rngs.params(), (e, d), param_dtype))
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.dtype = dtype

    def kernels(self) -> tuple:
        return (self.gate_up_proj[...], self.down_proj[...])

    def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)

    def __call__(self, x, weights, experts, num_valid=None, implementation=None, mesh=None,
                 expert_parallel=False):
        out = self._run(x, weights, experts, num_valid, implementation, mesh, expert_parallel,
                        glu=self.glu, gate_up_bias=self.gate_up_proj_bias[...])
        # sum_j w_j * b_{e_j}, once (not per device of a sharded product); 0 past num_valid
        bias = jnp.einsum("tk,tkd->td", weights,
                          self.down_proj_bias[...].astype(jnp.float32)[experts])
        if num_valid is not None:
            bias = jnp.where(jnp.arange(x.shape[0])[:, None] < num_valid, bias, 0.0)
        return (out.astype(jnp.float32) + bias).astype(out.dtype)


class SparseMoE(nnx.Module):
    """The MLP of a mixture-of-experts layer: router (`gate`, D -> E; a bias: gpt-oss), experts,
    and a shared expert (an MLP every token takes) when config.shared_expert_intermediate_size:
    Qwen2-MoE's scaled by sigmoid(x @ W_shared_gate), DeepSeek's ungated. config.topk_method:
    DeepSeek's routers (models/layers/grouped_routing.py; V3's with its learned
    e_score_correction_bias), else `route`."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d = config.hidden_size
        self.gate = linear(d, config.num_experts, config, rngs, dtype, param_dtype,
                           config.router_bias)
        experts = InterleavedExperts if config.expert_layout == "interleaved" else Experts
        self.experts = experts(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        shared = config.shared_expert_intermediate_size
        self.shared_expert = (MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                  intermediate_size=shared) if shared else None)
        self.shared_expert_gate = (linear(d, 1, config, rngs, dtype, param_dtype)
                                   if shared and config.shared_expert_gate else None)
        self.routing = None if config.topk_method is None else GroupedRouting(
            config.topk_method, config.n_group, config.topk_group,
            config.routed_scaling_factor, config.norm_topk_prob)
        self.e_score_correction_bias = (
            nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))
            if config.topk_method == "noaux_tc" else None)

    def router_logits(self, x: jax.Array) -> jax.Array:
        """f32[..., E]: x @ W_gate accumulated in f32."""
        kernel = self.gate.kernel[...]
        logits = jnp.einsum("...d,de->...e", x, kernel.astype(x.dtype),
                            preferred_element_type=jnp.float32)
        if self.gate.bias is not None:
            logits = logits + self.gate.bias[...].astype(jnp.float32)
        return logits

    def __call__(self, x: jax.Array, num_valid: jax.Array | None = None,
                 mesh: jax.sharding.Mesh | None = None,
                 expert_parallel: bool = False) -> jax.Array:
        """mesh: the experts split over its TP axis (Experts.__call__)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router_logits(flat)
        if self.routing is None:
            weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        else:
            bias = self.e_score_correction_bias
            weights, experts = grouped_route(logits, self.top_k, self.routing,
                                             None if bias is None else bias[...])
        out = self.experts(flat, weights, experts, num_valid, mesh=mesh,
                           expert_parallel=expert_parallel)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat).astype(jnp.float32)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(flat).astype(jnp.float32)) * shared
            out = out + shared.astype(out.dtype)
        return out.reshape(shape)
