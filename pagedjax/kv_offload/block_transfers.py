"""Whole KV blocks between the device cache and host memory: swap preemption's moves and the
tiered prefix cache's (pagedjax.kv_offload.tiers).

A host pool is laid out like the cache, [2, K, L * NB, ...] for each leaf (an int8 / fp8 cache's
scales too), so a block is its L layer slots' pages. Device-side, a copy of C blocks is one
compiled program (a gather out, a scatter in), C padded to a power of two with null-block
entries, so each direction compiles a bounded number of programs, which warmup compiles ahead
(ModelRunner.warm_block_copies).

Multi-host (pagedjax.parallel.multihost), each process's host pool holds its own devices' KV
heads of every block (K_local of K): the leader announces each move (device blocks, host slots)
to the followers, every process runs the same gather or scatter program on the global cache
and copies its own shards to or from its own pool (blocks_to_host, write_blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from pagedjax.pallas_kernels import gather_blocks, layer_blocks, scatter_blocks
from pagedjax.scheduler import NULL_BLOCK

if TYPE_CHECKING:
    from pagedjax.models import ServingGraph
    from pagedjax.pallas_kernels import AttentionBackend


class BlockTransfers:
    """ModelRunner's block moves (a mixin over the runner's fields below)."""

    # ModelRunner's: its serving graph, cache, blocks a layer slot, attention backend, device,
    # multi-host leader channel (or None), abstract step arguments, compiled copies and
    # compile-once helper
    graph: ServingGraph
    kv_cache: Any
    num_blocks: int
    backend: AttentionBackend
    device: Any
    channel: Any
    _abstract_args: tuple
    _block_copies: dict[tuple[str, int], jax.stages.Compiled]
    _once: Callable[..., jax.stages.Compiled]

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
             host_pool) -> None:
        """Runs a step's swaps before the step: device -> host first (those device blocks may be
        reused by this step), then host -> device. host_pool is laid out like the cache
        (init_host_pool)."""
        if swap_out:
            device, host = map(list, zip(*swap_out))
            self.blocks_to_host(device, host_pool, host)
        if swap_in:
            host, device = map(list, zip(*swap_in))
            self.write_blocks(device, host_pool, host)

    def copy_device_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device block copies (src, dst) in every layer slot, outside a step: a state group's
        forks (scheduler.state_group), run before the step and its swaps."""
        if not pairs:
            return
        src, dst = map(list, zip(*pairs))
        data = self.read_blocks(src)
        ids = _pad_ids(dst)
        flat = layer_blocks(ids, self.graph.num_kv_slots, self.num_blocks).reshape(-1)
        self.kv_cache = self.block_copy("write", len(ids))(self.kv_cache, flat, data)

    def read_blocks(self, device: list[int]):
        """Device blocks' content in every layer slot, dispatched (not waited for): a pytree
        like the cache, of [2, K, L * C, ...] device arrays, C = len(device) padded to a power
        of two (null-block entries)."""
        ids = _pad_ids(device)
        flat = layer_blocks(ids, self.graph.num_kv_slots, self.num_blocks).reshape(-1)
        return self.block_copy("read", len(ids))(self.kv_cache, flat)

    def blocks_to_host(self, device: list[int], host_pool, host: list[int]) -> None:
        """Copies the cache's blocks `device` into host_pool's blocks `host`, waiting for them
        (multi-host: the followers do the same with theirs)."""
        if self.channel is not None:
            self.channel.blocks(False, device, host)
        store_blocks(host_pool, host, self.read_blocks(device), self.graph.num_kv_slots)

    def write_blocks(self, device: list[int], host_pool, host: list[int]) -> None:
        """Copies host_pool's blocks `host` into the cache's blocks `device` (dispatched;
        multi-host: the followers do the same from theirs)."""
        if self.channel is not None:
            self.channel.blocks(True, device, host)
        num_layers = self.graph.num_kv_slots
        ids = _pad_ids(device)

        def staged(pool):
            by_layer = _by_layer(pool, num_layers)
            data = np.zeros(by_layer.shape[:3] + (len(ids),) + by_layer.shape[4:], pool.dtype)
            data[:, :, :, :len(host)] = by_layer[:, :, :, host]
            return data.reshape(pool.shape[:2] + (-1,) + pool.shape[3:])

        flat = layer_blocks(ids, num_layers, self.num_blocks).reshape(-1)
        data = jax.tree.map(lambda pool, leaf: _global(staged(pool), leaf),
                            host_pool, self.kv_cache)
        self.kv_cache = self.block_copy("write", len(ids))(self.kv_cache, flat, data)

    def block_copy(self, direction: str, count: int) -> jax.stages.Compiled:
        """The compiled gather ("read") or scatter ("write", the cache donated) of count
        blocks (a power of two), built on first use."""
        def build():
            cache = self._abstract_args[1]
            num_ids = self.graph.num_kv_slots * count
            mesh = self.backend.mesh
            ids = jax.ShapeDtypeStruct((num_ids,), np.int32, sharding=(
                SingleDeviceSharding(self.device) if mesh is None else NamedSharding(mesh, P())))
            if direction == "read":
                return gather_blocks.lower(cache, ids).compile()
            data = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                a.shape[:2] + (num_ids,) + a.shape[3:], a.dtype, sharding=a.sharding), cache)
            return scatter_blocks.lower(cache, ids, data).compile()

        return self._once(self._block_copies, (direction, count), build)

    def warm_block_copies(self, max_blocks: int) -> int:
        """Compiles both directions' copies of every power of two of blocks up to the one
        covering max_blocks; returns how many programs."""
        count, programs = 1, 0
        while True:
            for direction in ("read", "write"):
                self.block_copy(direction, count)
                programs += 1
            if count >= max_blocks:
                return programs
            count *= 2

    def init_host_pool(self, num_host_blocks: int):
        """Host arrays laid out like the device cache, num_host_blocks a layer (multi-host:
        this process's KV heads)."""
        num_layers = self.graph.num_kv_slots
        return jax.tree.map(
            lambda a: np.zeros((a.shape[0], _local_heads(a)[1], num_layers * num_host_blocks)
                               + a.shape[3:], a.dtype), self.kv_cache)


def _pad_ids(ids: list[int]) -> np.ndarray:
    padded = np.full(1 << (len(ids) - 1).bit_length(), NULL_BLOCK, np.int32)
    padded[:len(ids)] = ids
    return padded


def _local_heads(array) -> tuple[int, int]:
    """(first, count) of the KV heads (axis 1) this process's devices hold of a cache-layout
    array: all of them but multi-host (a contiguous range: the mesh orders devices by
    process)."""
    if array.is_fully_addressable:
        return 0, array.shape[1]
    ranges = {(s.index[1].start or 0, s.index[1].stop or array.shape[1])
              for s in array.addressable_shards}
    first = min(start for start, _ in ranges)
    return first, max(stop for _, stop in ranges) - first


def _local(array) -> np.ndarray:
    """A device array's part this process holds, on the host: all of it but multi-host (its
    devices' KV heads, each distinct shard once)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    shards = {(s.index[1].start or 0): s for s in array.addressable_shards}
    return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)], axis=1)


def _global(local: np.ndarray, like):
    """The host data of this process's KV heads as an input of like's sharding: the array
    itself but multi-host (each process gives its devices' shards)."""
    if like.is_fully_addressable:
        return local
    first, _ = _local_heads(like)
    shape = (like.shape[0], like.shape[1]) + local.shape[2:]

    def piece(index):
        heads = slice((index[1].start or 0) - first, (index[1].stop or shape[1]) - first)
        return local[(index[0], heads) + tuple(index[2:])]

    return jax.make_array_from_callback(shape, like.sharding, piece)


def store_blocks(host_pool, host: list[int], blocks, num_layers: int) -> None:
    """Writes read_blocks' content (waiting for it) into host_pool's blocks `host`."""
    for pool, data in zip(jax.tree.leaves(host_pool), jax.tree.leaves(blocks)):
        data = _by_layer(_local(data), num_layers)
        _by_layer(pool, num_layers)[:, :, :, host] = data[:, :, :, :len(host)]


def host_block(host_pool, slot: int, num_layers: int) -> list[np.ndarray]:
    """One host block's content, a copy of each of the pool's leaves' [2, K, L, ...] part."""
    return [_by_layer(pool, num_layers)[:, :, :, slot].copy()
            for pool in jax.tree.leaves(host_pool)]


def set_host_block(host_pool, slot: int, leaves: list[np.ndarray], num_layers: int) -> None:
    for pool, data in zip(jax.tree.leaves(host_pool), leaves):
        _by_layer(pool, num_layers)[:, :, :, slot] = data


def _by_layer(array: np.ndarray, num_layers: int) -> np.ndarray:
    """A view [2, K, L, NB, ...] of a cache-layout host array [2, K, L * NB, ...]."""
    return array.reshape(array.shape[:2] + (num_layers, -1) + array.shape[3:])
