"""Per-request block tables over a BlockPool."""

from __future__ import annotations

from scheduler.block_pool import BlockPool
from scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request's logical blocks to physical blocks, taking blocks on demand."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= self.pool.num_usable_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        table = self.block_tables.get(request.request_id, ())
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(table))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Makes room for num_new_tokens more tokens of request.

        Returns the newly taken blocks (possibly none), or None when the pool has too few free
        blocks; then nothing is taken and the caller may preempt and retry.
        """
        num_new = self.num_new_blocks(request, num_new_tokens)
        if num_new == 0:
            self.block_tables.setdefault(request.request_id, [])
            return []
        blocks = self.pool.allocate(num_new)
        if blocks is None:
            return None
        self.block_tables.setdefault(request.request_id, []).extend(blocks)
        return blocks

    def free(self, request: Request) -> None:
        """Returns all of request's blocks to the pool; a no-op if it holds none."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # Tail first, so that the head of a sequence stays in the pool longest.
            self.pool.free(table[::-1])

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks
