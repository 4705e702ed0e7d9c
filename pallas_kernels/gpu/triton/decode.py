"""Paged decode attention for GPU: Pallas with the Triton lowering, split-K (flash-decoding).

Axis letters: B sequences, N query heads, K KV heads, G = N // K, Gp = G padded to the minimum dot
size, H head dim (Hp: padded to a power of two in the GPU cache layout), S block size, P table
width, C blocks per compute step, NB physical blocks.

Grid (B, K, num_splits): one program per sequence, KV head and slice of the context. A program
loads its query-head group once and walks only the blocks below the sequence's kv_len (never the
padded table width), C blocks per step, with an online softmax; a second pass outside the kernel
combines the splits. The KV cache is passed with memory_space=ANY and indexed through the block
table inside the kernel, so no BlockSpec ever copies the pool.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pagedjax.pallas_kernels.common import MASK_VALUE, online_softmax_step, sink_rows
from pagedjax.pallas_kernels.gpu.common import combine_splits, next_power_of_2, split_context
from pagedjax.pallas_kernels.gpu.triton import latent
from pagedjax.pallas_kernels.gpu.triton.tiling import (MIN_DOT_SIZE, check_operands, fit_pipeline,
                                                       load_pages)


def _decode_kernel(
    kv_lens_ref,  # i32[B]                    (ANY) 0 for padding rows
    block_tables_ref,  # i32[B, Pp]           (ANY) padded with the null block
    q_ref,  # [Gp, Hp]                        this program's query-head group
    kv_ref,  # [2, K, NB, S, Hp]              (ANY) the whole layer cache
    *refs,  # [scales f32[2, K, NB, S] (ANY) if quantized,] o f32[Gp, Hp], l f32[Gp], m f32[Gp]
    pages_per_split: int, pages_per_step: int, scale: float, sliding_window: int | None,
    soft_cap: float | None, quantized: bool,
):
    scales_ref, (o_ref, l_ref, m_ref) = (refs[0], refs[1:]) if quantized else (None, refs)
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, head_dim = kv_ref.shape[3], kv_ref.shape[4]
    block_k = pages_per_step * block_size
    kv_len = kv_lens_ref[seq]
    first_page = split * pages_per_split
    if sliding_window is not None:  # the query at kv_len - 1 sees positions >= kv_len - window
        first_page = jnp.maximum(first_page, jnp.maximum(kv_len - sliding_window, 0) // block_size)
    end_page = jnp.minimum((split + 1) * pages_per_split, pl.cdiv(kv_len, block_size))
    q = q_ref[...]
    num_rows = q.shape[0]

    def body(i, carry):
        page = first_page + i * pages_per_step
        blocks = block_tables_ref[seq, pl.ds(page, pages_per_step)]  # i32[C]
        k = load_pages(kv_ref, scales_ref, 0, head, blocks, q.dtype)  # [C*S, Hp]
        v = load_pages(kv_ref, scales_ref, 1, head, blocks, q.dtype)
        kv_pos = page * block_size + jnp.arange(block_k, dtype=jnp.int32)
        # end_page bounds the split too: a window-shifted start is not step-aligned, so the
        # last step may reach into the next split's pages.
        valid = kv_pos < jnp.minimum(kv_len, end_page * block_size)
        if sliding_window is not None:
            valid &= kv_pos >= kv_len - sliding_window
        # Slots past kv_len may hold anything, NaN included. Their scores are masked by a
        # select, so K needs nothing; V is zeroed, or 0 * NaN would reach the output. A select
        # on K too costs 28 KB of shared memory, and a masked load of V stops Triton from
        # pipelining it (benchmarks/results/gpu_compile.md).
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        return online_softmax_step(q, k, v, valid[None, :], carry, scale=scale,
                                   soft_cap=soft_cap)

    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_step)
    init = (jnp.zeros((num_rows, head_dim), jnp.float32),
            jnp.full((num_rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((num_rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, num_steps, body, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _split_outputs(num_splits: int, batch: int, num_kv_heads: int, rows: int,
                   head_dim: int) -> dict:
    """out_specs and out_shape of the split programs' partial softmaxes: o f32[X, B, K, Gp, Hp],
    l and m f32[X, B, K, Gp], one block a program (combine_splits merges them)."""
    row_spec = pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0))
    stats = jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, rows), jnp.float32)
    return dict(
        out_specs=[pl.BlockSpec((None, None, None, rows, head_dim),
                                lambda b, h, s: (s, b, h, 0, 0)), row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, rows, head_dim),
                                        jnp.float32), stats, stats])


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "pages_per_step", "num_splits", "num_warps",
    "num_stages", "interpret", "value_dim"))
def paged_decode_attention_gpu(
    q: jax.Array,  # [B, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, Hp], this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    num_seqs: jax.Array,  # i32[] only the first num_seqs rows are valid
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, pages_per_step: int | None = None,
    num_splits: int | None = None, num_warps: int = 8, num_stages: int | None = None,
    interpret: bool = False, value_dim: int | None = None,
) -> jax.Array:  # [B, N, H] ([B, N, value_dim]: a latent cache); 0 for padding rows
    """sinks: f32[N] attention sinks (pallas_kernels.reference) or None, merged with the
    splits' partial softmaxes (combine_splits). pages_per_step / num_stages None: up to 8 pages (128 keys at block 16) per loop step and
    2 pipeline stages, as many as fit the shared memory of the visible GPU (of an H100/H200
    where none is; see fit_pipeline); an explicit value is taken as given. 8 warps: at the
    benchmark's shape 4 warps need 237 registers a thread (255 with an int8 cache), 8 need 119,
    and an SM then holds 16 warps, as many as it holds of JAX's shipped kernel
    (benchmarks/results/gpu_compile.md). f32 dots follow jax.default_matmul_precision
    (dot_precision). The cache has the GPU layout: head dim and block size powers of two.
    value_dim: a latent cache (gpu.triton.latent)."""
    if value_dim is not None:
        latent.check_latent_options(sliding_window=sliding_window, soft_cap=soft_cap,
                                    sinks=sinks)
        return latent.latent_decode_attention_gpu(
            q, kv_cache, kv_lens, block_tables, num_seqs, scale=scale, value_dim=value_dim,
            pages_per_step=pages_per_step, num_splits=num_splits, num_warps=num_warps,
            num_stages=num_stages, interpret=interpret)
    batch, num_heads, head_dim = q.shape
    data, scales, dtype, group = check_operands(q, kv_cache, interpret,
                                                pages_per_step=pages_per_step)
    _, num_kv_heads, _, block_size, padded_head_dim = data.shape
    padded_group = max(MIN_DOT_SIZE, next_power_of_2(group))
    width = block_tables.shape[1]
    pages_per_step, num_stages = fit_pipeline(
        pages_per_step, num_stages, preferred_pages=8, rows=padded_group,
        block_size=block_size, head_dim=padded_head_dim, cache_itemsize=data.dtype.itemsize,
        compute_itemsize=jnp.dtype(dtype).itemsize, quantized=scales is not None)
    pages_per_step = min(pages_per_step, next_power_of_2(width))
    num_splits, pages_per_split, tables, lens = split_context(
        block_tables, kv_lens, num_seqs, programs=batch * num_kv_heads,
        pages_per_step=pages_per_step, num_splits=num_splits)
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(dtype)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded_group - group),
                      (0, padded_head_dim - head_dim)))

    kernel = functools.partial(
        _decode_kernel, pages_per_split=pages_per_split, pages_per_step=pages_per_step,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        quantized=scales is not None)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    quant_operands = [] if scales is None else [scales]
    o, l, m = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            any_spec,  # kv_lens
            any_spec,  # block_tables
            pl.BlockSpec((None, None, padded_group, padded_head_dim),
                         lambda b, h, s: (b, h, 0, 0)),  # q
            any_spec,  # kv_cache
        ] + [any_spec] * len(quant_operands),  # scales of a quantized cache
        **_split_outputs(num_splits, batch, num_kv_heads, padded_group, padded_head_dim),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )(lens, tables, qg, data, *quant_operands)
    out = combine_splits(o, l, m, sink_rows(sinks, num_kv_heads, group, padded_group))
    out = out[:, :, :group, :head_dim]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
