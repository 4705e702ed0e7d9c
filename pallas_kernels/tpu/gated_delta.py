"""The chunked gated delta rule's sequential part for the TPU (Mosaic): a step's chunks in
order, each reading its row's state, adding its output and leaving the state for the next
(pallas_kernels/gated_delta.py's chunk_step under its lax.scan, fused).

Grid (value heads, chunks), the chunks sequential: chunk c's state block is its row's
(rows[c], scalar-prefetched), so a row's consecutive chunks keep the state resident in VMEM and
it is written back once, when the next row's chunks begin; a row's first chunk reads the state
the step started from (the input, aliased to the output: updated in place). The parts that do
not need the state (the unit lower-triangular solves, the decays) come in from within_chunks,
computed before for every chunk at once. f32 throughout, the matmuls at full precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pagedjax.pallas_kernels.common import tpu_interpret_params

HIGHEST = jax.lax.Precision.HIGHEST


def _kernel(rows_ref, first_ref, values_ref, k_decayed_ref, within_ref, q_decayed_ref,
            k_to_end_ref, decay_ref, state_in_ref, out_ref, state_ref):
    del rows_ref  # the state blocks' index maps read it

    @pl.when(first_ref[pl.program_id(1)] == 1)
    def _():
        state_ref[...] = state_in_ref[...]

    dot = functools.partial(jnp.dot, precision=HIGHEST, preferred_element_type=jnp.float32)
    state = state_ref[...]  # [Dk, Dv]
    new = values_ref[...] - dot(k_decayed_ref[...], state)  # [C, Dv]
    out_ref[...] = dot(q_decayed_ref[...], state) + dot(within_ref[...], new)
    state_ref[...] = state * decay_ref[...] + dot(k_to_end_ref[...].T, new)


def chunk_scan_tpu(parts: tuple, rows: jax.Array, states: jax.Array, *,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """within_chunks' parts of N chunks ([N, Hv, C, ...], chunks in row order), each chunk's
    row i32[N] (non-decreasing) and the rows' states f32[B, Hv, Dk, Dv] -> (each chunk's
    output f32[N, Hv, C, Dv], the states after every row's chunks)."""
    values, k_decayed, within, q_decayed, k_to_end, decay = parts
    num_chunks, heads, size, dv = values.shape
    dk = k_decayed.shape[-1]
    rows = rows.astype(jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), jnp.int32),
                             (rows[1:] != rows[:-1]).astype(jnp.int32)])

    def chunk(d):
        return pl.BlockSpec((None, None, size, d), lambda h, c, *_: (c, h, 0, 0))

    state = pl.BlockSpec((None, None, dk, dv), lambda h, c, rows, first: (rows[c], h, 0, 0))
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # rows, first
            grid=(heads, num_chunks),
            in_specs=[chunk(dv), chunk(dk), chunk(size), chunk(dk), chunk(dk),
                      pl.BlockSpec((None, None, 1, 1), lambda h, c, *_: (c, h, 0, 0)), state],
            out_specs=(chunk(dv), state)),
        out_shape=(jax.ShapeDtypeStruct((num_chunks, heads, size, dv), jnp.float32),
                   jax.ShapeDtypeStruct(states.shape, jnp.float32)),
        input_output_aliases={8: 1},  # the states, after the 2 prefetched scalars and 6 parts
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=tpu_interpret_params(interpret),
        name="gated_delta_chunks_tpu",
    )(rows, first, values, k_decayed, within, q_decayed, k_to_end,
      decay.astype(jnp.float32)[..., None, None], states.astype(jnp.float32))
