"""The Triton kernels' tiles: power-of-two shapes, the shared memory of a pipeline of K/V pages,
loading (and dequantizing) pages through the block table, and the cache operands they read."""

from __future__ import annotations

import jax.numpy as jnp

from pagedjax.pallas_kernels.gpu import common as gpu_common
from pagedjax.pallas_kernels.quant import QuantizedKV

MIN_DOT_SIZE = 16  # Triton's tl.dot needs every dimension >= 16
# Rows x head dim of one program's query tile: 16 tokens x a GQA group of 4 x 128, the shape
# whose f32 accumulator 8 warps hold without spilling (benchmarks/results/gpu_compile.md).
MAX_TILE_ELEMENTS = 64 * 128


def shared_memory_bytes(*, rows: int, keys: int, head_dim: int, cache_itemsize: int,
                        compute_itemsize: int, num_stages: int, quantized: bool,
                        planes: int = 2) -> int:
    """An upper bound on the shared memory of one attention program: num_stages pipelined
    buffers of the K and V tiles (and their f32 scales), the query tile, the probabilities
    the second dot reads, and for a quantized cache the dequantized tile a dot reads. Triton
    shares buffers whose lifetimes do not overlap, so a build asks for less
    (tests/kernels/test_kernels_triton_compile.py checks the bound against sm_90 builds). planes 1: a
    latent cache, whose one tile is both K and V."""
    per_stage = planes * keys * (head_dim * cache_itemsize + (4 if quantized else 0))
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
                 compute_itemsize: int, quantized: bool, planes: int = 2,
                 limit: int | None = None) -> tuple[int, int]:
    """(pages per loop step, pipeline stages) for a kernel. What is given is taken as given;
    for what is None, the largest power of two <= preferred_pages and 2 stages, down to 1 page
    and then 1 stage, while the tiles overflow the GPU's shared memory (see
    shared_memory_bytes)."""
    limit = gpu_common.shared_memory_limit() if limit is None else limit

    def fits(pages, stages):
        return shared_memory_bytes(
            rows=rows, keys=pages * block_size, head_dim=head_dim, cache_itemsize=cache_itemsize,
            compute_itemsize=compute_itemsize, num_stages=stages, quantized=quantized,
            planes=planes) <= limit

    for stages in [num_stages] if num_stages is not None else [2, 1]:
        pages = preferred_pages if pages_per_step is None else pages_per_step
        while pages_per_step is None and pages > 1 and not fits(pages, stages):
            pages //= 2
        if fits(pages, stages):
            break
    return pages, stages


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
            and gpu_common.target_compute_capability() < (8, 9)):
        major, minor = gpu_common.target_compute_capability()
        raise ValueError(f"a {kv_cache.data.dtype} KV cache needs a GPU of compute capability "
                         f">= 8.9 for the Triton kernels, this one is {major}.{minor}: use "
                         "kv_cache_dtype='int8' or the reference backend")
    return kv_cache.data, kv_cache.scales, q_dtype


def check_operands(q, kv_cache, interpret: bool, **tunables: int | None):
    """(cache data, its scales or None, the compute dtype, the GQA group) of what the Triton
    kernels read for q [.., N, H] (split_cache), refused by name where the heads do not divide,
    the cache's head dim is short, or a shape or tunable is no power of two."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    data, scales, dtype = split_cache(kv_cache, q.dtype, interpret)
    _, num_kv_heads, _, block_size, padded_head_dim = data.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if padded_head_dim < head_dim:
        raise ValueError(f"cache head dim {padded_head_dim} < query head dim {head_dim}")
    check_triton_shapes(block_size=block_size, head_dim=padded_head_dim, **tunables)
    return data, scales, dtype, num_heads // num_kv_heads


def check_config(*, block_size: int, dtype: str, kv_cache_dtype: str) -> None:
    """What backend 'gpu' refuses of an engine's settings, by name, before anything is built:
    Triton's tiles have power-of-two dims. Every KV dtype is read (an fp8 one needs sm_89+,
    checked against the target when a kernel is traced: split_cache)."""
    del dtype, kv_cache_dtype
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the gpu attention backend, "
                         f"got {block_size}")
