"""Per-request block tables over a BlockPool, with automatic prefix caching."""

from __future__ import annotations

import collections
from typing import Sequence

from pagedjax.scheduler.block_hash import block_hashes
from pagedjax.scheduler.block_pool import NULL_BLOCK, BlockPool
from pagedjax.scheduler.host_tier import HostTier, host_slot
from pagedjax.scheduler.request import Request

NULL_HOST = -1  # a host table's slot for a null device slot: no host block holds it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hold_hits(pool: BlockPool, cached_blocks) -> None:
    """Takes references on a prefix hit's device blocks and pins its host tier slots, before
    anything is allocated: no allocation of the same request may evict its own hits."""
    pool.touch([b for b in cached_blocks if b > 0])
    if pool.tier is not None:
        pool.tier.pin([host_slot(b) for b in cached_blocks if b < 0])


class KVCacheManager:
    """Maps each request's logical blocks to physical blocks, taking blocks on demand.

    With prefix caching, every full block whose KV has been computed is published under the
    chained hash of its tokens; a new request takes references on the longest run of published
    blocks that matches its prompt and skips computing them. The hit stops one token short of
    the prompt, so the last prompt token is always computed (its logits are needed):

        prompt   |--- block 0 ---|--- block 1 ---|--- block 2 ---|-- partial --|
        cached   |===== hit =====|===== hit =====|   computed (hit capped at num_tokens - 1)
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 cache_key: bytes = b"", num_host_blocks: int = 0,
                 sliding_window: int | None = None, pool: BlockPool | None = None,
                 host_free: collections.deque | None = None, hash_suffix: bytes = b"",
                 num_tier_blocks: int = 0):
        """pool and host_free: shared with the other groups of a hybrid model
        (scheduler.kv_cache_groups), else this manager's own; hash_suffix tells this group's
        published blocks from the others' (the same tokens, other layers' KV). num_tier_blocks:
        the host tier under the prefix cache (scheduler.host_tier; 0: none)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks) if pool is None else pool
        if num_tier_blocks:
            self.pool.tier = HostTier(num_tier_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.cache_key = cache_key
        self.hash_suffix = hash_suffix
        self.block_tables: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}  # request_id -> blocks already published
        # Copy-on-write block copies (src, dst) for the next step, to run before its KV writes.
        self.pending_copies: list[tuple[int, int]] = []
        # Swap space: host blocks holding the KV of swapped-out requests.
        self.num_host_blocks = num_host_blocks
        self._host_free = (collections.deque(range(num_host_blocks)) if host_free is None
                           else host_free)
        self.host_tables: dict[str, list[int]] = {}
        self.pending_swap_out: list[tuple[int, int]] = []  # (device, host), run first in a step
        self.pending_swap_in: list[tuple[int, int]] = []  # (host, device), run after swap-outs
        self._host_to_release: list[int] = []  # read by this step's swap-ins, free after it
        self.num_allocation_failures = 0  # allocate_slots calls the free blocks could not meet

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= self.pool.num_usable_blocks

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The published blocks matching request's leading full blocks (at most num_tokens - 1
        tokens' worth); empty without prefix caching, and for a request that computes its whole
        prompt (Request.computes_whole_prompt: prompt logprobs, pooling every token)."""
        if (not self.enable_prefix_caching
                or request.computes_whole_prompt):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in block_hashes(request, self.block_size, max_blocks, self.cache_key):
            block = self.pool.lookup(block_hash + self.hash_suffix)
            if block is None:
                break
            hits.append(block)  # a device block, or a host tier's hit (negative)
        return hits

    def num_new_blocks(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[int] = ()) -> int:
        """Free blocks that allocate_slots would consume: new blocks, cached ones that are free
        now and would be revived, and a copy-on-write copy of a shared partial block."""
        table = self.block_tables.get(request.request_id)
        if table is not None:
            num_computed = request.num_computed_tokens
            shared = (num_computed % self.block_size != 0 and num_new_tokens > 0
                      and self.pool.ref_counts[table[num_computed // self.block_size]] > 1)
            return max(0, self.num_blocks_for(num_computed + num_new_tokens) - len(table)) \
                + shared
        num_computed = request.num_computed_tokens or len(cached_blocks) * self.block_size
        needed = max(0, self.num_blocks_for(num_computed + num_new_tokens) - len(cached_blocks))
        # a free device hit is revived; a host hit is loaded into a new block
        return needed + sum(b < 0 or (b > 0 and self.pool.ref_counts[b] == 0)
                            for b in cached_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[int] = (), touched: bool = False) -> list[int] | None:
        """Makes room for num_new_tokens more tokens of request.

        cached_blocks (from find_cached_prefix, for a request holding no blocks) become the head
        of its table (touched: their references were already taken, by a caller that holds
        every group's hits before any group allocates). Returns the newly taken blocks
        (possibly none), or None when the pool has too few free blocks; then nothing is taken
        and the caller may preempt and retry.
        """
        table = self.block_tables.get(request.request_id)
        if table is not None:  # the hot path: a running request grows
            num_computed = request.num_computed_tokens
            num_new = max(0, self.num_blocks_for(num_computed + num_new_tokens) - len(table))
            # The partly filled block about to be written is shared (a fork): copy on write.
            shared = (num_computed % self.block_size != 0 and num_new_tokens > 0
                      and self.pool.ref_counts[table[num_computed // self.block_size]] > 1)
            if num_new + shared > self.pool.num_free_blocks:
                self.num_allocation_failures += 1
                return None
            if shared:
                self._copy_on_write(table, num_computed // self.block_size)
            if num_new == 0:
                return []
            blocks = self.pool.take(num_new)
            table.extend(blocks)
            return blocks
        if self.num_new_blocks(request, num_new_tokens, cached_blocks) > self.pool.num_free_blocks:
            self.num_allocation_failures += 1
            return None
        table = self.block_tables[request.request_id] = []
        if cached_blocks:
            if not touched:  # before allocating: never evict a hit
                hold_hits(self.pool, cached_blocks)
            table.extend(cached_blocks)
            self._load_host_hits(request, table)
            self._num_published[request.request_id] = len(cached_blocks)
        num_computed = max(request.num_computed_tokens, len(cached_blocks) * self.block_size)
        num_new = self.num_blocks_for(num_computed + num_new_tokens) - len(table)
        if num_new <= 0:
            return []
        blocks = self.pool.take(num_new)
        table.extend(blocks)
        return blocks

    def _load_host_hits(self, request: Request, table: list[int]) -> None:
        """Replaces the host tier's hits in table with new device blocks, their loads queued
        for the next step and the blocks published (their KV is in before the step runs)."""
        hits = [i for i, b in enumerate(table) if b < 0]
        if not hits:
            return
        hashes = block_hashes(request, self.block_size, hits[-1] + 1, self.cache_key)
        tier = self.pool.tier
        if tier is None:
            raise RuntimeError("a host tier's hit in a pool without a host tier")
        for i, block in zip(hits, self.pool.take(len(hits))):
            tier.load(host_slot(table[i]), block)
            self.pool.cache_block(block, hashes[i] + self.hash_suffix)
            table[i] = block

    def _copy_on_write(self, table: list[int], index: int) -> None:
        (copy,) = self.pool.take(1)
        shared = table[index]
        self.pending_copies.append((shared, copy))
        table[index] = copy
        self.pool.free([shared])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_pending_state_copies(self) -> list[tuple[int, int]]:
        """A state group's fork copies (scheduler.state_group; none here)."""
        return []

    @property
    def state_blocks(self) -> list[int]:
        """Each KV cache group's fixed blocks a request (a state group's; 0 here)."""
        return [0]

    def free_out_of_window(self, request: Request) -> None:
        """Sliding window: frees the blocks no future query of request can see (all positions
        below num_computed_tokens - window + 1), leaving the null block in their table slots."""
        if self.sliding_window is None:
            return
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        table = self.block_tables.get(request.request_id)
        if not table or first_visible <= self.block_size:
            return
        dead = [i for i in range(min(first_visible // self.block_size, len(table)))
                if table[i] != NULL_BLOCK]
        if dead:
            self.pool.free([table[i] for i in reversed(dead)])
            for i in dead:
                table[i] = NULL_BLOCK

    def trim(self, request: Request, num_tokens: int | None = None) -> None:
        """Frees the blocks past request's first num_tokens tokens (default: its computed ones;
        speculative decoding took them for drafts the target rejected, or that a step dropped):
        its table and the pool's counts become those of plain decoding at the same token count.
        They were never published (past the computed tokens), so they return to the front of
        the pool's free queue."""
        table = self.block_tables.get(request.request_id)
        keep = self.num_blocks_for(request.num_computed_tokens if num_tokens is None
                                   else num_tokens)
        if table is None or len(table) <= keep:
            return
        self.pool.free_unused([b for b in table[keep:] if b != NULL_BLOCK])
        del table[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """child shares every block of parent (one more reference each); the first of them to
        write into a shared, partly filled block copies it first."""
        if child.request_id in self.block_tables:
            raise RuntimeError(f"fork into {child.request_id!r}, which already holds blocks")
        table = self.block_tables[parent.request_id]
        self.pool.incref([b for b in table if b != NULL_BLOCK])
        self.block_tables[child.request_id] = list(table)
        if parent.request_id in self._num_published:
            self._num_published[child.request_id] = self._num_published[parent.request_id]

    def publish_full_blocks(self, request: Request) -> None:
        """Publishes request's blocks that became full of computed KV (prefix caching)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        table = self.block_tables[request.request_id]
        hashes = block_hashes(request, self.block_size, num_full, self.cache_key)
        for i in range(start, num_full):
            if table[i] != NULL_BLOCK:
                self.pool.cache_block(table[i], hashes[i] + self.hash_suffix)
        self._num_published[request.request_id] = num_full

    def swap_out(self, request: Request) -> bool:
        """Moves request's KV to host blocks (the copy runs at the start of the next step) and
        frees its device blocks; False, changing nothing, if the host pool has no room. Null
        slots (a sliding window's freed blocks) take no host block (NULL_HOST)."""
        table = self.block_tables.get(request.request_id, [])
        if sum(b != NULL_BLOCK for b in table) > len(self._host_free):
            return False
        host = [NULL_HOST if b == NULL_BLOCK else self._host_free.popleft() for b in table]
        self.pending_swap_out.extend((b, h) for b, h in zip(table, host) if b != NULL_BLOCK)
        self.host_tables[request.request_id] = host
        self.free(request, keep_host=True)
        return True

    def swap_in_blocks(self, request: Request, num_new_tokens: int) -> int:
        """The device blocks swap_in would take: the swapped-out ones and the growth."""
        host = self.host_tables[request.request_id]
        grow = max(0, self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
                   - len(host))
        return sum(h != NULL_HOST for h in host) + grow

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Device blocks for a swapped-out request and its next num_new_tokens; the host -> device
        copy runs at the start of the next step. None, changing nothing, if there is no room."""
        needed = self.swap_in_blocks(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return None
        blocks = self.pool.take(needed)
        host = self.host_tables.pop(request.request_id)
        taken = iter(blocks)
        table = [NULL_BLOCK if h == NULL_HOST else next(taken) for h in host]
        self.pending_swap_in.extend((h, b) for h, b in zip(host, table) if h != NULL_HOST)
        table.extend(taken)  # the blocks this step grows into
        self._host_to_release.extend(h for h in host if h != NULL_HOST)
        self.block_tables[request.request_id] = table
        return blocks

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        swaps = (self.pending_swap_out, self.pending_swap_in)
        self.pending_swap_out, self.pending_swap_in = [], []
        return swaps

    def release_host_blocks(self) -> None:
        """After a step ran its swap-ins, their host blocks may be reused."""
        self._host_free.extend(self._host_to_release)
        self._host_to_release = []

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def free(self, request: Request, keep_host: bool = False) -> None:
        """Returns all of request's blocks to the pool; a no-op if it holds none."""
        if not keep_host:
            self._host_free.extend(h for h in self.host_tables.pop(request.request_id, ())
                                   if h != NULL_HOST)
        self._num_published.pop(request.request_id, None)
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # Tail first, so that the head of a sequence stays in the pool longest.
            self.pool.free([b for b in reversed(table) if b != NULL_BLOCK])

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    num_groups = 1  # KV cache groups (scheduler.kv_cache_groups has more)

    @property
    def hash_suffixes(self) -> list[bytes]:
        """Each KV cache group's suffix of its published blocks' hashes (one group here)."""
        return [self.hash_suffix]

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """Each KV cache group's table (one group here)."""
        return [self.get_block_table(request_id)]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def drop_cached_content(self) -> None:
        """Forgets every block's published content: the device cache was lost (a fresh one holds
        zeros), so no block may be found by its hash any more."""
        self.pool.drop_cached()
        self._num_published.clear()

    @property
    def num_evictions(self) -> int:
        """Cached blocks the pool has reused for other content so far."""
        return self.pool.num_evictions

    @property
    def host_tier(self) -> HostTier | None:
        return self.pool.tier
