"""DeepSeek's routers, as transformers computes them (models/layers/moe.py's `route` is the plain
softmax top-k of the other families). Scores from f32 router logits [T, E]:

- DeepSeek-V2 (`topk_method` "greedy" or "group_limited_greedy"): softmax scores; greedy takes
  the k best; group limited first keeps the topk_group of the n_group expert groups whose best
  score is highest (the other groups' scores set to 0), then takes the k best of what is left.
- DeepSeek-V3 (`topk_method` "noaux_tc"): sigmoid scores; the choice adds
  e_score_correction_bias to each score, keeps the topk_group groups whose two best corrected
  scores sum highest (the others at -inf) and takes the k best corrected scores; the weights
  are the uncorrected scores of those experts, renormalised to sum to 1 when norm_topk_prob.

Either way the weights are then multiplied by routed_scaling_factor. Ties go to the lower expert
id (lax.top_k), which transformers' unsorted torch.topk may order otherwise: the experts' sum
does not depend on the order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pagedjax.models.config_checks import TOPK_METHODS


@dataclasses.dataclass(frozen=True)
class GroupedRouting:
    """A DeepSeek router's settings (config.json's names)."""

    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False

    def __post_init__(self):
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, "
                             f"got {self.topk_method!r}")
        if not (isinstance(self.n_group, int) and self.n_group >= 1
                and isinstance(self.topk_group, int) and 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"routing needs 1 <= topk_group ({self.topk_group}) <= n_group "
                             f"({self.n_group})")

    def check(self, num_experts: int, top_k: int) -> None:
        """ValueError naming the field when the experts do not split into n_group groups or
        the kept groups hold fewer than top_k experts."""
        if num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide the {num_experts} experts")
        if top_k > self.topk_group * (num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok ({top_k}) exceeds the experts of the "
                             f"topk_group ({self.topk_group}) groups kept")


def grouped_route(router_logits: jax.Array, top_k: int, routing: GroupedRouting,
                  correction_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(weights f32[T, k], experts i32[T, k]) of f32[T, E] router logits (module docstring)."""
    logits = router_logits.astype(jnp.float32)
    if routing.topk_method == "noaux_tc":
        scores = jax.nn.sigmoid(logits)
        choice = scores + (0.0 if correction_bias is None
                           else correction_bias.astype(jnp.float32))
        choice = _keep_groups(choice, routing, lambda g: jnp.sum(jax.lax.top_k(g, 2)[0], -1),
                              fill=-jnp.inf)
        experts = jax.lax.top_k(choice, top_k)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
        if routing.topk_method == "group_limited_greedy":
            scores = _keep_groups(scores, routing, lambda g: jnp.max(g, -1), fill=0.0)
        weights, experts = jax.lax.top_k(scores, top_k)
    if routing.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routing.routed_scaling_factor, experts.astype(jnp.int32)


def _keep_groups(scores: jax.Array, routing: GroupedRouting, group_score, fill: float):
    """scores [T, E] with every expert outside the topk_group best groups set to fill."""
    num_tokens, num_experts = scores.shape
    groups = scores.reshape(num_tokens, routing.n_group, num_experts // routing.n_group)
    best = jax.lax.top_k(group_score(groups), routing.topk_group)[1]  # [T, topk_group]
    kept = jnp.sum(jax.nn.one_hot(best, routing.n_group, dtype=jnp.int32), axis=1) > 0
    return jnp.where(kept[:, :, None], groups, fill).reshape(num_tokens, num_experts)
