"""Backend dispatch: the one entry the model calls for paged attention and KV writes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pagedjax.pallas_kernels import layout
from pagedjax.pallas_kernels.gpu import mosaic, triton
from pagedjax.pallas_kernels.layout import write_kv_reference
from pagedjax.pallas_kernels.quant import QuantizedKV
from pagedjax.pallas_kernels.reference import (paged_decode_attention_reference,
                                               ragged_paged_attention_reference)
from pagedjax.pallas_kernels.tpu import (copy_blocks_tpu, paged_decode_attention_tpu,
                                         ragged_paged_attention_tpu, write_kv_tpu)


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What attention needs from a step's plan. Only the first num_seqs rows are valid."""

    slot_mapping: jax.Array  # i32[T]
    block_tables: jax.Array  # i32[B, P]
    kv_lens: jax.Array  # i32[B]
    cu_q_lens: jax.Array  # i32[B + 1]
    num_seqs: jax.Array  # i32[]
    decode_only: bool  # every sequence has exactly one query token (T == B)
    # KV cache groups past the first (pagedjax.models.layers.kv_groups): their slots and tables, i32[G - 1, T]
    # and i32[G - 1, B, R]; None (or G - 1 = 0 rows) for a model with one group. R < P: each
    # row a ring, logical block p at column p % R (a sliding group's, scheduler.plan).
    group_slot_mapping: jax.Array | None = None
    group_block_tables: jax.Array | None = None

    def with_logical_group_tables(self) -> "AttentionMetadata":
        """The group tables unrolled to P columns, logical block p at column p, as the
        kernels read a table: once a step, before the layers. A column before a ring's
        first block holds a block the window does see; its keys lie outside the window, so
        every kernel masks (or skips) them."""
        tables = self.group_block_tables
        width = self.block_tables.shape[1]
        if tables is None or tables.shape[-1] == width:
            return self
        columns = jnp.arange(width, dtype=jnp.int32) % tables.shape[-1]
        return dataclasses.replace(self, group_block_tables=tables[:, :, columns])


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "block_tables", "kv_lens", "cu_q_lens", "num_seqs",
                 "group_slot_mapping", "group_block_tables"],
    meta_fields=["decode_only"])


def for_layer(metadata: AttentionMetadata, layer, blocks_per_layer: int,
              block_size: int, group: int = 0) -> AttentionMetadata:
    """The plan as a layer reads the cache: its KV cache group's tables (group: an int, or
    traced), its block ids and slots offset into its cache slot's blocks (layer: the slot, an
    int or traced under scan; layout.layer_blocks); the null block stays."""
    if blocks_per_layer <= 0:
        raise ValueError(f"blocks_per_layer must be positive, got {blocks_per_layer}")
    offset = jnp.asarray(layer, jnp.int32) * blocks_per_layer
    tables = metadata.block_tables
    slots = metadata.slot_mapping
    traced = not isinstance(group, int)  # a scan over layers of several groups
    if traced or group:
        group_tables, group_slots = metadata.group_block_tables, metadata.group_slot_mapping
        if group_tables is None or group_slots is None:
            raise ValueError(f"KV cache group {group} asked of a plan with one group")
        if traced:
            tables = jnp.concatenate([tables[None], group_tables])[group]
            slots = jnp.concatenate([slots[None], group_slots])[group]
        else:
            tables, slots = group_tables[group - 1], group_slots[group - 1]
    null_slot = slots // block_size == layout.NULL_BLOCK
    return dataclasses.replace(
        metadata,
        block_tables=jnp.where(tables == layout.NULL_BLOCK, tables, tables + offset),
        slot_mapping=jnp.where(null_slot, slots, slots + offset * block_size),
        group_slot_mapping=None, group_block_tables=None)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """Which implementation runs (static under jit). interpret runs a Pallas kernel through the
    Pallas interpreter, so GPU and TPU kernels execute on a CPU in tests."""

    name: str = "reference"
    interpret: bool = False
    # Tensor parallelism: the mesh whose TP_AXIS splits the heads (q, k, v, the cache's KV
    # heads); attention and the cache's writes and copies then run per device under shard_map.
    mesh: jax.sharding.Mesh | None = None
    # Expert parallelism (--enable-expert-parallel): a mixture of experts' layers split their
    # experts over the mesh's TP_AXIS (models/layers/moe_experts.py) instead of each expert's MLP.
    expert_parallel: bool = False
    # Multi-head latent attention's prefill form (models/layers/mla_expanded.py): "auto" (by
    # the step's shape), "absorbed" (always MQA over the latent) or "expanded".
    latent_prefill: str = "auto"

    @property
    def gpu_layout(self) -> bool:
        """The cache layout of the GPU kernels (layout.PADDED_HEAD_DIM_BACKENDS)."""
        return self.name in layout.PADDED_HEAD_DIM_BACKENDS


class Implementation(NamedTuple):
    ragged: Callable  # (q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs, **opts)
    decode: Callable  # (q, kv_cache, kv_lens, block_tables, num_seqs, **opts)
    write_kv: Callable  # (kv_cache, k, v, slot_mapping) -> kv_cache
    pallas: bool  # every callable takes interpret=
    # check_config(block_size=, dtype=, kv_cache_dtype=): the engine settings (EngineConfig's
    # fields of those names) the backend cannot serve, refused by name (ValueError) before
    # anything is built; None where it serves them all.
    check_config: Callable | None = None


IMPLEMENTATIONS: dict[str, Implementation] = {
    "reference": Implementation(ragged_paged_attention_reference,
                                paged_decode_attention_reference, write_kv_reference, False),
    "gpu": Implementation(triton.ragged_paged_attention_gpu, triton.paged_decode_attention_gpu,
                          triton.write_kv_gpu, True, triton.check_config),
    # The Mosaic GPU kernels (Hopper, 16-bit caches, jax >= 0.11), on the "gpu" cache layout.
    "mosaic_gpu": Implementation(mosaic.ragged_paged_attention_mosaic_gpu,
                                 mosaic.paged_decode_attention_mosaic_gpu,
                                 mosaic.write_kv_mosaic_gpu, True, mosaic.check_config),
    "tpu": Implementation(ragged_paged_attention_tpu, paged_decode_attention_tpu, write_kv_tpu,
                          True),
}
BACKEND_NAMES = ("auto", *IMPLEMENTATIONS)
# The backends whose kernels take attention sinks (gpt-oss); the Mosaic GPU kernels do not.
SINK_BACKENDS = ("reference", "gpu", "tpu")
# The backends that attend over a latent cache (multi-head latent attention, DeepSeek): one
# plane, the value its first value_dim values (pallas_kernels.layout).
LATENT_BACKENDS = ("reference", "gpu", "tpu")
TP_AXIS = "tp"


def resolve_backend(name: str, interpret: bool = False) -> AttentionBackend:
    """'auto' picks the kernel family of jax.default_backend() (the reference on CPU)."""
    if name == "auto":
        platform = jax.default_backend()
        name = platform if platform in IMPLEMENTATIONS else "reference"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    if interpret and not IMPLEMENTATIONS[name].pallas:
        raise ValueError(f"attention_interpret applies to Pallas backends, not {name!r}")
    return AttentionBackend(name, interpret)


def check_backend(name: str, *, block_size: int, dtype: str, kv_cache_dtype: str) -> None:
    """Backend `name`'s own constraints on an engine's block size, dtype and KV cache dtype
    (its Implementation.check_config), refused by name; 'auto' is checked once resolved."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    if (check := IMPLEMENTATIONS[name].check_config) is not None:
        check(block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


def paged_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H] this step's keys, written before attending
    v: jax.Array | None,  # [T, K, H]; None: a latent cache (value_dim)
    kv_cache: jax.Array,  # [2, K, NB, S, Hc] ([1, ...]: a latent cache)
    metadata: AttentionMetadata,
    *, scale: float, backend: AttentionBackend = AttentionBackend(),
    sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, value_dim: int | None = None, write: bool = True,
) -> tuple[jax.Array, jax.Array]:  # ([T, N, H] or [T, N, value_dim], new kv_cache)
    """Writes the step's K/V into their slots, then attends through the block tables. sinks:
    f32[N] attention sinks (gpt-oss: a logit a head joining every softmax, with no value).
    value_dim with v None: multi-head latent attention's absorbed form, MQA over a one-plane
    cache whose rows are [latent, RoPE key] and whose values are the latent's value_dim.
    write False: attends over the cache as it is (the step's rows written before: write_kv);
    k, v only give their shapes."""
    if (v is None) != (value_dim is not None):
        raise ValueError("a latent cache takes v None with value_dim set; K/V planes take v "
                         "and no value_dim")
    if backend.mesh is not None:  # each device its heads, the plan replicated
        return _sharded_attention(q, k, v, kv_cache, metadata, scale=scale, backend=backend,
                                  sliding_window=sliding_window, soft_cap=soft_cap,
                                  sinks=sinks, value_dim=value_dim, write=write)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if metadata.decode_only and q.shape[0] != metadata.block_tables.shape[0]:
        raise ValueError(f"a decode step needs one token per row: {q.shape[0]=} != "
                         f"{metadata.block_tables.shape[0]=}")
    impl = IMPLEMENTATIONS[backend.name]
    pallas_opts = dict(interpret=backend.interpret) if impl.pallas else {}
    opts: dict[str, Any] = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                **pallas_opts)
    for name, value, backends in (("sinks", sinks, SINK_BACKENDS),
                                  ("value_dim", value_dim, LATENT_BACKENDS)):
        if value is not None:
            if backend.name not in backends:
                what = "attention sinks" if name == "sinks" else "latent (MLA) caches"
                raise ValueError(f"{what} are built in the {backends} backends, "
                                 f"not {backend.name!r}")
            opts[name] = value
    if write:
        kv_cache = impl.write_kv(kv_cache, k, v, metadata.slot_mapping, **pallas_opts)
    if metadata.decode_only:
        out = impl.decode(q, kv_cache, metadata.kv_lens, metadata.block_tables,
                          metadata.num_seqs, **opts)
    else:
        out = impl.ragged(q, kv_cache, metadata.kv_lens, metadata.block_tables,
                          metadata.cu_q_lens, metadata.num_seqs, **opts)
    return out, kv_cache


def _sharded_attention(q, k, v, kv_cache, metadata, *, backend, sinks, **opts):
    """paged_attention on each device's heads (q's, k's, v's and the cache's KV heads split
    over the mesh's TP axis; sinks with the query heads), the plan replicated."""
    heads, cache = P(None, TP_AXIS), P(None, TP_AXIS)
    local_backend = dataclasses.replace(backend, mesh=None)

    def local(q, k, kv_cache, metadata, *extra):
        extra = dict(zip(names, extra))
        return paged_attention(q, k, extra.get("v"), kv_cache, metadata,
                               backend=local_backend, sinks=extra.get("sinks"), **opts)

    names = tuple(name for name, value in (("v", v), ("sinks", sinks)) if value is not None)
    extra = tuple(value for value in (v, sinks) if value is not None)
    specs = (heads, heads, cache, P(), *(heads if name == "v" else P(TP_AXIS) for name in names))
    return jax.shard_map(local, mesh=backend.mesh, in_specs=specs, out_specs=(heads, cache),
                         check_vma=False)(q, k, kv_cache, metadata, *extra)


def write_kv(kv_cache, k: jax.Array, v: jax.Array | None, metadata: AttentionMetadata,
             backend: AttentionBackend = AttentionBackend()):
    """The step's new K/V (or latent rows: v None) into their slots, nothing attended (per
    device's KV heads under a mesh); returns the new cache."""
    if backend.mesh is not None:
        heads = P(None, TP_AXIS)
        local_backend = dataclasses.replace(backend, mesh=None)
        planes = [] if v is None else [v]

        def local(kv_cache, k, metadata, *v):
            return write_kv(kv_cache, k, v[0] if v else None, metadata, local_backend)

        return jax.shard_map(local, mesh=backend.mesh,
                             in_specs=(heads, heads, P(), *[heads] * len(planes)),
                             out_specs=heads, check_vma=False)(kv_cache, k, metadata, *planes)
    impl = IMPLEMENTATIONS[backend.name]
    opts = dict(interpret=backend.interpret) if impl.pallas else {}
    return impl.write_kv(kv_cache, k, v, metadata.slot_mapping, **opts)


def copy_blocks(kv_cache, src: jax.Array, dst: jax.Array, num_copies: jax.Array,
                backend: AttentionBackend = AttentionBackend(), *, num_blocks: int):
    """Copy-on-write block copies src[i] -> dst[i] (the first num_copies pairs, the scheduler's
    block ids) in every layer: layout.copy_blocks, an XLA scatter, except for a quantized cache
    on the TPU, where XLA would relayout the pool's f32 scales for it and a Pallas DMA copy runs
    instead."""
    if backend.mesh is not None:
        local = functools.partial(copy_blocks, backend=dataclasses.replace(backend, mesh=None),
                                  num_blocks=num_blocks)
        return jax.shard_map(local, mesh=backend.mesh, in_specs=(P(None, TP_AXIS), P(), P(), P()),
                             out_specs=P(None, TP_AXIS), check_vma=False)(kv_cache, src, dst,
                                                                          num_copies)
    num_layers = num_layers_of(kv_cache, num_blocks)
    # Block-major (pair i of every layer, then pair i + 1): the real pairs stay in front.
    src, dst = (layout.layer_blocks(ids, num_layers, num_blocks).T.reshape(-1)
                for ids in (src, dst))
    num_copies = num_copies * num_layers
    if backend.name == "tpu" and isinstance(kv_cache, QuantizedKV):
        return copy_blocks_tpu(kv_cache, src, dst, num_copies, interpret=backend.interpret)
    return layout.copy_blocks(kv_cache, src, dst, num_copies)


def num_layers_of(kv_cache, blocks_per_layer: int) -> int:
    """How many layers a cache of blocks_per_layer blocks a layer holds."""
    total = kv_cache.shape[2]
    if blocks_per_layer <= 0 or total % blocks_per_layer:
        raise ValueError(f"a cache of {total} blocks does not hold whole layers of "
                         f"{blocks_per_layer} blocks")
    return total // blocks_per_layer
