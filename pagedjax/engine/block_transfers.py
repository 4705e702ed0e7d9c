"""Whole KV blocks between the device cache and host memory: swap preemption's moves and the
tiered prefix cache's (pagedjax.engine.kv_tiers).

A host pool is laid out like the cache, [2, K, L * NB, ...] for each leaf (an int8 / fp8 cache's
scales too), so a block is its L layer slots' pages. Device-side, a copy of C blocks is one
compiled program (a gather out, a scatter in), C padded to a power of two with null-block
entries, so each direction compiles a bounded number of programs, which warmup compiles ahead
(ModelRunner.warm_block_copies).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from pallas_kernels import gather_blocks, layer_blocks, scatter_blocks
from scheduler import NULL_BLOCK


class BlockTransfers:
    """ModelRunner's block moves (a mixin: it has graph, kv_cache, num_blocks, backend,
    device, _abstract_args, _once)."""

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
             host_pool) -> None:
        """Runs a step's swaps before the step: device -> host first (those device blocks may be
        reused by this step), then host -> device. host_pool is laid out like the cache
        (init_host_pool)."""
        if swap_out:
            device, host = map(list, zip(*swap_out))
            store_blocks(host_pool, host, self.read_blocks(device), self.graph.num_kv_slots)
        if swap_in:
            host, device = map(list, zip(*swap_in))
            self.write_blocks(device, host_pool, host)

    def read_blocks(self, device: list[int]):
        """Device blocks' content in every layer slot, dispatched (not waited for): a pytree
        like the cache, of [2, K, L * C, ...] device arrays, C = len(device) padded to a power
        of two (null-block entries)."""
        ids = _pad_ids(device)
        flat = layer_blocks(ids, self.graph.num_kv_slots, self.num_blocks).reshape(-1)
        return self.block_copy("read", len(ids))(self.kv_cache, flat)

    def write_blocks(self, device: list[int], host_pool, host: list[int]) -> None:
        """Copies host_pool's blocks `host` into the cache's blocks `device` (dispatched)."""
        num_layers = self.graph.num_kv_slots
        ids = _pad_ids(device)

        def staged(pool):
            by_layer = _by_layer(pool, num_layers)
            data = np.zeros(by_layer.shape[:3] + (len(ids),) + by_layer.shape[4:], pool.dtype)
            data[:, :, :, :len(host)] = by_layer[:, :, :, host]
            return data.reshape(pool.shape[:2] + (-1,) + pool.shape[3:])

        flat = layer_blocks(ids, num_layers, self.num_blocks).reshape(-1)
        self.kv_cache = self.block_copy("write", len(ids))(
            self.kv_cache, flat, jax.tree.map(staged, host_pool))

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
        """Host arrays laid out like the device cache, num_host_blocks a layer."""
        num_layers = self.graph.num_kv_slots
        return jax.tree.map(
            lambda a: np.zeros(a.shape[:2] + (num_layers * num_host_blocks,) + a.shape[3:],
                               a.dtype), self.kv_cache)


def _pad_ids(ids: list[int]) -> np.ndarray:
    padded = np.full(1 << (len(ids) - 1).bit_length(), NULL_BLOCK, np.int32)
    padded[:len(ids)] = ids
    return padded


def store_blocks(host_pool, host: list[int], blocks, num_layers: int) -> None:
    """Writes read_blocks' content (waiting for it) into host_pool's blocks `host`."""
    for pool, data in zip(jax.tree.leaves(host_pool), jax.tree.leaves(blocks)):
        data = _by_layer(np.asarray(data), num_layers)
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
