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

from pallas_kernels.common import MASK_VALUE, dot_precision
from pallas_kernels.quant import QuantizedKV

MIN_DOT_SIZE = 16  # Triton's tl.dot needs every dimension >= 16

# Opt-in shared memory per thread block, by compute capability (CUDA C programming guide).
SHARED_MEMORY_LIMIT = {
    (7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024,
    (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
    (12, 0): 99 * 1024,
}
DEFAULT_TARGET = (9, 0)  # H100 / H200: what a kernel is sized for when no GPU is visible


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def target_compute_capability() -> tuple[int, int]:
    """The compute capability kernels are sized for: the default device's when that is a GPU
    (`jax.default_device(d)`, a compile-only device included: pallas_kernels/gpu_xla_aot.py),
    else the first visible GPU's; DEFAULT_TARGET on a machine without one."""
    device = jax.config.jax_default_device
    if getattr(device, "platform", None) != "gpu":
        if jax.default_backend() != "gpu":
            return DEFAULT_TARGET
        device = jax.devices()[0]
    major, minor = str(device.compute_capability).split(".")[:2]
    return int(major), int(minor)


def shared_memory_limit(capability: tuple[int, int] | None = None) -> int:
    capability = capability or target_compute_capability()
    known = [c for c in SHARED_MEMORY_LIMIT if c <= capability]
    return SHARED_MEMORY_LIMIT[max(known)] if known else min(SHARED_MEMORY_LIMIT.values())


def shared_memory_bytes(*, rows: int, keys: int, head_dim: int, cache_itemsize: int,
                        compute_itemsize: int, num_stages: int, quantized: bool) -> int:
    """An upper bound on the shared memory of one attention program: num_stages pipelined
    buffers of the K and V tiles (and their f32 scales), the query tile, the probabilities
    the second dot reads, and for a quantized cache the dequantized tile a dot reads. Triton
    shares buffers whose lifetimes do not overlap, so a build asks for less
    (tests/test_kernels_triton_compile.py checks the bound against sm_90 builds)."""
    per_stage = 2 * keys * (head_dim * cache_itemsize + (4 if quantized else 0))
    total = num_stages * per_stage + rows * (head_dim + keys) * compute_itemsize
    if quantized:
        total += keys * head_dim * compute_itemsize
    return total


def check_triton_shapes(*, block_size: int, head_dim: int, **tunables: int | None) -> None:
    """Triton's tensors have power-of-two dims: a cache in another layout lowers for the
    interpreter and fails on the GPU, so it is refused here on either, by name."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"the GPU kernels need the cache's head dim padded to a power of two "
                         f"(kv_cache_shape(..., backend='gpu')), got a cache head dim of "
                         f"{head_dim}")
    for name, value in dict(block_size=block_size, **tunables).items():
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two for the GPU kernels, got {value}")


def fit_pipeline(pages_per_step: int | None, num_stages: int | None, *, preferred_pages: int,
                 rows: int, block_size: int, head_dim: int, cache_itemsize: int,
                 compute_itemsize: int, quantized: bool,
                 limit: int | None = None) -> tuple[int, int]:
    """(pages per loop step, pipeline stages) for a kernel. What is given is taken as given;
    for what is None, the largest power of two <= preferred_pages and 2 stages, down to 1 page
    and then 1 stage, while the tiles overflow the GPU's shared memory (see
    shared_memory_bytes)."""
    limit = shared_memory_limit() if limit is None else limit

    def fits(pages, stages):
        return shared_memory_bytes(
            rows=rows, keys=pages * block_size, head_dim=head_dim, cache_itemsize=cache_itemsize,
            compute_itemsize=compute_itemsize, num_stages=stages, quantized=quantized) <= limit

    for stages in [num_stages] if num_stages is not None else [2, 1]:
        pages = preferred_pages if pages_per_step is None else pages_per_step
        while pages_per_step is None and pages > 1 and not fits(pages, stages):
            pages //= 2
        if fits(pages, stages):
            break
    return pages, stages


def online_softmax_step(q, k, v, visible, carry, *, scale: float, soft_cap: float | None):
    """One flash-attention update of (o, m, l) with a block of keys, shared by the GPU kernels.

    q [R, Hp], k and v [C*S, Hp] (already zeroed where they may hold garbage), visible: a mask
    broadcastable to [R, C*S]. Masked scores take a finite MASK_VALUE and a zero weight, so no
    inf - inf and no NaN can arise.
    """
    o, m, l = carry
    precision = dot_precision(q.dtype)
    s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * correction + jnp.sum(p, axis=1)
    o = o * correction[:, None] + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                          preferred_element_type=jnp.float32)
    return o, m_new, l


def load_pages(kv_ref, scales_ref, kv_index, head, blocks, dtype):
    """K or V of C pages as [C*S, Hp] in dtype, dequantized when the cache is int8 / fp8."""
    _, _, _, block_size, head_dim = kv_ref.shape
    rows = blocks.shape[0] * block_size
    x = kv_ref[kv_index, head, blocks].reshape(rows, head_dim)
    if scales_ref is None:
        return x
    scales = scales_ref[kv_index, head, blocks].reshape(rows)
    return (x.astype(jnp.float32) * scales[:, None]).astype(dtype)


def split_cache(kv_cache, q_dtype, interpret: bool = False):
    """(data, scales or None, compute dtype): a quantized cache is computed in the query dtype.
    An fp8 cache needs sm_89 or newer: Triton has no e4m3 conversions below (checked when
    compiling, not in the interpreter)."""
    if not isinstance(kv_cache, QuantizedKV):
        return kv_cache, None, kv_cache.dtype
    if kv_cache.scales.shape[-1] != kv_cache.data.shape[3]:
        raise ValueError(f"the GPU kernels read one scale per token of a page: scale rows of "
                         f"{kv_cache.scales.shape[-1]} for block size {kv_cache.data.shape[3]} "
                         "are the TPU layout (init_kv_cache(..., backend='gpu') makes theirs)")
    if (not interpret and jnp.dtype(kv_cache.data.dtype).name.startswith("float8")
            and target_compute_capability() < (8, 9)):
        major, minor = target_compute_capability()
        raise ValueError(f"a {kv_cache.data.dtype} KV cache needs a GPU of compute capability "
                         f">= 8.9 for the Triton kernels, this one is {major}.{minor}: use "
                         "kv_cache_dtype='int8' or the reference backend")
    return kv_cache.data, kv_cache.scales, q_dtype


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


def combine_splits(o, l, m):
    """Merges per-split partial softmaxes: o f32[X, ..., Hp], l and m f32[X, ...]."""
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_max[None])
    denom = jnp.sum(l * weight, axis=0)
    out = jnp.sum(o * weight[..., None], axis=0)
    return jnp.where(denom[..., None] > 0, out / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def choose_num_splits(num_programs: int, max_pages: int, pages_per_step: int,
                      target_programs: int = 512) -> int:
    """Splits the context only when batch x KV heads alone leaves the GPU underfilled."""
    splits = max(1, target_programs // max(num_programs, 1))
    splits = min(splits, max(1, max_pages // pages_per_step))
    return 1 << (splits.bit_length() - 1)  # a power of two, <= splits


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "pages_per_step", "num_splits", "num_warps",
    "num_stages", "interpret"))
def paged_decode_attention_gpu(
    q: jax.Array,  # [B, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, Hp], this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    num_seqs: jax.Array,  # i32[] only the first num_seqs rows are valid
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    pages_per_step: int | None = None, num_splits: int | None = None, num_warps: int = 8,
    num_stages: int | None = None, interpret: bool = False,
) -> jax.Array:  # [B, N, H]; 0 for padding rows
    """pages_per_step / num_stages None: up to 8 pages (128 keys at block 16) per loop step and
    2 pipeline stages, as many as fit the shared memory of the visible GPU (of an H100/H200
    where none is; see fit_pipeline); an explicit value is taken as given. 8 warps: at the
    benchmark's shape 4 warps need 237 registers a thread (255 with an int8 cache), 8 need 119,
    and an SM then holds 16 warps, as many as it holds of JAX's shipped kernel
    (benchmarks/results/gpu_compile.md). f32 dots follow jax.default_matmul_precision
    (dot_precision). The cache has the GPU layout: head dim and block size powers of two."""
    batch, num_heads, head_dim = q.shape
    data, scales, dtype = split_cache(kv_cache, q.dtype, interpret)
    _, num_kv_heads, _, block_size, padded_head_dim = data.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if padded_head_dim < head_dim:
        raise ValueError(f"cache head dim {padded_head_dim} < query head dim {head_dim}")
    check_triton_shapes(block_size=block_size, head_dim=padded_head_dim,
                        pages_per_step=pages_per_step)
    group = num_heads // num_kv_heads
    padded_group = max(MIN_DOT_SIZE, next_power_of_2(group))
    width = block_tables.shape[1]
    pages_per_step, num_stages = fit_pipeline(
        pages_per_step, num_stages, preferred_pages=8, rows=padded_group,
        block_size=block_size, head_dim=padded_head_dim, cache_itemsize=data.dtype.itemsize,
        compute_itemsize=jnp.dtype(dtype).itemsize, quantized=scales is not None)
    pages_per_step = min(pages_per_step, next_power_of_2(width))
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, width, pages_per_step)
    pages_per_split = pl.cdiv(pl.cdiv(width, num_splits), pages_per_step) * pages_per_step
    # Room for the last step of the last split (and a window-shifted start) to read past P.
    padded_width = pages_per_split * num_splits + pages_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    lens = jnp.where(jnp.arange(batch) < num_seqs, kv_lens, 0).astype(jnp.int32)
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
        out_specs=[
            pl.BlockSpec((None, None, None, padded_group, padded_head_dim),
                         lambda b, h, s: (s, b, h, 0, 0)),  # o
            pl.BlockSpec((None, None, None, padded_group), lambda b, h, s: (s, b, h, 0)),  # l
            pl.BlockSpec((None, None, None, padded_group), lambda b, h, s: (s, b, h, 0)),  # m
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, padded_group,
                                  padded_head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, padded_group), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, padded_group), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )(lens, tables, qg, data, *quant_operands)
    out = combine_splits(o, l, m)[:, :, :group, :head_dim]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
