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
from pagedjax.pallas_kernels.gated_delta_step import kernels_for, recurrent_update


def inputs(seed, batch=3, heads=4, dk=16, dv=64):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    return (normal(batch, heads, dk), normal(batch, heads, dk), normal(batch, heads, dv),
            -jnp.asarray(rng.uniform(0.05, 2.0, (batch, heads)), jnp.float32),
            jnp.asarray(rng.uniform(0.05, 0.95, (batch, heads)), jnp.float32),
            normal(batch, heads, dk, dv))


@pytest.mark.parametrize("heads", [16])  # the TPU kernel: two blocks of 8 heads
@pytest.mark.parametrize("implementation", ["tpu", "gpu"])
def test_the_kernels_equal_the_reference(implementation, heads):
    q, k, v, g, beta, states = inputs(0, heads=heads)
    expected = delta_step(states, q, k, v, g, beta)
    out, new = recurrent_update(q, k, v, g, beta, states, implementation, interpret=True)
    np.testing.assert_allclose(out, expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new, expected[1], rtol=1e-5, atol=1e-5)


def test_the_tpu_chunk_scan_equals_the_scan_over_chunks():
    """pallas_kernels/tpu/gated_delta.py against chunk_step under lax.scan, on a step's chunks:
    rows of 7, 0, 1 and 11 tokens in chunks of 4 (a row of one chunk, an empty row that keeps
    its state, a row of three), then the step's empty chunks on the last row."""
    import jax

    from pagedjax.pallas_kernels.gated_delta import _prepare, _row_chunks, chunk_step, within_chunks
    from pagedjax.pallas_kernels.tpu.gated_delta import chunk_scan_tpu
    q, k, v, g, beta, states = inputs(2, batch=24, heads=4, dk=16, dv=32)
    q, k, v, g, beta = _prepare(q[:, :2], k[:, :2], v, g, beta)  # 2 key heads, 4 value heads
    states = states[:4]
    cu = jnp.asarray([0, 7, 7, 8, 19], jnp.int32)
    row, valid, index = _row_chunks(cu, jnp.asarray(19), 24, 4, 4)
    parts = within_chunks(*(jnp.moveaxis(jnp.where(
        valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[index], 0.0), 1, 2)
        for x in (q, k, v, g, beta)))

    def body(states, xs):
        state, out = chunk_step(states[xs[0]], xs[1])
        return states.at[xs[0]].set(state), out

    expected_states, expected = jax.lax.scan(body, states, (row, parts))
    out, new = chunk_scan_tpu(parts, row, states, interpret=True)
    assert list(row) == [0, 0, 2, 3, 3, 3, 3, 3, 3, 3]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new, expected_states, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new[1], states[1])


def test_the_backends_pick_their_kernel_and_odd_shapes_the_reference(monkeypatch):
    import pagedjax.pallas_kernels.gated_delta_step as step
    calls = []
    monkeypatch.setattr(step, "_gpu_call", lambda *a: calls.append(a) or (lambda *x: 1 / 0))
    q, k, v, g, beta, states = inputs(1, dk=8, dv=12)  # Triton cannot tile 8 x 12
    kernels = kernels_for("gpu", interpret=True)
    assert kernels.chunk_scan is None  # the GPU's prefill: XLA's scan
    out, _ = kernels.update(states, q, k, v, g, beta)
    np.testing.assert_allclose(out, delta_step(states, q, k, v, g, beta)[0], rtol=1e-6)
    assert calls == []
    with pytest.raises(ValueError, match="implementation must be one of"):
        recurrent_update(q, k, v, g, beta, states, "cuda")


def test_the_gpu_kernel_builds_for_an_h200():
    """Lowered for CUDA and compiled to a cubin by the triton package (no GPU needed): it fits
    sm_90's shared memory and spills no register, at Qwen3.5's 32 value heads of 128 x 128."""
    pytest.importorskip("triton", reason="a test dependency: requirements/test.txt")
    import functools

    import jax

    from benchmarks.aot import triton_gpu
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    args = (f32((64, 32, 128)), f32((64, 32, 128)), f32((64, 32, 128)), f32((64, 32)),
            f32((64, 32)), f32((64, 32, 128, 128)))
    update = functools.partial(recurrent_update, implementation="gpu")
    lowered = triton_gpu.lower_cuda(lambda: jax.jit(update).trace(*args), (9, 0))
    [kernel] = triton_gpu.compile_lowered(lowered, (9, 0))
    assert kernel.fits, (kernel.shared_bytes, kernel.shared_limit)
    assert kernel.spill_bytes == 0, (kernel.spill_bytes, kernel.registers)
