"""The gated delta rule's decode update (one token a row: pallas_kernels/gated_delta.py's
delta_step on a decode step's rows) as Pallas kernels for the TPU and the GPU, beside the jnp
reference, behind one entry (recurrent_update) picked by the attention backend's name; and
kernels_for, the set a backend's steps run (the TPU's chunk scan for prefill too:
pallas_kernels/tpu/gated_delta.py).

Each row's state f32[Hv, Dk, Dv] is read once, decayed, corrected by the delta rule, read by
the query and written back in place (the states array aliased to the new one): one pass over
the state, the step's whole memory traffic, with no intermediate [Hv, Dk, Dv] in HBM.

- TPU (Mosaic): one program a row and 8 heads ([8, Dk, Dv] in VMEM: 0.5 MiB at Qwen3.5's
  128 x 128; all 32 heads of a row, 2 MiB in and out double-buffered beside q and k padded to
  a lane tile each, passed v5e's 16 MiB of scoped VMEM); the grid is rows x heads / 8.
- GPU (Triton): one program a (row, head, 32 value columns): a column block of the state
  evolves alone (the rule reads k . S column by column), so [Dk, 32] f32 sits in registers.
  Triton's blocks are powers of two: Dk and Dv must be (Qwen3.5's 128 are); the reference
  runs otherwise.

The body is one function of broadcasting ops on [h, Dk, c] blocks (h heads, c value columns):
q and k come as columns [h, Dk, 1], v as a row [h, 1, c], g and beta as [h, 1, 1].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pagedjax.pallas_kernels.gated_delta import delta_step

IMPLEMENTATIONS = ("reference", "tpu", "gpu")
# the attention backend (pallas_kernels.dispatch) -> the implementation its decode step runs
FOR_BACKEND = {"reference": "reference", "tpu": "tpu", "gpu": "gpu", "mosaic_gpu": "gpu"}
GPU_COLUMNS = 32  # value columns a GPU program updates
# value heads a TPU program updates: 8 of 128 x 128 are 0.5 MiB of state in and out, and q and
# k as columns (a lane each, padded to 128) as much again, double-buffered: 4 MiB of VMEM
TPU_HEADS = 8


def _body(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, out_ref, new_state_ref):
    state = state_ref[0] * jnp.exp(g_ref[0])  # [h, Dk, c] decayed
    k = k_ref[0]  # [h, Dk, 1]
    predicted = jnp.sum(state * k, axis=1, keepdims=True)  # [h, 1, c]: k . S, column by column
    state = state + k * ((v_ref[0] - predicted) * beta_ref[0])
    out_ref[0] = jnp.sum(state * q_ref[0], axis=1, keepdims=True)
    new_state_ref[0] = state


@dataclasses.dataclass(frozen=True)
class DeltaKernels:
    """A platform's kernels for ragged_gated_delta (pallas_kernels/gated_delta.py); None: the
    jnp form."""

    update: Callable | None = None  # delta_step's signature: a decode step's rows
    chunk_scan: Callable | None = None  # (parts, rows, states) -> (out, states): prefill


def kernels_for(backend_name: str, interpret: bool = False) -> DeltaKernels:
    """The kernels a step on this attention backend runs: the decode update on the TPU and
    the GPU, the chunk scan on the TPU (pallas_kernels/tpu/gated_delta.py); the GPU's prefill
    stays XLA's scan."""
    implementation = FOR_BACKEND.get(backend_name, "reference")
    if implementation == "reference":
        return DeltaKernels()
    update = functools.partial(_update_kernel, implementation=implementation,
                               interpret=interpret)
    scan = None
    if implementation == "tpu":
        from pagedjax.pallas_kernels.tpu.gated_delta import chunk_scan_tpu
        scan = functools.partial(chunk_scan_tpu, interpret=interpret)
    return DeltaKernels(update, scan)


def _update_kernel(states, q, k, v, g, beta, *, implementation, interpret):
    return recurrent_update(q, k, v, g, beta, states, implementation, interpret)


def recurrent_update(q, k, v, g, beta, states, implementation: str = "reference",
                     interpret: bool = False):
    """delta_step on prepared inputs (q, k [B, Hv, Dk], v [B, Hv, Dv], g, beta [B, Hv],
    states f32[B, Hv, Dk, Dv]) -> (out f32[B, Hv, Dv], new states). interpret: a kernel
    through the Pallas interpreter."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    batch, heads, dk = q.shape
    dv = v.shape[-1]
    if implementation == "gpu" and not (_pow2(dk) and _pow2(dv) and dv >= GPU_COLUMNS):
        implementation = "reference"  # shapes Triton's blocks cannot take
    if implementation == "reference":
        return delta_step(states, q, k, v, g, beta)
    args = (q[..., None].astype(jnp.float32), k[..., None].astype(jnp.float32),
            v[:, :, None, :].astype(jnp.float32),
            g.astype(jnp.float32)[..., None, None], beta.astype(jnp.float32)[..., None, None],
            states.astype(jnp.float32))
    call = _tpu_call if implementation == "tpu" else _gpu_call
    out, new = call(batch, heads, dk, dv, interpret)(*args)
    return out[:, :, 0, :], new


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _out_shapes(batch, heads, dk, dv):
    return (jax.ShapeDtypeStruct((batch, heads, 1, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, dk, dv), jnp.float32))


@functools.lru_cache(maxsize=None)
def _tpu_call(batch, heads, dk, dv, interpret):
    h = max(d for d in range(1, min(heads, TPU_HEADS) + 1) if heads % d == 0)
    column = pl.BlockSpec((1, h, dk, 1), lambda b, j: (b, j, 0, 0))
    scalar = pl.BlockSpec((1, h, 1, 1), lambda b, j: (b, j, 0, 0))
    row = pl.BlockSpec((1, h, 1, dv), lambda b, j: (b, j, 0, 0))
    state = pl.BlockSpec((1, h, dk, dv), lambda b, j: (b, j, 0, 0))
    return pl.pallas_call(
        _body, grid=(batch, heads // h), in_specs=[column, column, row, scalar, scalar, state],
        out_specs=(row, state), out_shape=_out_shapes(batch, heads, dk, dv),
        input_output_aliases={5: 1}, interpret=interpret)


@functools.lru_cache(maxsize=None)
def _gpu_call(batch, heads, dk, dv, interpret):
    c = GPU_COLUMNS
    column = pl.BlockSpec((1, 1, dk, 1), lambda b, h, j: (b, h, 0, 0))
    scalar = pl.BlockSpec((1, 1, 1, 1), lambda b, h, j: (b, h, 0, 0))
    row = pl.BlockSpec((1, 1, 1, c), lambda b, h, j: (b, h, 0, j))
    state = pl.BlockSpec((1, 1, dk, c), lambda b, h, j: (b, h, 0, j))
    return pl.pallas_call(
        _body, grid=(batch, heads, dv // c), in_specs=[column, column, row, scalar, scalar, state],
        out_specs=(row, state), out_shape=_out_shapes(batch, heads, dk, dv),
        input_output_aliases={5: 1}, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))  # Triton's lowering
