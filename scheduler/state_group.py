"""The state group of a hybrid model's KV cache (vLLM's mamba / linear-attention group beside the
attention groups): its linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next) keep a
fixed-size state per sequence, not KV per token, and that state lives in the same pool as the
attention pages, in a fixed number of blocks a request (StateWindow.num_blocks: the state's
bytes over a page's, so the page size stays one).

A request takes its state blocks with its first attention blocks (HybridKVCacheManager's
all-or-nothing allocation over the groups) and holds them, never more, until it ends. They are
its own: a fork (n > 1, beam search) gives the child the blocks reserved for it when its parent
was admitted and copies the parent's state into them (the copy runs before the next step, after
the step that finished the parent's prompt); a swap copies them to host and back like any block; a preemption by recompute frees
them and the recomputed prefill starts from a zero state (a sequence whose first query token is
at position 0 never reads its blocks). Nothing is published: a state block's content is the
state after the request's latest token, not a function of one block's tokens, so prefix caching
is off for these models (HybridKVCacheManager.find_cached_prefix finds nothing).
"""

from __future__ import annotations

import dataclasses

from pagedjax.scheduler.kv_cache_manager import KVCacheManager
from pagedjax.scheduler.request import Request


@dataclasses.dataclass(frozen=True)
class StateWindow:
    """A KV cache group's "window" when the group holds state, not KV: the blocks a request
    holds in it, whatever its length."""

    num_blocks: int

    def __post_init__(self):
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"a state group holds at least one block a request, got "
                             f"{self.num_blocks!r}")


class StateGroupManager(KVCacheManager):
    """KVCacheManager's interface for a state group: num_blocks a request, taken whole, and as
    many for each of its parallel samples not yet forked (they fork onto them: a fork never
    allocates, so it never fails)."""

    def __init__(self, window: StateWindow, num_blocks: int, block_size: int, **kwargs):
        super().__init__(num_blocks, block_size, **{**kwargs, "enable_prefix_caching": False})
        self.num_state_blocks = window.num_blocks
        self._reserved: dict[str, tuple[str, list[int]]] = {}  # follower -> (leader, blocks)
        # forks' (src, dst) copies: whole states, run before the next step and its swaps
        # (SchedulerOutput.state_copies), not in the step as a copy-on-write's
        self.pending_state_copies: list[tuple[int, int]] = []

    def num_blocks_for(self, num_tokens: int) -> int:
        return self.num_state_blocks

    def _follower_blocks(self, request: Request) -> int:
        return self.num_state_blocks * len(request.followers)

    def num_new_blocks(self, request: Request, num_new_tokens: int, cached_blocks=()) -> int:
        if cached_blocks:
            raise ValueError("a state group serves no prefix-cache hit")
        if request.request_id in self.block_tables:
            return 0
        return self.num_state_blocks + self._follower_blocks(request)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks=(),
                       touched: bool = False) -> list[int] | None:
        needed = self.num_new_blocks(request, num_new_tokens, cached_blocks)
        if needed > self.pool.num_free_blocks:
            self.num_allocation_failures += 1
            return None
        if not needed:
            return []
        blocks = self.pool.take(self.num_state_blocks)
        self.block_tables[request.request_id] = list(blocks)
        return blocks + self._reserve(request)

    def _reserve(self, request: Request) -> list[int]:
        """Blocks for each follower of request, held until it forks (or request ends)."""
        taken = []
        for follower in request.followers:
            blocks = self.pool.take(self.num_state_blocks)
            self._reserved[follower.request_id] = (request.request_id, blocks)
            taken += blocks
        return taken

    def take_pending_state_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_state_copies = self.pending_state_copies, []
        return copies

    @property
    def state_blocks(self) -> list[int]:
        return [self.num_state_blocks]

    def reserved_tables(self) -> dict[str, list[int]]:
        """The blocks each request holds for its followers not yet forked."""
        tables: dict[str, list[int]] = {}
        for leader, blocks in self._reserved.values():
            tables.setdefault(leader, []).extend(blocks)
        return tables

    def fork(self, parent: Request, child: Request) -> None:
        """child takes its reserved blocks, the parent's state copied into them before the next
        step (after the step that finished the parent's prompt)."""
        if child.request_id in self.block_tables:
            raise RuntimeError(f"fork into {child.request_id!r}, which already holds blocks")
        _, blocks = self._reserved.pop(child.request_id)
        self.pending_state_copies.extend(zip(self.block_tables[parent.request_id], blocks))
        self.block_tables[child.request_id] = list(blocks)

    def free(self, request: Request, keep_host: bool = False) -> None:
        """request's blocks, and those reserved for its followers not forked."""
        super().free(request, keep_host)
        for follower, (leader, blocks) in list(self._reserved.items()):
            if request.request_id in (leader, follower):
                del self._reserved[follower]
                self.pool.free(blocks)

    def swap_in_blocks(self, request: Request, num_new_tokens: int) -> int:
        return len(self.host_tables[request.request_id]) + self._follower_blocks(request)

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """The state's blocks back (copied in at the next step), the followers' reserved."""
        if self.swap_in_blocks(request, num_new_tokens) > self.pool.num_free_blocks:
            return None
        host = self.host_tables.pop(request.request_id)
        blocks = self.pool.take(len(host))
        self.pending_swap_in.extend(zip(host, blocks))
        self._host_to_release.extend(host)
        self.block_tables[request.request_id] = list(blocks)
        return blocks + self._reserve(request)

    def trim(self, request: Request, num_tokens: int | None = None) -> None:
        """Nothing to give back: the state is the same blocks at any length. (Speculative
        decoding, which trims rejected drafts, is refused for these models: the state would
        hold the drafts.)"""

    def publish_full_blocks(self, request: Request) -> None:
        """Nothing is published (the module docstring)."""
