"""Paged decode attention for Hopper GPUs: Pallas with the Mosaic GPU lowering (TMA + WGMMA).

The algorithm of the Triton decode kernel (gpu/triton/decode.py: split-K flash-decoding over the
block tables), written for the lowering JAX develops now; Pallas' Triton lowering is deprecated
upstream. Axis letters as there; R = 64 rows, one warpgroup's WGMMA tile.

Grid (B, K, num_splits), one warpgroup a program, each running attend_pages (gpu/mosaic/attend.py)
over its slice of the context. Each program writes its G real rows' unnormalised output with its
softmax sums and maxima; gpu.common.combine_splits merges the splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pagedjax.pallas_kernels.gpu.common import choose_num_splits, combine_splits
from pagedjax.pallas_kernels.gpu.mosaic.attend import attend_pages, load_queries, pipeline, scratch
from pagedjax.pallas_kernels.gpu.mosaic.common import LOG2E, ROWS, check_operands, interpret_params


def _decode_kernel(lens_ref, tables_ref, q_ref, kv_ref, o_ref, lm_ref, q_smem, k_smem, v_smem,
                   p_smem, o_smem, lm_smem, q_barrier, kv_barriers, *, pages_per_split: int,
                   pages_per_step: int, num_stages: int, scale: float,
                   sliding_window: int | None, soft_cap: float | None, group: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    seq, head, split = (jax.lax.axis_index(name) for name in ("seq", "head", "split"))
    block_size = kv_ref.shape[3]
    kv_len = lens_ref[seq]
    first_page = split * pages_per_split
    lo = jnp.int32(0)
    if sliding_window is not None:  # the query at kv_len - 1 sees positions >= kv_len - window
        lo = jnp.maximum(kv_len - sliding_window, 0)
        first_page = jnp.maximum(first_page, lo // block_size)
    end_page = jnp.minimum((split + 1) * pages_per_split,
                           (kv_len + block_size - 1) // block_size)
    hi = jnp.minimum(kv_len, end_page * block_size)  # this split's keys are [lo, hi)
    num_steps = (jnp.maximum(end_page - first_page, 0) + pages_per_step - 1) // pages_per_step
    load_queries(q_ref.at[seq, head], q_smem, q_barrier)
    acc, m, l = attend_pages(
        tables_ref, kv_ref, k_smem, v_smem, p_smem, q_smem, q_barrier, kv_barriers, seq=seq,
        head=head, first_page=first_page, num_steps=num_steps,
        visible_fn=lambda pos: (pos >= lo) & (pos < hi), v_lo=lo, v_hi=hi,
        pages_per_step=pages_per_step, num_stages=num_stages, scale=scale, soft_cap=soft_cap)
    o_smem[...] = acc
    lm_smem[0] = l
    lm_smem[1] = m * (1 / LOG2E)  # back to natural-log units for combine_splits
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[split, seq, head])
    plgpu.copy_smem_to_gmem(lm_smem, lm_ref.at[split, seq, head])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "pages_per_step", "num_splits", "num_stages",
    "interpret"))
def paged_decode_attention_mosaic_gpu(
    q: jax.Array,  # [B, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, Hc] bf16 or f16, this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    num_seqs: jax.Array,  # i32[] only the first num_seqs rows are valid
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    pages_per_step: int | None = None, num_splits: int | None = None,
    num_stages: int | None = None, interpret=False,
) -> jax.Array:  # [B, N, H]; 0 for padding rows
    """pages_per_step / num_stages None: 128 keys a step and 2 stages, fewer pages while they
    overflow the GPU's shared memory (fit_pipeline). num_splits None: as the Triton kernel
    (gpu.common.choose_num_splits). interpret: True or plgpu.InterpretGPUParams runs the Mosaic
    GPU interpreter."""
    group = check_operands(q, kv_cache)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, cache_head_dim = kv_cache.shape
    rows = -(-group // ROWS) * ROWS
    width = block_tables.shape[1]
    pages_per_step, num_stages = pipeline(pages_per_step, num_stages, rows=rows,
                                          kv_cache=kv_cache)
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, width, pages_per_step)
    pages_per_split = pl.cdiv(pl.cdiv(width, num_splits), pages_per_step) * pages_per_step
    # Room for a split's last step (and a window-shifted start) to read past P.
    padded_width = pages_per_split * num_splits + pages_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    lens = jnp.where(jnp.arange(batch) < num_seqs, kv_lens, 0).astype(jnp.int32)
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(kv_cache.dtype)
    q_rows = -(-group // 8) * 8  # whole 8-row tiles for the TMA; the kernel zeroes the rest
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, q_rows - group), (0, cache_head_dim - head_dim)))

    kernel = functools.partial(
        _decode_kernel, pages_per_split=pages_per_split, pages_per_step=pages_per_step,
        num_stages=num_stages, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
        group=group)
    o, lm = plgpu.kernel(
        kernel,
        out_type=[
            jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, group, cache_head_dim),
                                 jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, 2, rows), jnp.float32),
        ],
        scratch_types=scratch(rows=rows, keys=pages_per_step * block_size,
                              head_dim=cache_head_dim, dtype=kv_cache.dtype,
                              num_stages=num_stages, pages_per_step=pages_per_step,
                              softmax_stats=True),
        grid=(batch, num_kv_heads, num_splits),
        grid_names=("seq", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        kernel_name="paged_decode_attention_mosaic_gpu",
    )(lens, tables, qg, kv_cache)
    l, m = lm[:, :, :, 0, :group], lm[:, :, :, 1, :group]
    out = combine_splits(o, l, m)[..., :head_dim]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
