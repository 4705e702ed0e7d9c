"""What the Mosaic GPU kernels need and refuse: jax >= 0.11 (the Mosaic GPU interpreter tests them
on a CPU: tests/kernels/test_kernels_mosaic_gpu.py), sm_90 (H100/H200) or newer, and 16-bit caches (bf16,
f16) in the "gpu" layout with a block size that is a multiple of 8; f32 and quantized caches are
refused by name (the Triton kernels, backend 'gpu', serve them)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels.quant import QuantizedKV

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


def check_config(*, block_size: int, dtype: str, kv_cache_dtype: str) -> None:
    """What backend 'mosaic_gpu' refuses of an engine's settings, by name, before anything is
    built: a jax without the lowering, a KV dtype other than bf16/f16, a block size that is not
    a multiple of 8 (its tiles' rows) or not a power of two (the "gpu" cache layout)."""
    if (reason := problem()) is not None:
        raise ValueError(f"attention_backend='mosaic_gpu': {reason}")
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if kv_dtype not in DTYPES:
        raise ValueError(f"attention_backend='mosaic_gpu' reads a bfloat16 KV cache, got "
                         f"dtype={dtype!r}, kv_cache_dtype={kv_cache_dtype!r}: use "
                         "dtype='bfloat16' or attention_backend='gpu'")
    if block_size % 8:
        raise ValueError(f"block_size must be a multiple of 8 for attention_backend="
                         f"'mosaic_gpu', got {block_size}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the mosaic_gpu attention "
                         f"backend, got {block_size}")
