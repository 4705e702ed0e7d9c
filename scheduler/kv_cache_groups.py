"""KV cache groups: one block table per request for each group of layers, over one block pool
(vLLM V1's hybrid KV cache manager; pagedjax.models.layers.kv_groups forms the groups).

A model whose layers differ in attention (Gemma 2/3: sliding-window and global layers) gets one
group per kind (several when a kind has more layers than a group holds: every group has the
same number of layers, so one block id is one page of every layer slot and the page size is one).
A full-attention group keeps every block of a request; a sliding-window group frees the blocks
that fall wholly out of its window as the request grows, so it holds at most
ceil((window - 1 + tokens scheduled this step) / block_size) + 1 blocks a request.

HybridKVCacheManager has KVCacheManager's interface, its calls fanned out to one
KVCacheManager per group sharing the pool (and the host swap space). An allocation is all or
nothing over the groups. Prefix caching: each group publishes its own blocks (under hashes
salted by the group), and a hit is the longest prefix every group can serve: a full group
needs every block before the hit point, a sliding group only the blocks its window still sees
from there (those before stay null in its table).
"""

from __future__ import annotations

import collections
from typing import Sequence

from pagedjax.scheduler.block_hash import block_hashes
from pagedjax.scheduler.block_pool import NULL_BLOCK, BlockPool
from pagedjax.scheduler.host_tier import HostTier
from pagedjax.scheduler.kv_cache_manager import NULL_HOST, KVCacheManager, cdiv, hold_hits
from pagedjax.scheduler.request import Request
from pagedjax.scheduler.state_group import StateGroupManager, StateWindow


def blocks_for(windows: Sequence[int | None], block_size: int, num_tokens: int,
               max_tokens_per_step: int | None = None) -> int:
    """The most blocks a request of num_tokens holds over groups of these windows: every block
    in a full group; in a sliding one, the window's and a step's (max_tokens_per_step); in a
    state group (scheduler.state_group), its fixed count."""
    total = 0
    for window in windows:
        if isinstance(window, StateWindow):
            total += window.num_blocks
            continue
        blocks = cdiv(num_tokens, block_size)
        if window is not None:
            step = max_tokens_per_step or num_tokens
            blocks = min(blocks, cdiv(window - 1 + step, block_size) + 1)
        total += blocks
    return total


def group_table_width(windows: Sequence[int | None], block_size: int, max_model_len: int,
                      max_tokens_per_step: int | None = None) -> int | None:
    """The block-table width of the KV cache groups past the first in a BatchPlan (None when
    there are none): a full group's table spans max_model_len; a sliding group's is a ring of
    its bound's width (blocks_for), logical block p of a request at column p % width. Every
    block a step reads lies in the bound's last blocks of the request's table, so no two of
    them share a column."""
    if len(windows) < 2:
        return None
    return max(blocks_for([w], block_size, max_model_len, max_tokens_per_step)
               for w in windows[1:])


class CachedPrefix(list):
    """find_cached_prefix's answer for several groups: the hit's length in blocks (len) and
    each group's table head (groups[g]: a block, or the null block a sliding group skips)."""

    def __init__(self, groups: list[list[int]]):
        super().__init__(groups[0] if groups else [])
        self.groups = groups


class HybridKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None], *,
                 enable_prefix_caching: bool = False, cache_key: bytes = b"",
                 num_host_blocks: int = 0, max_tokens_per_step: int | None = None,
                 num_tier_blocks: int = 0):
        """windows: each group's attention window (None: full attention). max_tokens_per_step
        (the scheduler's token budget) bounds what a sliding group holds in num_blocks_for.
        num_tier_blocks: the host tier's size (scheduler.host_tier; 0: none), shared by the
        groups as the pool is."""
        if not windows:
            raise ValueError("a hybrid KV cache needs at least one group")
        self.block_size = block_size
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks)
        if num_tier_blocks:
            self.pool.tier = HostTier(num_tier_blocks)
        self.num_host_blocks = num_host_blocks
        self._host_free = collections.deque(range(num_host_blocks))
        self.max_tokens_per_step = max_tokens_per_step
        # a state group publishes nothing, so no prefix is ever served whole: caching is off
        self.has_state = any(isinstance(w, StateWindow) for w in self.windows)
        enable_prefix_caching = enable_prefix_caching and not self.has_state
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = [StateGroupManager(window, num_blocks, block_size,
                                         num_host_blocks=num_host_blocks, pool=self.pool,
                                         host_free=self._host_free, cache_key=cache_key)
                       if isinstance(window, StateWindow) else
                       KVCacheManager(num_blocks, block_size,
                                      enable_prefix_caching=enable_prefix_caching,
                                      sliding_window=window, hash_suffix=b"|%d" % g,
                                      num_host_blocks=num_host_blocks, pool=self.pool,
                                      host_free=self._host_free, cache_key=cache_key)
                       for g, window in enumerate(self.windows)]
        self.num_allocation_failures = 0

    @property
    def cache_key(self) -> bytes:
        return self.groups[0].cache_key

    @cache_key.setter
    def cache_key(self, key: bytes) -> None:
        """Every group's (new weights: no block of the old ones is a hit again)."""
        for group in self.groups:
            group.cache_key = key

    @property
    def hash_suffixes(self) -> list[bytes]:
        return [group.hash_suffix for group in self.groups]

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def state_blocks(self) -> list[int]:
        """Each group's fixed blocks a request (a state group's), 0 for an attention group."""
        return [n for group in self.groups for n in group.state_blocks]

    def num_blocks_for(self, num_tokens: int) -> int:
        return blocks_for(self.windows, self.block_size, num_tokens, self.max_tokens_per_step)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= self.pool.num_usable_blocks

    # ---- prefix caching ---------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of leading blocks every group can serve (see the module docstring)."""
        if (not self.enable_prefix_caching
                or request.computes_whole_prompt):
            return CachedPrefix([])
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = block_hashes(request, self.block_size, max_blocks, self.groups[0].cache_key)
        found = [[self.pool.lookup(h + group.hash_suffix) for h in hashes]
                 for group in self.groups]  # per group: a block, a host hit or None at each
        # A full group serves no more than its leading run of hits: start there, not at the
        # prompt's end (a miss would otherwise cost a scan of every shorter hit).
        longest = min([next((i for i, b in enumerate(blocks) if b is None), max_blocks)
                       for blocks, window in zip(found, self.windows) if window is None],
                      default=max_blocks)
        for hit in range(longest, 0, -1):
            heads = [self._group_head(found[g], window, hit)
                     for g, window in enumerate(self.windows)]
            served = [head for head in heads if head is not None]
            if len(served) == len(heads):
                return CachedPrefix(served)
        return CachedPrefix([])

    def _group_head(self, blocks: list, window: int | None, hit: int) -> list[int] | None:
        """A group's table head for a hit of `hit` blocks, or None if it cannot serve it."""
        first = 0
        if window is not None:  # the next token (position hit * bs) sees from here on
            first = max(0, hit * self.block_size - window + 1) // self.block_size
        if any(b is None for b in blocks[first:hit]):
            return None
        return [NULL_BLOCK] * first + list(blocks[first:hit])

    def _heads(self, cached) -> list[list[int]]:
        if isinstance(cached, CachedPrefix) and cached.groups:
            return cached.groups
        if cached:
            raise ValueError("a hybrid KV cache takes find_cached_prefix's CachedPrefix")
        return [[] for _ in self.groups]

    # ---- allocation -------------------------------------------------------------------------

    def num_new_blocks(self, request: Request, num_new_tokens: int, cached_blocks=()) -> int:
        return sum(group.num_new_blocks(request, num_new_tokens, head)
                   for group, head in zip(self.groups, self._heads(cached_blocks)))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks=()) -> list[int] | None:
        """Every group's room for num_new_tokens more tokens, or None (nothing taken)."""
        heads = self._heads(cached_blocks)
        if self.num_new_blocks(request, num_new_tokens, cached_blocks) > self.pool.num_free_blocks:
            self.num_allocation_failures += 1
            return None
        for head in heads:  # every group's hits held before any group allocates (evicts)
            hold_hits(self.pool, head)
        taken = []
        for group, head in zip(self.groups, heads):
            blocks = group.allocate_slots(request, num_new_tokens, head, touched=True)
            if blocks is None:  # cannot happen after the check above; say so if it does
                raise RuntimeError("a KV cache group failed an allocation the pool had room for")
            taken += blocks
        return taken

    def free_out_of_window(self, request: Request) -> None:
        for group in self.groups:
            group.free_out_of_window(request)

    def trim(self, request: Request, num_tokens: int | None = None) -> None:
        for group in self.groups:
            group.trim(request, num_tokens)

    def fork(self, parent: Request, child: Request) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def publish_full_blocks(self, request: Request) -> None:
        for group in self.groups:
            group.publish_full_blocks(request)

    def free(self, request: Request, keep_host: bool = False) -> None:
        for group in self.groups:
            group.free(request, keep_host)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return [copy for group in self.groups for copy in group.take_pending_copies()]

    def take_pending_state_copies(self) -> list[tuple[int, int]]:
        """The state groups' fork copies (scheduler.state_group), whole blocks."""
        return [copy for group in self.groups for copy in group.take_pending_state_copies()]

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        return [copy for group in self.groups for copy in group.pending_copies]

    # ---- swap -------------------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Every group's blocks to host blocks (a sliding group's live ones: its nulls stay
        null), or False changing nothing."""
        needed = sum(b != NULL_BLOCK for group in self.groups
                     for b in group.block_tables.get(request.request_id, ()))
        if needed > len(self._host_free):
            return False
        for group in self.groups:
            group.swap_out(request)
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        needed = sum(group.swap_in_blocks(request, num_new_tokens) for group in self.groups)
        if needed > self.pool.num_free_blocks:
            return None
        taken: list[int] = []
        for group in self.groups:
            blocks = group.swap_in(request, num_new_tokens)
            if blocks is None:  # the room was counted above
                raise RuntimeError(f"group swap-in of {request.request_id!r} found no room")
            taken += blocks
        return taken

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        outs, ins = [], []
        for group in self.groups:
            out, into = group.take_pending_swaps()
            outs += out
            ins += into
        return outs, ins

    def release_host_blocks(self) -> None:
        for group in self.groups:
            group.release_host_blocks()

    @property
    def host_tables(self) -> dict[str, list[int]]:
        tables: dict[str, list[int]] = {}
        for group in self.groups:
            for request_id, host in group.host_tables.items():
                tables.setdefault(request_id, []).extend(h for h in host if h != NULL_HOST)
        return tables

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    # ---- tables and counts ------------------------------------------------------------------

    def get_block_table(self, request_id: str) -> list[int]:
        """The first group's table (a full-attention group's when the model has one)."""
        return self.groups[0].get_block_table(request_id)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        return [group.get_block_table(request_id) for group in self.groups]

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Every block a request holds, over all groups (the null block left out; a state
        group's reserved for its followers too)."""
        tables: dict[str, list[int]] = {}
        for group in self.groups:
            held = [group.block_tables.items()]
            if isinstance(group, StateGroupManager):
                held.append(group.reserved_tables().items())
            for items in held:
                for request_id, table in items:
                    tables.setdefault(request_id, []).extend(b for b in table
                                                             if b != NULL_BLOCK)
        return tables

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    @property
    def host_tier(self) -> HostTier | None:
        return self.pool.tier

    def drop_cached_content(self) -> None:
        for group in self.groups:
            group.drop_cached_content()
