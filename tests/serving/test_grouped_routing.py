"""DeepSeek's routers (models/layers/grouped_routing.py) against transformers' own
(DeepseekV2TopkRouter greedy and group limited, DeepseekV3TopkRouter with its correction bias)
on the same logits: the same experts with the same weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax.models.layers.grouped_routing import GroupedRouting, grouped_route  # noqa: E402

HIDDEN = 32


def _router(version: str, **fields):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    torch.manual_seed(0)
    if version == "v2":
        config = transformers.DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16,
                                               num_experts_per_tok=3, **fields)
        router = DeepseekV2TopkRouter(config)
    else:
        config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=16,
                                               num_experts_per_tok=3, **fields)
        router = DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16))
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
    return router


def _sorted(weights, experts):
    order = np.argsort(experts, axis=-1)
    return (np.take_along_axis(weights, order, -1), np.take_along_axis(experts, order, -1))


@pytest.mark.parametrize("version, fields", [
    ("v2", dict(topk_method="greedy", routed_scaling_factor=1.0)),
    ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                routed_scaling_factor=2.5)),
    ("v3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    ("v3", dict(n_group=8, topk_group=3, routed_scaling_factor=1.5, norm_topk_prob=False)),
], ids=["v2-greedy", "v2-group-limited", "v3-noaux-tc", "v3-unnormalised"])
def test_routes_as_transformers(version, fields):
    router = _router(version, **fields)
    hidden = torch.randn(64, HIDDEN)
    with torch.no_grad():
        logits, want_weights, want_experts = router(hidden)
    routing = GroupedRouting(topk_method=fields.get("topk_method", "noaux_tc"),
                             n_group=fields.get("n_group", 1),
                             topk_group=fields.get("topk_group", 1),
                             routed_scaling_factor=fields["routed_scaling_factor"],
                             norm_topk_prob=fields.get("norm_topk_prob", False))
    bias = (jnp.asarray(router.e_score_correction_bias.numpy()) if version == "v3" else None)
    weights, experts = grouped_route(jnp.asarray(logits.numpy()), 3, routing, bias)
    got = _sorted(np.asarray(weights), np.asarray(experts))
    want = _sorted(want_weights.numpy(), want_experts.numpy())
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)


def test_groups_limit_the_choice():
    """A token whose best experts all lie in one group gets at most the kept groups' experts:
    with topk_group 1, every expert chosen is in the best group."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(32, 16)), jnp.float32)
    routing = GroupedRouting("group_limited_greedy", n_group=4, topk_group=1)
    _, experts = grouped_route(logits, 3, routing)
    groups = np.asarray(experts) // 4
    assert np.all(groups == groups[:, :1])


@pytest.mark.parametrize("fields, words", [
    (dict(topk_method="top1"), "topk_method"),
    (dict(n_group=2, topk_group=3), "topk_group"),
])
def test_settings_are_checked(fields, words):
    with pytest.raises(ValueError, match=words):
        GroupedRouting(**fields)
    routing = GroupedRouting("noaux_tc", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="n_group"):
        routing.check(16, 2)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        GroupedRouting("noaux_tc", n_group=4, topk_group=1).check(16, 5)
