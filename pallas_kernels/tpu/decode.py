"""Paged decode attention for TPU: Pallas with the Mosaic lowering.

Axis letters: B sequences, N query heads, K KV heads, G = N // K (Gp: padded to a multiple of 8
sublanes), H head dim, S block size, C pages per compute block, NB physical blocks.

Grid (B, K). kv_lens are scalar-prefetched into SMEM; the first program of a sequence copies its
block-table row from HBM into SMEM (the whole table would outgrow SMEM at production sizes). K/V
stay in HBM (memory_space=ANY); each program copies the pages it needs into VMEM with DMAs, one a
page for its K and V rows, C pages per compute block, double-buffered: block j + 1 is in flight
while block j is computed. Only ceil(kv_len / (C * S)) compute blocks are fetched, never the
padded table width. The dots take bf16 K/V as they are (f32 accumulation). What the loop costs a
TensorCore is read from libtpu's compiled schedule by benchmarks/tpu_schedule.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pagedjax.pallas_kernels.common import tpu_interpret_params
from pagedjax.pallas_kernels.tpu.pipeline import (SUBLANES, PagePipeline, attend_sequence,
                                                  check_operands, compiler_params, compute_dtype,
                                                  default_pages_per_step, fetch_table_row,
                                                  flat_tables, padded_heads, page_scratch,
                                                  sink_operands, table_width)


def _decode_kernel(
    kv_lens_ref,  # i32[B]                 SMEM (scalar prefetch); 0 for padding rows
    q_ref,  # [Gp, H]                      VMEM block of this (sequence, KV head)
    tables_hbm_ref,  # i32[B * Pp]         HBM, flattened block tables
    kv_hbm_ref,  # [2, K, NB, S, H]        HBM (ANY)
    *refs,  # [scales f32[2, K, NB, Ss] HBM,] [sinks f32[Gp, 1] VMEM,] o [Gp, H] VMEM output
    #         block, then scratch:
    #         table_row i32[Pp] SMEM and its DMA semaphore,
    #         kv_buf [2, 2, C, S, H] (+ scale buffer [2, 2, C, Ss]) VMEM double buffers,
    #         page_sems DMA[2], one semaphore per buffer slot
    pages_per_step: int, scale: float, sliding_window: int | None,
    soft_cap: float | None, quantized: bool, has_sinks: bool,
):
    scales_hbm_ref, refs = (refs[0], refs[1:]) if quantized else (None, refs)
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    o_ref, table_row, table_sem, *buffers, page_sems = refs
    seq, head = pl.program_id(0), pl.program_id(1)
    block_size = kv_hbm_ref.shape[3]
    block_k = pages_per_step * block_size
    kv_len = kv_lens_ref[seq]
    first_block: int | jax.Array = 0
    if sliding_window is not None:
        # lax.div (truncating) on a non-negative operand: jnp's floor division lowers through
        # sign(), which Mosaic only lowers for a known TPU generation.
        first_block = jax.lax.div(jnp.maximum(kv_len - sliding_window, 0), block_k)
    num_blocks = pl.cdiv(kv_len, block_k)
    fetch_table_row(tables_hbm_ref, seq, table_row, table_sem, head)
    pipeline = PagePipeline(kv_hbm_ref, scales_hbm_ref, buffers, page_sems, table_row,
                            head=head, pages_per_step=pages_per_step)
    pipeline.start_first_block(first_block, num_blocks)
    dtype = compute_dtype(kv_hbm_ref.dtype, q_ref.dtype)
    q = q_ref[...].astype(dtype)

    def key_live(pos):  # keys past kv_len come from pages that may hold anything, NaN too
        live = pos < kv_len
        if sliding_window is not None:
            live &= pos >= kv_len - sliding_window
        return live

    o = attend_sequence(pipeline, q, first_block, num_blocks, block_k, dtype, key_live=key_live,
                        visible=key_live, scale=scale, soft_cap=soft_cap,
                        sliding_window=sliding_window,
                        sinks=None if sinks_ref is None else sinks_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "pages_per_step", "interpret", "value_dim"))
def paged_decode_attention_tpu(
    q: jax.Array,  # [B, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, H] (or a QuantizedKV), this step's K/V written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    num_seqs: jax.Array,  # i32[] only the first num_seqs rows are valid
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, pages_per_step: int | None = None,
    interpret: bool = False, value_dim: int | None = None,
) -> jax.Array:  # [B, N, H]; 0 for padding rows ([.., value_dim]: a latent cache)
    """sinks: f32[N] attention sinks (pallas_kernels.reference), or None. value_dim: a latent
    cache (one plane, pallas_kernels.layout), attended with its whole rows as the values and
    its first value_dim columns of the output kept."""
    data, scales, group = check_operands(q, kv_cache)
    out_dim = q.shape[-1] if value_dim is None else value_dim
    q = padded_heads(q, data.shape[4])
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = data.shape
    padded_group = pl.cdiv(group, SUBLANES) * SUBLANES
    width = block_tables.shape[1]
    pages_per_step = min(pages_per_step or default_pages_per_step(block_size), width)
    padded_width = table_width(width, pages_per_step)
    lens = jnp.where(jnp.arange(batch) < num_seqs, kv_lens, 0).astype(jnp.int32)
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))

    kernel = functools.partial(
        _decode_kernel, pages_per_step=pages_per_step, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap, quantized=scales is not None,
        has_sinks=sinks is not None)
    quant_operands = [] if scales is None else [scales]
    sink_inputs, sink_specs = sink_operands(sinks, num_kv_heads, group, padded_group, 1)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,  # kv_lens
            grid=(batch, num_kv_heads),
            in_specs=[
                pl.BlockSpec((None, None, padded_group, head_dim),
                             lambda b, h, *_: (b, h, 0, 0)),  # q
                pl.BlockSpec(memory_space=pltpu.HBM),  # block tables: a row DMA'd per program
                pl.BlockSpec(memory_space=pl.ANY),  # kv_cache stays in HBM
            ] + [pl.BlockSpec(memory_space=pl.ANY)] * len(quant_operands)  # scales, in HBM
            + sink_specs,
            out_specs=pl.BlockSpec((None, None, padded_group, head_dim),
                                   lambda b, h, *_: (b, h, 0, 0)),
            scratch_shapes=[
                pltpu.SMEM((padded_width,), jnp.int32),  # this sequence's block-table row
                pltpu.SemaphoreType.DMA(()),
                *page_scratch(pages_per_step, block_size, head_dim, data, scales),
                pltpu.SemaphoreType.DMA((2,)),  # page DMAs (K/V and scales), one per slot
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=compiler_params(),
        interpret=tpu_interpret_params(interpret),
        name="paged_decode_attention_tpu",
    )(lens, qg, flat_tables(block_tables, padded_width), data, *quant_operands, *sink_inputs)
    return out[:, :, :group].reshape(batch, num_heads, head_dim)[..., :out_dim]
