"""A row-parallel projection's LoRA delta over a TP 2 mesh (models/layers/lora.row_parallel, issue
71), in a child process with two host devices: each device adds its partial delta (its slice of
a's input rows) to its partial product before the one all-reduce, so the sum equals the
projection plus every token's delta computed on one device (base tokens: the projection alone).
The engine-level TP cases are make test-slow's (test_lora_parallel.py); this one is cheap."""

from __future__ import annotations

import pytest
from helpers import child_report


def child() -> None:
    import json

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from pagedjax.models.layers.lora import LayerLoRA, apply_lora, row_parallel
    from pagedjax.parallel.sharding import make_mesh

    mesh = make_mesh(2)  # the engine's TP mesh
    linear = nnx.Linear(16, 8, use_bias=True, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.float32)  # [batch, tokens, I]
    a = jnp.asarray(rng.normal(0, 0.3, size=(2, 16, 4)), jnp.float32)
    b = jnp.asarray(rng.normal(0, 0.3, size=(2, 4, 8)), jnp.float32)
    slots = jnp.asarray([-1, 0, 1, 0, -1, 1], jnp.int32)
    one_device = apply_lora(LayerLoRA(slots, {"o_proj": (a, b)}), "o_proj", x, linear(x))
    report = {}
    for active in (None, True, False):
        lora = LayerLoRA(slots, {"o_proj": (a, b)}, mesh=mesh,
                         active=None if active is None else jnp.asarray(active))
        split = row_parallel(linear, "o_proj", x, lora)
        want = one_device if active is not False else linear(x)
        report[str(active)] = float(jnp.max(jnp.abs(split - want)))
    report["delta"] = float(jnp.max(jnp.abs(one_device - linear(x))))
    print(json.dumps(report))


@pytest.mark.slow  # make test-slow
def test_the_row_parallel_delta_joins_the_partial_sums_before_the_all_reduce():
    report = child_report("test_lora_row_parallel", devices=2, timeout=300)
    assert report["delta"] > 0.1  # the adapters change the projection
    for active in ("None", "True", "False"):
        assert report[active] < 1e-5, report  # f32 sums of 16 products in another order
