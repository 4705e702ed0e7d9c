"""The gated delta rule's decode update as Pallas kernels (pallas_kernels/gated_delta_step.py),
interpreted, against the jnp reference (delta_step): the TPU kernel (a program a row, all its
heads) and the GPU kernel (a program a row, head and 32 value columns), on Qwen3.5's layout
scaled down (4 value heads of Dk 16 x Dv 64, 3 rows), and the GPU entry's fallback to the
reference where Triton's power-of-two blocks cannot tile. f32 sums over Dk in another order:
1e-5 relative."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels.gated_delta import delta_step
from pagedjax.pallas_kernels.gated_delta_step import recurrent_update, update_for


def inputs(seed, batch=3, heads=4, dk=16, dv=64):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    return (normal(batch, heads, dk), normal(batch, heads, dk), normal(batch, heads, dv),
            -jnp.asarray(rng.uniform(0.05, 2.0, (batch, heads)), jnp.float32),
            jnp.asarray(rng.uniform(0.05, 0.95, (batch, heads)), jnp.float32),
            normal(batch, heads, dk, dv))


@pytest.mark.parametrize("implementation", ["tpu", "gpu"])
def test_the_kernels_equal_the_reference(implementation):
    q, k, v, g, beta, states = inputs(0)
    expected = delta_step(states, q, k, v, g, beta)
    out, new = recurrent_update(q, k, v, g, beta, states, implementation, interpret=True)
    np.testing.assert_allclose(out, expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new, expected[1], rtol=1e-5, atol=1e-5)


def test_the_backends_pick_their_kernel_and_odd_shapes_the_reference(monkeypatch):
    import pagedjax.pallas_kernels.gated_delta_step as step
    calls = []
    monkeypatch.setattr(step, "_gpu_call", lambda *a: calls.append(a) or (lambda *x: 1 / 0))
    q, k, v, g, beta, states = inputs(1, dk=8, dv=12)  # Triton cannot tile 8 x 12
    out, _ = update_for("gpu", interpret=True)(states, q, k, v, g, beta)
    np.testing.assert_allclose(out, delta_step(states, q, k, v, g, beta)[0], rtol=1e-6)
    assert calls == []
    with pytest.raises(ValueError, match="implementation must be one of"):
        recurrent_update(q, k, v, g, beta, states, "cuda")
