"""Multi-head latent attention's expanded prefill: the step's latents up-projected to every
head's key [k_nope | k_pe] and value (kv_b_proj, as transformers computes them), then plain
multi-head attention through the backend's own ragged kernel, instead of the absorbed MQA over
the latent (models/layers/mla.py).

The two forms cost, per query token, key and head: absorbed 2 Dl + R multiply-adds (QK over the
latent and the RoPE key, PV over the latent: 1,088 at DeepSeek's 512 / 64), expanded
nope + R + v (192 + 128 = 320), plus Dl (nope + v) a token of this step to expand its keys and
values (131,072). A sequence of q tokens attends to about q^2 / 2 keys of its own, so the
expanded form wins past q ~ 2 Dl (nope + v) / (2 Dl - nope - v) tokens a sequence (341 at
DeepSeek's dims: crossover_tokens) in multiply-adds. That is what "auto" takes on the Pallas
kernels (the step's T / B against it: both static, the plan's shape), which read each page
once a tile of query tokens, so a compute-bound prefill's cost follows its multiply-adds; not
measured on a device yet. The jnp reference gathers every query token's pages, so its cost
follows the bytes gathered, and there MQA over the latent (144 values a key at the CPU
benchmark's shape) beats every head's keys and values (8 x 96): the CPU measured the absorbed
form ahead at 13 of 14 shapes, 1.7-1.85x from 512 tokens up (benchmarks/results/
mla_prefill.md), so "auto" keeps it on the reference backend.

Only the step's own tokens are expanded (nothing read back from the cache), so the expanded
form serves steps in which no sequence has cached context (each chunk its sequence's first,
every kv_len = q_len: a fresh prompt without a prefix hit); a step with context falls back to
the absorbed form at run time (jax.lax.cond: both compiled into the step). The latent rows are
written into the cache either way, for the decode steps that follow.

The keys and values go into a scratch cache of the backend's layout, each sequence's tokens
from a block boundary (scratch_plan), no larger than the step: T + B blocks' worth of rows, cut
at SCRATCH_BYTES (else the absorbed form runs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels import (AttentionBackend, AttentionMetadata, init_kv_cache,
                                     paged_attention)
from pagedjax.pallas_kernels.layout import cache_head_dim

PREFILL_FORMS = ("auto", "absorbed", "expanded")
# Where "auto" may pick the expanded form (the module docstring), and past how many times
# crossover_tokens a sequence (the multiply-add model's 1.0 until a device measures it:
# benchmarks/mla_prefill.py --attention-backend).
EXPANDED_AUTO_BACKENDS = ("gpu", "tpu")
MEASURED_CROSSOVER = 1.0
SCRATCH_BYTES = 1 << 30  # a step's expanded K/V beyond this: the absorbed form


def crossover_tokens(latent: int, nope: int, rope_dim: int, v_dim: int) -> float:
    """Query tokens a sequence past which the expanded form does fewer multiply-adds (module
    docstring); the RoPE key costs both forms the same."""
    del rope_dim
    return 2 * latent * (nope + v_dim) / max(1, 2 * latent - nope - v_dim)


def scratch_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Blocks of a step's scratch cache: its tokens' (each sequence from a block boundary: at
    most one partial block a sequence) and the null block."""
    return -(-num_tokens // block_size) + num_seqs + 1


def scratch_bytes(num_tokens: int, num_seqs: int, block_size: int, num_heads: int,
                  head_dim: int, itemsize: int, backend: str) -> int:
    blocks = scratch_blocks(num_tokens, num_seqs, block_size)
    return 2 * blocks * block_size * num_heads * cache_head_dim(head_dim, backend) * itemsize


def chosen(attn, backend: AttentionBackend, metadata: AttentionMetadata, num_tokens: int,
           block_size: int, itemsize: int) -> bool:
    """Whether a step of this shape runs the expanded form when it can (static)."""
    if backend.latent_prefill == "absorbed" or metadata.decode_only:
        return False
    num_seqs = metadata.block_tables.shape[0]
    size = scratch_bytes(num_tokens, num_seqs, block_size, attn.num_heads,
                         max(attn.nope + attn.rope_dim, attn.v_dim), itemsize, backend.name)
    if size > SCRATCH_BYTES:
        return False
    if backend.latent_prefill == "expanded":
        return True
    if backend.name not in EXPANDED_AUTO_BACKENDS:
        return False
    crossover = crossover_tokens(attn.latent, attn.nope, attn.rope_dim, attn.v_dim)
    return num_tokens >= MEASURED_CROSSOVER * crossover * num_seqs


def fresh(metadata: AttentionMetadata) -> jax.Array:
    """bool[]: no live sequence of the step has context before its chunk."""
    cu = metadata.cu_q_lens
    live = jnp.arange(cu.shape[0] - 1) < metadata.num_seqs
    return jnp.all(jnp.where(live, metadata.kv_lens == cu[1:] - cu[:-1], True))


def scratch_plan(metadata: AttentionMetadata, num_tokens: int, block_size: int):
    """A scratch cache's plan holding each live sequence's step tokens from a block boundary
    (block 0 the null block, where padding tokens write): (AttentionMetadata, its blocks)."""
    cu = metadata.cu_q_lens
    num_rows = cu.shape[0] - 1
    live = jnp.arange(num_rows) < metadata.num_seqs
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)
    blocks = (q_lens + block_size - 1) // block_size
    first = 1 + jnp.cumsum(blocks) - blocks  # each sequence's first scratch block
    width = -(-num_tokens // block_size)
    columns = jnp.arange(width, dtype=jnp.int32)
    tables = jnp.where(columns[None, :] < blocks[:, None], first[:, None] + columns[None, :], 0)
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], tokens, side="right"), num_rows - 1)
    local = tokens - cu[seq]
    slots = jnp.where(tokens < cu[metadata.num_seqs],
                      (first[seq] + local // block_size) * block_size + local % block_size, 0)
    plan = AttentionMetadata(slot_mapping=slots.astype(jnp.int32),
                             block_tables=tables.astype(jnp.int32),
                             kv_lens=q_lens.astype(jnp.int32), cu_q_lens=cu,
                             num_seqs=metadata.num_seqs, decode_only=False)
    return plan, scratch_blocks(num_tokens, num_rows, block_size)


def expanded_attention(attn, q_nope, q_pe, latent, k_pe, w_uk, w_uv, metadata, backend,
                       block_size: int) -> jax.Array:  # [T, N, v]
    """Multi-head attention of the step's tokens over their own sequences' tokens, keys and
    values up-projected from the latent (a fresh step: see the module docstring)."""
    num_tokens, num_heads, _ = q_nope.shape
    dtype = q_nope.dtype
    k_nope = jnp.einsum("Tl,lNn->TNn", latent, w_uk.astype(latent.dtype),
                        preferred_element_type=jnp.float32).astype(dtype)
    v = jnp.einsum("Tl,lNv->TNv", latent, w_uv.astype(latent.dtype),
                   preferred_element_type=jnp.float32).astype(dtype)
    pe = jnp.broadcast_to(k_pe[:, None, :].astype(dtype), (num_tokens, num_heads, attn.rope_dim))
    q = jnp.concatenate([q_nope, q_pe.astype(dtype)], axis=-1)
    k = jnp.concatenate([k_nope, pe], axis=-1)
    head_dim = max(k.shape[-1], attn.v_dim)  # one head dim for both planes, zero-padded

    def pad(x):
        return jnp.pad(x, ((0, 0), (0, 0), (0, head_dim - x.shape[-1])))

    plan, num_blocks = scratch_plan(metadata, num_tokens, block_size)
    scratch = init_kv_cache(1, num_blocks, block_size, num_heads, head_dim, dtype, backend.name)
    local = dataclasses.replace(backend, latent_prefill="absorbed")
    out, _ = paged_attention(pad(q), pad(k), pad(v), scratch, plan, scale=attn.scale,
                             backend=local)
    return out[..., :attn.v_dim]
