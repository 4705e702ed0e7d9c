"""What both GPU backends (Triton and Mosaic GPU) size their kernels by and share: the target's
compute capability and shared memory, and split-K decoding (choosing the splits, merging them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    (`jax.default_device(d)`, a compile-only device included: benchmarks/aot/xla_gpu.py),
    else the first visible GPU's; DEFAULT_TARGET on a machine without one."""
    device = jax.config.jax_default_device  # type: ignore[attr-defined]  # a jax.config flag (untyped)
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


def combine_splits(o, l, m, sinks=None):
    """Merges per-split partial softmaxes: o f32[X, ..., Hp], l and m f32[X, ...]. sinks:
    attention sinks broadcastable to l's rows ([..., K, Gp]), or None: each joins as one more
    split with no value (o 0, m the sink, l 1)."""
    if sinks is not None:
        m = jnp.concatenate([m, jnp.broadcast_to(sinks.astype(jnp.float32), m.shape[1:])[None]])
        l = jnp.concatenate([l, jnp.ones_like(l[:1])])
        o = jnp.concatenate([o, jnp.zeros_like(o[:1])])
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


def split_context(block_tables, kv_lens, num_seqs, *, programs: int, pages_per_step: int,
                  num_splits: int | None):
    """Split-K decoding's layout: (num_splits, pages_per_split, the tables padded with the null
    block so the last step of the last split (and a window-shifted start) may read past P,
    kv_lens zeroed past num_seqs). num_splits None: choose_num_splits for `programs`
    programs a split."""
    batch, width = block_tables.shape
    if num_splits is None:
        num_splits = choose_num_splits(programs, width, pages_per_step)
    per_split = -(-width // num_splits)
    pages_per_split = -(-per_split // pages_per_step) * pages_per_step
    padded_width = pages_per_split * num_splits + pages_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    lens = jnp.where(jnp.arange(batch) < num_seqs, kv_lens, 0).astype(jnp.int32)
    return num_splits, pages_per_split, tables, lens
