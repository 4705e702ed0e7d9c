"""The pool of physical KV blocks: an LRU free queue, reference counts and the prefix-cache map."""

from __future__ import annotations

import collections

from pagedjax.scheduler.host_tier import HostTier, host_hit

NULL_BLOCK = 0  # never allocated, never freed: the target of every padding write and table entry


class BlockPool:
    """Physical block ids 1..num_blocks-1 with O(1) allocate, free, touch and evict.

    Free blocks wait in an LRU queue: freed blocks join the back, allocation takes from the front,
    so a recently freed block is the last to be reused. A full block may carry a content hash
    (prefix caching); it stays findable through `cached` while it is free, until allocation
    evicts it.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> block holding that content
        self._free = collections.OrderedDict.fromkeys(range(1, num_blocks))
        self.num_evictions = 0
        self.tier: HostTier | None = None  # keeps what is evicted, if set

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Takes num_blocks blocks with ref count 1 (evicting cached content), or returns None
        (and takes nothing)."""
        if num_blocks > len(self._free):
            return None
        return self.take(num_blocks)

    def take(self, num_blocks: int) -> list[int]:
        """allocate for a caller that made sure of num_free_blocks: a short pool is a bug."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"{num_blocks} blocks asked of a pool with {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            self.block_hashes[block] = None
            if self.cached.get(block_hash) == block:
                del self.cached[block_hash]
                if self.tier is not None:
                    self.tier.offload(block, block_hash)
            self.num_evictions += 1

    def lookup(self, block_hash: bytes) -> int | None:
        """The device block holding block_hash, else the host tier's hit (host_tier.host_hit:
        a negative number), else None."""
        block = self.cached.get(block_hash)
        if block is None and self.tier is not None:
            slot = self.tier.lookup(block_hash)
            if slot is not None:
                return host_hit(slot)
        return block

    def touch(self, blocks: list[int]) -> None:
        """Takes a reference on blocks found in the cache, reviving those that were free."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def incref(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"incref of free block {block}")
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drops one reference from each block; blocks reaching zero join the back of the queue
        (keeping their cached content until evicted)."""
        for block in blocks:
            count = self.ref_counts[block]
            if count <= 0 or block == NULL_BLOCK:
                raise RuntimeError(f"free of unreferenced block {block} (ref count {count})")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None

    def free_unused(self, blocks: list[int]) -> None:
        """free() of blocks that were never written with content worth keeping (speculative
        drafts rolled back): they go to the front of the queue, reused before any cached block
        is evicted."""
        self.free(blocks)
        for block in blocks:
            if block in self._free and self.block_hashes[block] is None:
                self._free.move_to_end(block, last=False)

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Records that block holds the content block_hash (first holder of a content wins)."""
        if self.block_hashes[block] is None and block_hash not in self.cached:
            self.block_hashes[block] = block_hash
            self.cached[block_hash] = block

    def drop_cached(self) -> None:
        """Forgets every block's content hash (not counted as evictions)."""
        self.block_hashes = [None] * self.num_blocks
        self.cached.clear()

    def is_free(self, block: int) -> bool:
        return block in self._free

    def free_block_ids(self) -> list[int]:
        return list(self._free)
