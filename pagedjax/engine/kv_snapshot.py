"""The KV pool as a picture: which running request holds which physical block (KVSnapshot), KV
usage per step (UsageSample), and the token slots the pool holds."""

from __future__ import annotations

import collections
import dataclasses

from pagedjax.scheduler import NULL_BLOCK


@dataclasses.dataclass(frozen=True)
class KVSnapshot:
    """Who holds which physical KV block right now (block 0, the null block, is never held).

    owners[b]: the running requests whose block tables point at block b (several = shared, by a
    common prefix or parallel samples); tokens[b]: token slots of b holding computed KV;
    cached_free: free blocks that still hold a prefix-cached block (reusable until evicted)."""

    num_blocks: int
    block_size: int
    owners: dict[int, list[str]]
    tokens: dict[int, int]
    cached_free: list[int]


@dataclasses.dataclass(frozen=True)
class UsageSample:
    """One step's KV usage (EngineStats keeps the peak; this is the time series)."""

    step: int
    time: float
    used_blocks: int
    num_running: int
    num_waiting: int


def kv_snapshot(scheduler) -> KVSnapshot:
    """The block map of the live requests (for inspection and pictures; O(blocks))."""
    kv = scheduler.kv_manager
    owners: dict[int, list[str]] = collections.defaultdict(list)
    tokens: dict[int, int] = {}
    for request in scheduler.state.running:
        table = kv.get_block_table(request.request_id)
        for index, block in enumerate(table):
            if block == NULL_BLOCK:
                continue
            owners[block].append(request.request_id)
            filled = min(kv.block_size, request.num_computed_tokens - index * kv.block_size)
            tokens[block] = max(tokens.get(block, 0), max(filled, 0))
    pool = kv.pool
    cached_free = [b for b in pool.free_block_ids() if pool.block_hashes[b] is not None]
    return KVSnapshot(pool.num_blocks, kv.block_size, dict(owners), tokens, cached_free)


def tokens_stored(scheduler) -> int:
    """Token slots filled in the pool right after a step, a shared block counted once: every
    running request has exactly its computed tokens in its blocks."""
    kv = scheduler.kv_manager
    block_size = kv.block_size
    full_blocks, partial = set(), 0
    for request in scheduler.state.running:
        num_full, rest = divmod(request.num_computed_tokens, block_size)
        full_blocks.update(kv.get_block_table(request.request_id)[:num_full])
        partial += rest
    full_blocks.discard(NULL_BLOCK)  # slots of blocks freed outside a sliding window
    return len(full_blocks) * block_size + partial
