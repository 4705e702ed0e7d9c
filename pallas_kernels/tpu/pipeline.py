"""The TPU kernels' page pipeline: block-table rows fetched into SMEM, K/V pages double-buffered
from HBM into VMEM by DMA (PagePipeline), the compute dtype of a cache, and the loop that folds
chunks of pages into the online softmax (attend_chunk, attend_blocks). Shared by the decode and
ragged kernels."""

from __future__ import annotations

import copy
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pagedjax.pallas_kernels.common import MASK_VALUE, online_softmax_step, sink_rows
from pagedjax.pallas_kernels.quant import QuantizedKV

SUBLANES = 8
TABLE_ALIGN = 128  # block-table rows padded to whole lane tiles, so each row DMA is aligned
KEYS_PER_STEP = 128


def default_pages_per_step(block_size: int) -> int:
    """Pages per compute block: 128 keys. Read from the compiled schedule on v5e
    (tpu_schedule.md): the decode loop then issues for more than v5e's HBM bandwidth at block
    16 (a larger block only fetches more of a sequence's last block for nothing), and the
    ragged loop takes 1.8x fewer bundles per query-row x key than at 64 keys."""
    return max(1, KEYS_PER_STEP // block_size)


def table_width(width: int, pages_per_step: int) -> int:
    """Padded width of a block-table row: whole compute blocks and whole lane tiles."""
    unit = math.lcm(pages_per_step, TABLE_ALIGN)
    return pl.cdiv(width, unit) * unit


def flat_tables(block_tables: jax.Array, padded_width: int) -> jax.Array:
    """i32[B * Pp]: the block tables, rows padded with the null block, kept in HBM."""
    width = block_tables.shape[1]
    return jnp.pad(block_tables.astype(jnp.int32),
                   ((0, 0), (0, padded_width - width))).reshape(-1)


def fetch_table_row(tables_hbm_ref, seq, row_ref, sem, head):
    """Copies one sequence's block-table row from HBM into SMEM, once a sequence: the KV-head
    axis is the grid's inner, sequential one (compiler_params), so the row fetched by head 0
    is still in SMEM for the others. The whole table, scalar-prefetched, outgrows SMEM (1 MB
    on v5e) at 128 sequences x 32k tokens of context."""
    width = row_ref.shape[0]

    @pl.when(head == 0)
    def _():
        copy = pltpu.make_async_copy(
            tables_hbm_ref.at[pl.ds(pl.multiple_of(seq * width, TABLE_ALIGN), width)], row_ref,
            sem)
        copy.start()
        copy.wait()


def compiler_params():
    """Grid (sequences or tiles, KV heads): the first axis may be split across TensorCores,
    the KV-head axis runs in order on one (fetch_table_row relies on it).

    Bounds checks are off in compiled kernels: Mosaic checks every DMA's source and
    destination with a chain of scalar compares that took 2/3 of the decode loop
    (tpu_schedule.md). Page ids come from the scheduler's block tables (tested against the
    pool); interpret mode still raises on any out-of-bounds read (tpu_interpret_params)."""
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                disable_bounds_checks=True)


class PagePipeline:
    """Double-buffered page DMAs of one (sequence, KV head), C pages per compute block into one
    slot of the VMEM buffers: one DMA a page carries its K and V rows together (the cache's
    leading K/V axis, strided), and for a quantized cache one more its scales. Issuing a DMA is
    scalar work (addresses, descriptors), done beside the block's vector work (fetch)."""

    def __init__(self, kv_hbm_ref, scales_hbm_ref, buffers, sem, table_row_ref, *, head,
                 pages_per_step: int):
        self.sources = [kv_hbm_ref] + ([] if scales_hbm_ref is None else [scales_hbm_ref])
        self.buffers = buffers  # [kv_buf (, kv_scales_buf)] as made by page_scratch
        self.sem = sem  # DMA[2], one per slot
        self.table_row_ref = table_row_ref  # SMEM i32[Pp]: this sequence's block-table row
        self.head, self.pages_per_step = head, pages_per_step

    def for_head(self, head) -> "PagePipeline":
        other = copy.copy(self)
        other.head = head
        return other

    def start_first_block(self, first_block, num_blocks):
        """Starts this program's first compute block, into slot 0, unless the previous program
        (the sequence's previous KV head) already did: see prefetch_next_head."""
        @pl.when((self.head == 0) & (first_block < num_blocks))
        def _():
            self.start(first_block, 0)

    def prefetch_next_head(self, first_block, num_blocks, num_heads):
        """Starts the next KV head's first compute block (same sequence, same pages, so same
        first_block and num_blocks) once this program's loop is done, so its latency overlaps
        this program's epilogue instead of stalling the next one's first wait. The KV-head
        axis is sequential (compiler_params), so the next program is that head's."""
        @pl.when((self.head + 1 < num_heads) & (first_block < num_blocks))
        def _():
            self.for_head(self.head + 1).start(first_block, 0)

    def start(self, block, slot):
        base = block * self.pages_per_step
        for c in range(self.pages_per_step):
            page = self.table_row_ref[base + c]
            for src, buf in zip(self.sources, self.buffers):
                pltpu.make_async_copy(src.at[:, self.head, page], buf.at[slot, :, c],
                                      self.sem.at[slot]).start()

    def wait(self, slot):
        """Waits for the whole slot: a DMA semaphore counts bytes, so one wait sized as a
        slot's buffer covers its C page copies."""
        for buf in self.buffers:
            whole = buf.at[slot]
            pltpu.make_async_copy(whole, whole, self.sem.at[slot]).wait()

    def fetch(self, block, first_block, num_blocks, dtype, *, prefetch: bool | None):
        """Compute block `block` loaded from its slot (chunk), then block + 1 started into the
        other slot, in flight while this one is computed. `prefetch` says whether there is a
        block + 1: True or False where the caller knows (attend_blocks' loops), None to test
        it here. The order and a known answer let the scheduler issue the next block's DMAs
        (scalar work) beside this block's vector work: started before the loads, or under a
        branch, they came first and the loop was their sum (tpu_schedule.md)."""
        # block >= first_block: the low bit is the slot (one scalar op; `% 2` of a signed
        # int is a serial chain of eight that fixes up negative remainders).
        slot = jnp.bitwise_and(block - first_block, 1)
        self.wait(slot)
        chunk = self.chunk(slot, dtype)
        if prefetch is None:
            @pl.when(block + 1 < num_blocks)
            def _():
                self.start(block + 1, 1 - slot)
        elif prefetch:
            self.start(block + 1, 1 - slot)
        return chunk

    def chunk(self, slot, dtype):
        """The compute block as (K [C*S, H], V [C*S, H] in `dtype`, the dots' operand type;
        K scales, V scales f32 [1, C*S] or None). A latent cache's one plane is both: its
        whole row the value (the caller keeps the latent's columns of the output). 8-bit pages are widened through f32, whose
        tiles hold whole pages, so that joining them into one [C*S, H] tile costs nothing. A
        quantized cache's scales come as [1, C*S] rows, joined along lanes from the pages'
        [1, S] rows (Mosaic cannot reshape the [C, S] buffer into a row or a column), and
        scale the scores and the probabilities rather than K and V."""
        kv_buf = self.buffers[0]
        _, _, pages, block_size, head_dim = kv_buf.shape
        rows = pages * block_size
        wide = jnp.float32 if kv_buf.dtype.itemsize == 1 else kv_buf.dtype
        planes = kv_buf.shape[1]
        k = kv_buf[slot, 0].astype(wide).reshape(rows, head_dim).astype(dtype)
        v = kv_buf[slot, 1].astype(wide).reshape(rows, head_dim).astype(dtype) if planes == 2 \
            else k
        if len(self.buffers) == 1:
            return k, v, None, None
        scales = self.buffers[1]

        def row(kv):  # the scale rows may be padded past S (layout.scale_lanes)
            return jnp.concatenate(
                [scales[slot, kv, pl.ds(c, 1)][:, :block_size] for c in range(pages)], axis=1)

        return k, v, row(0), row(planes - 1)


def compute_dtype(cache_dtype, q_dtype):
    """The dots' operand type: the cache's own (bf16 K/V go to the MXU as they are, with f32
    accumulation, as the GPU kernels do); a quantized cache is widened to the query's type
    (int8 and e4m3 values are exact in bf16)."""
    if jnp.issubdtype(cache_dtype, jnp.floating) and jnp.dtype(cache_dtype).itemsize >= 2:
        return jnp.dtype(cache_dtype)
    return jnp.dtype(q_dtype)


def split_quantized(kv_cache):
    """(data, scales or None) of a layer's cache."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.data, kv_cache.scales
    return kv_cache, None


def check_operands(q, kv_cache):
    """(cache data, its scales or None, the GQA group) of what the TPU kernels read for q
    [.., N, H]; refused by name where the heads do not divide or the head dims differ (the TPU
    layout pads none)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    data, scales = split_quantized(kv_cache)
    num_kv_heads, cache_head_dim = data.shape[1], data.shape[4]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if cache_head_dim not in (head_dim, -(-head_dim // 128) * 128):
        raise ValueError(f"cache head dim {cache_head_dim} is neither the query's {head_dim} "
                         f"nor it padded to whole 128-lane tiles (layout.cache_head_dim)")
    return data, scales, num_heads // num_kv_heads


def padded_heads(x: jax.Array, cache_head_dim: int) -> jax.Array:
    """x [.., H] zero-padded to the cache's head dim (layout.cache_head_dim: whole lane tiles);
    zeros change no score, and the output's extra columns are dropped."""
    pad = cache_head_dim - x.shape[-1]
    return x if not pad else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def page_scratch(pages_per_step: int, block_size: int, head_dim: int, data, scales) -> list:
    """VMEM double buffers for PagePipeline: [slot, K/V, C, S, H] pages (and [slot, K/V, C, Ss]
    scale rows); a latent cache's one plane in place of K/V."""
    planes = data.shape[0]
    shapes = [pltpu.VMEM((2, planes, pages_per_step, block_size, head_dim), data.dtype)]
    if scales is not None:
        shapes.append(pltpu.VMEM((2, planes, pages_per_step, scales.shape[-1]), jnp.float32))
    return shapes


def attend_chunk(q, chunk, first_key, carry, *, key_live, visible, scale, soft_cap,
                 zero_v: bool = True):
    """Masks one chunk from PagePipeline.fetch and folds it into the softmax carry.
    key_live(pos) says which key positions exist (anything past them may be NaN), and
    visible(pos [1, n]) which the rows see (never a key that is not live); pos are absolute.
    zero_v=False skips zeroing V where keys are not live, for blocks that hold none
    (attend_blocks): a select on every 16-bit V tile is most of a loop's vector work."""
    k, v, k_scales, v_scales = chunk
    n = k.shape[0]
    # Positions as a row and as a column: no transpose, which Mosaic may not lay out.
    row = first_key + jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
    col = first_key + jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    if zero_v:
        v = jnp.where(key_live(col), v, jnp.zeros_like(v))  # 0 x NaN would reach the output
    if k_scales is not None:
        k_scales = jnp.where(key_live(row), k_scales, 0.0)
        v_scales = jnp.where(key_live(row), v_scales, 0.0)
    return online_softmax_step(q, k, v, visible(row), carry, scale=scale, soft_cap=soft_cap,
                               k_scales=k_scales, v_scales=v_scales)


def attend_blocks(body, first_block, num_blocks, init, *, edge_first: bool):
    """fori_loop of body(block, carry, zero_v=, prefetch=) over [first_block, num_blocks), in
    up to three loops so that each knows statically what its blocks need: V is zeroed only in
    the last block, the one that may reach past the sequence's keys into garbage (and with
    edge_first, a sliding window, in the first one too, whose pages before the window may
    have gone back to the pool), and every block but the last prefetches its successor
    (PagePipeline.fetch)."""
    head_end = jnp.minimum(first_block + 1, num_blocks) if edge_first else first_block
    tail_start = jnp.maximum(num_blocks - 1, head_end)
    carry = init
    if edge_first:
        carry = jax.lax.fori_loop(first_block, head_end,
                                  functools.partial(body, zero_v=True, prefetch=None), carry)
    carry = jax.lax.fori_loop(head_end, tail_start,
                              functools.partial(body, zero_v=False, prefetch=True), carry)
    return jax.lax.fori_loop(tail_start, num_blocks,
                             functools.partial(body, zero_v=True, prefetch=False), carry)


def attend_sequence(pipeline: PagePipeline, q, first_block, num_blocks, block_k: int, dtype, *,
                    key_live, visible, scale: float, soft_cap: float | None,
                    sliding_window: int | None, sinks=None):
    """q's rows [R, H] attended over the pipeline's compute blocks [first_block, num_blocks)
    (attend_blocks over attend_chunk, started by pipeline.start_first_block), normalised: f32
    [R, H], 0 for a row that sees no key. sinks: f32[R, 1], each row's attention sink (a logit
    in the denominator with no value: the running max starts at it, the sum at 1), or None.
    Then prefetches the next head's first block."""
    num_rows, head_dim = q.shape

    def body(block, carry, zero_v, prefetch):
        chunk = pipeline.fetch(block, first_block, num_blocks, dtype, prefetch=prefetch)
        return attend_chunk(q, chunk, block * block_k, carry, key_live=key_live,
                            visible=visible, scale=scale, soft_cap=soft_cap, zero_v=zero_v)

    m0, l0 = jnp.full((num_rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((num_rows, 1),
                                                                          jnp.float32)
    if sinks is not None:
        m0, l0 = sinks, jnp.ones((num_rows, 1), jnp.float32)
    init = (jnp.zeros((num_rows, head_dim), jnp.float32), m0, l0)
    o, _, l = attend_blocks(body, first_block, num_blocks, init,
                            edge_first=sliding_window is not None)
    pipeline.prefetch_next_head(first_block, num_blocks, pl.num_programs(1))
    return jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)


def sink_operands(sinks, num_kv_heads: int, group: int, padded_group: int, tokens: int):
    """([rows], [their BlockSpec]) of a kernel whose programs take a KV head's rows, tokens x
    padded_group of them (token-major): f32[K, rows, 1], each row its query head's sink
    (common.sink_rows); ([], []) without sinks."""
    if sinks is None:
        return [], []
    per_head = sink_rows(sinks, num_kv_heads, group, padded_group)
    rows = jnp.tile(per_head, (1, tokens))[..., None]  # [K, tokens * Gp, 1]
    spec = pl.BlockSpec((None, tokens * padded_group, 1), lambda i, h, *_: (h, 0, 0))
    return [rows], [spec]
