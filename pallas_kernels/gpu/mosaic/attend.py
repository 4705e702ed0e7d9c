"""The loop both Mosaic GPU attention kernels run (attend_pages) and the tiles it runs on.

A program copies its query rows (padded to 8 rows in HBM, to R = 64 in shared memory, one
warpgroup's WGMMA tile) into shared memory once, then walks the pages of its sequence's block table
below kv_len, C pages a step: each page of K and of V is one TMA copy from the block table's
physical block straight into its row range of a [C*S, Hc] tile, num_stages steps in flight, one
barrier a step. Scores are a WGMMA of the [R, Hc] queries by the K tile, the online softmax runs in
registers (base 2, the scale and log2(e) folded into one multiply), and the probabilities go
through shared memory into a second WGMMA with the V tile. Slots past kv_len (or before a sliding
window) may hold anything, NaN included: their scores are masked by a select, and V rows outside
[lo, hi) are zeroed in shared memory on the steps that hold any (a sequence's last step; its
first under a window), since 0 * NaN would reach the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pagedjax.pallas_kernels.common import MASK_VALUE
from pagedjax.pallas_kernels.gpu.common import shared_memory_limit
from pagedjax.pallas_kernels.gpu.mosaic.common import LOG2E, MIN_KEYS


def swizzle_bytes(row_bytes: int) -> int:
    """The widest TMA/WGMMA swizzle (128, 64 or 32 bytes) a tile row of row_bytes fills."""
    for swizzle in (128, 64, 32):
        if row_bytes % swizzle == 0:
            return swizzle
    raise ValueError(f"a tile row of {row_bytes} bytes is not a multiple of 32: the Mosaic GPU "
                     "kernel needs a cache head dim and a step of keys of at least 16 (bf16)")


def shared_memory_bytes(*, rows: int, keys: int, head_dim: int, itemsize: int,
                        num_stages: int, softmax_stats: bool = True) -> int:
    """A program's shared memory as Mosaic GPU allocates it: queries, num_stages K and V
    tiles, the probabilities, the f32 output rows, softmax sums and maxima (decode's, for
    combining splits), and two barrier arrays, each allocation aligned to 1 KiB
    (tests/kernels/test_kernels_mosaic_gpu.py checks this against the H200 builds' figures)."""
    allocations = [rows * head_dim * itemsize, num_stages * keys * head_dim * itemsize,
                   num_stages * keys * head_dim * itemsize, rows * keys * itemsize,
                   rows * head_dim * 4, 2 * rows * 4 if softmax_stats else 0, 8,
                   8 * num_stages]
    return sum(-(-size // 1024) * 1024 for size in allocations)


def fit_pipeline(pages_per_step: int | None, num_stages: int | None, *, rows: int,
                 block_size: int, head_dim: int, itemsize: int,
                 limit: int | None = None) -> tuple[int, int]:
    """(pages a step, stages): given values are taken as given; otherwise 128 keys a step (at
    least one page) and 2 stages, fewer pages (down to MIN_KEYS keys) while the tiles overflow
    the shared memory."""
    limit = shared_memory_limit() if limit is None else limit
    stages = 2 if num_stages is None else num_stages
    pages = max(1, 128 // block_size) if pages_per_step is None else pages_per_step
    while pages_per_step is None and pages * block_size > MIN_KEYS and shared_memory_bytes(
            rows=rows, keys=pages * block_size, head_dim=head_dim, itemsize=itemsize,
            num_stages=stages) > limit:
        pages //= 2
    return pages, stages


def pipeline(pages_per_step, num_stages, *, rows, kv_cache) -> tuple[int, int]:
    """fit_pipeline for this cache, with its values checked."""
    block_size, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    pages_per_step, num_stages = fit_pipeline(
        pages_per_step, num_stages, rows=rows, block_size=block_size, head_dim=head_dim,
        itemsize=jnp.dtype(kv_cache.dtype).itemsize)
    if pages_per_step < 1 or num_stages < 1:
        raise ValueError(f"pages_per_step and num_stages must be >= 1, got {pages_per_step} "
                         f"and {num_stages}")
    if (pages_per_step * block_size) % MIN_KEYS:
        raise ValueError(f"pages_per_step x block_size ({pages_per_step} x {block_size}) must be "
                         f"a multiple of {MIN_KEYS} keys for the Mosaic GPU kernels")
    return pages_per_step, num_stages


def scratch(*, rows: int, keys: int, head_dim: int, dtype, num_stages: int,
            pages_per_step: int, softmax_stats: bool) -> list:
    """The shared memory of one program (see shared_memory_bytes) and its barriers."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize

    def tiled(shape, row_elems):
        swizzle = swizzle_bytes(row_elems * itemsize)
        return plgpu.SMEM(shape, dtype, transforms=(
            plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))

    return [
        tiled((rows, head_dim), head_dim),  # queries
        tiled((num_stages, keys, head_dim), head_dim),  # K
        tiled((num_stages, keys, head_dim), head_dim),  # V
        tiled((rows, keys), keys),  # probabilities
        plgpu.SMEM((rows, head_dim), jnp.float32),  # output rows
        *([plgpu.SMEM((2, rows), jnp.float32)] if softmax_stats else []),  # sums and maxima
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=2 * pages_per_step, num_barriers=num_stages),
    ]


def load_queries(q_ref, q_smem, q_barrier):
    """Copies a program's query rows into q_smem; rows of q_smem past them are zeroed first (the
    fence orders the zeroing before the TMA's writes)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, head_dim = q_smem.shape
    q_rows = q_ref.shape[0]
    if q_rows < rows:
        q_smem[...] = plgpu.layout_cast(jnp.zeros((rows, head_dim), q_smem.dtype),
                                        plgpu.Layout.WGMMA)
        plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(q_ref, q_smem.at[pl.ds(0, q_rows)], q_barrier.at[0])


def attend_pages(tables_ref, kv_ref, k_smem, v_smem, p_smem, q_smem, q_barrier, kv_barriers, *,
                 seq, head, first_page, num_steps, visible_fn, v_lo, v_hi,
                 pages_per_step: int, num_stages: int, scale: float, soft_cap: float | None):
    """The online softmax of q_smem's rows over pages first_page .. of the sequence's block table,
    pages_per_step a step, num_stages steps of TMA copies in flight. visible_fn(pos) masks the
    [R, keys] scores at key positions pos; V rows outside [v_lo, v_hi) are zeroed before they are
    weighted (slots there may hold NaN). Returns (acc, m, l), m in base-2 units."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    block_size = kv_ref.shape[3]
    rows, head_dim = q_smem.shape
    keys = pages_per_step * block_size

    def fetch(step):
        slot = jax.lax.rem(step, num_stages)
        page = first_page + step * pages_per_step
        for p in range(pages_per_step):
            block = tables_ref[seq, page + p]
            rows_p = pl.ds(p * block_size, block_size)
            plgpu.copy_gmem_to_smem(kv_ref.at[0, head, block], k_smem.at[slot, rows_p],
                                    kv_barriers.at[slot])
            plgpu.copy_gmem_to_smem(kv_ref.at[1, head, block], v_smem.at[slot, rows_p],
                                    kv_barriers.at[slot])

    for step in range(num_stages - 1):
        pl.when(step < num_steps)(functools.partial(fetch, step))
    plgpu.barrier_wait(q_barrier.at[0])
    # Scores in base 2: exp2(s * scale * log2 e) = exp(s * scale).
    scale2 = scale * LOG2E

    def body(step, carry):
        acc, m, l = carry
        slot = jax.lax.rem(step, num_stages)
        # The slot this fetch fills was read by the previous step's two WGMMAs, which are done:
        # their accumulators were read.
        ahead = step + num_stages - 1
        pl.when(ahead < num_steps)(functools.partial(fetch, ahead))
        plgpu.barrier_wait(kv_barriers.at[slot])
        start = (first_page + step * pages_per_step) * block_size

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((rows, keys), jnp.float32))
        if soft_cap is not None:
            s = (soft_cap * LOG2E) * jnp.tanh(s * (scale / soft_cap))
        else:
            s = s * scale2
        pos = start + plgpu.broadcasted_iota(jnp.int32, (rows, keys), 1,
                                             layout=plgpu.Layout.WGMMA)
        visible = visible_fn(pos)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(visible, jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = l * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

        @pl.when((start < v_lo) | (start + keys > v_hi))
        def _zero_v_outside():
            v = v_smem[slot]
            row = start + plgpu.broadcasted_iota(jnp.int32, v.shape, 0,
                                                 layout=plgpu.Layout.WGMMA)
            v_smem[slot] = jnp.where((row >= v_lo) & (row < v_hi), v, jnp.zeros_like(v))

        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()  # the probabilities (and a zeroed V) are visible to the WGMMA

        def weighted_values(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        acc = acc + pl.run_scoped(weighted_values, plgpu.ACC((rows, head_dim), jnp.float32))
        return acc, m_new, l

    acc = plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((rows,), MASK_VALUE, jnp.float32),
                          plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    return jax.lax.fori_loop(0, num_steps, body, (acc, m, l))
