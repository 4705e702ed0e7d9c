"""Paged attention for Hopper GPUs: Pallas with the Mosaic GPU lowering (TMA + WGMMA).

The algorithms of gpu_decode (split-K flash-decoding) and gpu_prefill (ragged tiles of query
tokens) over the block tables, written for the lowering JAX develops now; Pallas' Triton lowering
is deprecated upstream. Axis letters as in gpu_decode; R = 64 rows, one warpgroup's WGMMA tile.

Both kernels share one loop (attend_pages), described here for decode.

Grid (B, K, num_splits), one warpgroup a program. A program copies its query-head group (padded
to 8 rows in HBM, to R in shared memory) into shared memory once, then walks only the pages
below the sequence's kv_len, C pages a step: each page of K and of V is one TMA copy from the
block table's physical block straight into its row range of a [C*S, Hc] tile, num_stages steps
in flight, one barrier a step. Scores are a WGMMA of
the [R, Hc] queries by the K tile, the online softmax runs in registers (base 2, the scale and
log2(e) folded into one multiply), and the probabilities go through shared memory into a second
WGMMA with the V tile. Slots past kv_len (or before a sliding window) may hold anything, NaN
included: their scores are masked by a select, and V rows outside [lo, hi) are zeroed in shared
memory on the steps that hold any (a sequence's last step; its first under a window), since
0 * NaN would reach the output. Each program writes its G real rows' unnormalised output with
its softmax sums and maxima; gpu_decode.combine_splits merges the splits.

The ragged kernel (chunked prefill, mixed steps) takes tiles of R // Gp query tokens x the GQA
group Gp (a power of two) as its R rows, never spanning two sequences (gpu_prefill.tile_layout),
attends causally inside the chunk and fully to the cached prefix, and writes its normalised tile,
which the wrapper gathers back into token order. The wrapper gathers each tile's query rows
first ([NT, K, R, Hc]), so a tile's rows are one TMA copy.

write_kv_mosaic_gpu writes the step's K/V into their slots in place, one program a token.

Needs jax >= 0.11 (the Mosaic GPU interpreter tests it on a CPU: tests/test_kernels_mosaic_gpu.py)
and runs on sm_90 (H100/H200) and newer. 16-bit caches (bf16, f16) only: f32 and quantized
caches are refused by name; the Triton kernels (backend 'gpu') serve them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import MASK_VALUE, tile_layout
from pallas_kernels.gpu_decode import (choose_num_splits, combine_splits, next_power_of_2,
                                       shared_memory_limit)
from pallas_kernels.quant import QuantizedKV

ROWS = 64  # one warpgroup's WGMMA tile height: a query-head group is padded to a multiple
# Keys a step: a multiple of 64, since the V tile a step zeroes past kv_len is held in the WGMMA
# register layout, whose tiles are 64 rows (the interpreter, which ignores layouts, would take
# 16; Mosaic GPU's lowering refuses it: benchmarks/gpu_xla_compile.py found it).
MIN_KEYS = 64
LOG2E = math.log2(math.e)
DTYPES = ("bfloat16", "float16")


def problem() -> str | None:
    """Why these kernels cannot run with the installed jax, or None."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # pragma: no cover - jax always ships it
        return f"jax {jax.__version__} has no Pallas Mosaic GPU: {e}"
    if not hasattr(plgpu, "InterpretGPUParams"):
        return (f"the Mosaic GPU kernels need jax >= 0.11 (their interpreter and lowering "
                f"are tested there); this is jax {jax.__version__}: use attention_backend='gpu'")
    return None


def interpret_params(interpret):
    """interpret=True -> the Mosaic GPU interpreter's default parameters."""
    if interpret is True:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.InterpretGPUParams()
    return interpret or None


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
    (tests/test_kernels_mosaic_gpu.py checks this against the H200 builds' figures)."""
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


def _ragged_kernel(tile_seq_ref, tile_start_ref, cu_q_lens_ref, lens_ref, tables_ref, q_ref,
                   kv_ref, o_ref, q_smem, k_smem, v_smem, p_smem, o_smem, q_barrier,
                   kv_barriers, *, group_shift: int, pages_per_step: int, num_stages: int,
                   scale: float, sliding_window: int | None, soft_cap: float | None):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile, head = jax.lax.axis_index("tile"), jax.lax.axis_index("head")
    block_size = kv_ref.shape[3]
    rows, head_dim = q_smem.shape
    tile_q = rows >> group_shift
    seq = tile_seq_ref[tile]
    live = seq >= 0
    seq = jnp.maximum(seq, 0)
    start = tile_start_ref[tile]
    q_begin, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    kv_len = lens_ref[seq]
    offset = kv_len - (q_end - q_begin)  # the position of the chunk's first token
    last_pos = offset + jnp.minimum(start + tile_q, q_end) - 1 - q_begin
    first_page = jnp.int32(0)
    if sliding_window is not None:
        first_page = jnp.maximum(offset + start - q_begin - sliding_window + 1, 0) // block_size
    end_page = jnp.where(live, (last_pos + block_size) // block_size, 0)
    num_steps = (jnp.maximum(end_page - first_page, 0) + pages_per_step - 1) // pages_per_step

    # Row r holds token start + r // Gp of the tile; rows past the sequence's last token see
    # nothing (their last visible position is -1). Per-row values are kept as row vectors and
    # broadcast: [R, keys] int32 tiles cost 64 registers a thread each.
    token = start + jax.lax.shift_right_logical(
        plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=plgpu.Layout.WGMMA.reduce(1)),
        jnp.int32(group_shift))
    q_pos = jnp.where(token < q_end, offset + token - q_begin, -1)

    def visible_fn(pos):
        visible = pos <= jax.lax.broadcast_in_dim(q_pos, pos.shape, [0])
        if sliding_window is not None:
            visible &= pos > jax.lax.broadcast_in_dim(q_pos - sliding_window, pos.shape, [0])
        return visible

    load_queries(q_ref.at[tile, head], q_smem, q_barrier)
    acc, _, l = attend_pages(
        tables_ref, kv_ref, k_smem, v_smem, p_smem, q_smem, q_barrier, kv_barriers, seq=seq,
        head=head, first_page=first_page, num_steps=num_steps, visible_fn=visible_fn,
        v_lo=jnp.int32(0), v_hi=last_pos + 1, pages_per_step=pages_per_step,
        num_stages=num_stages, scale=scale, soft_cap=soft_cap)
    safe_l = jnp.where(l > 0, l, 1.0)
    o_smem[...] = jnp.where(jax.lax.broadcast_in_dim(l > 0, acc.shape, [0]),
                            acc / jax.lax.broadcast_in_dim(safe_l, acc.shape, [0]), 0.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[tile, head])
    plgpu.wait_smem_to_gmem(0)


def check_operands(q, kv_cache) -> int:
    """Refuses what the Mosaic GPU kernels cannot read, by name; returns the GQA group."""
    if (reason := problem()) is not None:
        raise ValueError(reason)
    check_cache(kv_cache, q.shape[-1])
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    return num_heads // num_kv_heads


def check_cache(kv_cache, head_dim: int) -> None:
    if isinstance(kv_cache, QuantizedKV):
        raise ValueError("the Mosaic GPU kernels read 16-bit caches; a quantized "
                         f"({kv_cache.data.dtype}) cache needs attention_backend='gpu'")
    if jnp.dtype(kv_cache.dtype).name not in DTYPES:
        raise ValueError(f"the Mosaic GPU kernels read {'/'.join(DTYPES)} caches, got "
                         f"{kv_cache.dtype}: use attention_backend='gpu' (or dtype='bfloat16')")
    _, _, _, block_size, cache_head_dim = kv_cache.shape
    if block_size % 8:
        raise ValueError(f"the Mosaic GPU kernels need a block size that is a multiple of 8 "
                         f"(their tiles have 8-row tiles), got {block_size}")
    if cache_head_dim < head_dim:
        raise ValueError(f"cache head dim {cache_head_dim} < query head dim {head_dim}")


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
    (gpu_decode.choose_num_splits). interpret: True or plgpu.InterpretGPUParams runs the Mosaic
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
    pages_per_split = -(-(-(-width // num_splits)) // pages_per_step) * pages_per_step
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


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "pages_per_step", "num_stages", "interpret"))
def ragged_paged_attention_mosaic_gpu(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, Hc] bf16 or f16, this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    cu_q_lens: jax.Array,  # i32[B + 1]
    num_seqs: jax.Array,  # i32[]
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    pages_per_step: int | None = None, num_stages: int | None = None, interpret=False,
) -> jax.Array:  # [T, N, H]; 0 for padding tokens
    """A tile is R // Gp query tokens (16 at GQA 4, 64 for MHA); pages_per_step / num_stages as
    in paged_decode_attention_mosaic_gpu."""
    group = check_operands(q, kv_cache)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, cache_head_dim = kv_cache.shape
    padded_group = next_power_of_2(group)
    rows = max(ROWS, padded_group)
    tile_q = rows // padded_group
    width = block_tables.shape[1]
    pages_per_step, num_stages = pipeline(pages_per_step, num_stages, rows=rows,
                                          kv_cache=kv_cache)
    padded_width = (-(-width // pages_per_step) + 1) * pages_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_seq, tile_start, token_tile, token_row = tile_layout(cu_q_lens, num_seqs, num_tokens,
                                                              tile_q)
    num_tiles = tile_seq.shape[0]
    # [NT, K, R, Hc]: each tile's rows (tokens x group) gathered, so that a program's TMA copy
    # starts at a tile boundary (Mosaic GPU must prove a copy's row offset is a multiple of its
    # 8-row tiles; a tile starts at any token).
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(kv_cache.dtype)
    qg = jnp.pad(qg, ((0, tile_q), (0, 0), (0, padded_group - group),
                      (0, cache_head_dim - head_dim)))
    qt = qg[tile_start[:, None] + jnp.arange(tile_q, dtype=jnp.int32)[None]]
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, cache_head_dim)

    kernel = functools.partial(
        _ragged_kernel, group_shift=padded_group.bit_length() - 1,
        pages_per_step=pages_per_step, num_stages=num_stages, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    tiles = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, cache_head_dim),
                                      jnp.float32),
        scratch_types=scratch(rows=rows, keys=pages_per_step * block_size,
                              head_dim=cache_head_dim, dtype=kv_cache.dtype,
                              num_stages=num_stages, pages_per_step=pages_per_step,
                              softmax_stats=False),
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        kernel_name="ragged_paged_attention_mosaic_gpu",
    )(tile_seq, tile_start, cu_q_lens, kv_lens.astype(jnp.int32), tables, qt, kv_cache)
    tiles = tiles.reshape(num_tiles, num_kv_heads, tile_q, padded_group, cache_head_dim)
    out = tiles[token_tile, :, token_row][:, :, :group, :head_dim]  # [T, K, G, H]
    live = jnp.arange(num_tokens) < cu_q_lens[num_seqs]
    out = jnp.where(live[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_mosaic_gpu(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc] bf16 or f16
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block
    *, interpret=False,
) -> jax.Array:
    """The step's K/V into their slots, in place: one program a token copies its K and V rows
    (TMA) into shared memory and from there into its slot under every KV head. The kernel
    mutates the cache as a Ref (pl.kernel under pl.run_state), so the cache is the custom
    call's aliased output; under a jit that donates it no copy of the pool is made."""
    if (reason := problem()) is not None:
        raise ValueError(reason)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    check_cache(kv_cache, k.shape[-1])
    _, num_kv_heads, _, block_size, cache_head_dim = kv_cache.shape
    pad = ((0, 0), (0, 0), (0, cache_head_dim - k.shape[-1]))
    k, v = (jnp.pad(x.astype(kv_cache.dtype), pad) for x in (k, v))
    mesh = plgpu.Mesh(grid=(k.shape[0],), grid_names=("token",))

    def stateful(refs):
        cache_ref, k_ref, v_ref, slots_ref = refs

        def _write():
            token = jax.lax.axis_index("token")
            slot = slots_ref[token]
            block = jax.lax.div(slot, block_size)  # slot >= 0
            offset = jax.lax.rem(slot, block_size)

            def copy(kv_smem, barrier):
                plgpu.copy_gmem_to_smem(k_ref.at[token], kv_smem.at[0], barrier)
                plgpu.copy_gmem_to_smem(v_ref.at[token], kv_smem.at[1], barrier)
                plgpu.barrier_wait(barrier)
                # [K, Hc]: a row per KV head, NB x S x Hc apart in the cache.
                plgpu.copy_smem_to_gmem(kv_smem.at[0], cache_ref.at[0, :, block, offset])
                plgpu.copy_smem_to_gmem(kv_smem.at[1], cache_ref.at[1, :, block, offset])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(copy, plgpu.SMEM((2, num_kv_heads, cache_head_dim), kv_cache.dtype),
                          plgpu.Barrier(num_arrivals=2))

        pl.kernel(_write, out_type=(), mesh=mesh, compiler_params=plgpu.CompilerParams(),
                  interpret=interpret_params(interpret), name="write_kv_mosaic_gpu")()

    cache, *_ = pl.run_state(stateful)((kv_cache, k, v, slot_mapping.astype(jnp.int32)))
    return cache

