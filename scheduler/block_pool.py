"""The pool of physical KV blocks: a free queue and reference counts."""

from __future__ import annotations

import collections

NULL_BLOCK = 0  # never allocated, never freed: the target of every padding write and table entry


class BlockPool:
    """Physical block ids 1..num_blocks-1 with O(1) allocate and free.

    Freed blocks go to the back of the free queue and allocation takes from the front, so a
    recently freed block is the last to be reused (what a prefix cache will want to keep).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = collections.deque(range(1, num_blocks))

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
        """Takes num_blocks blocks with ref count 1, or returns None (and takes nothing)."""
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"incref of free block {block}")
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drops one reference from each block; blocks reaching zero return to the free queue."""
        for block in blocks:
            count = self.ref_counts[block]
            if count <= 0 or block == NULL_BLOCK:
                raise RuntimeError(f"free of unreferenced block {block} (ref count {count})")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)

    def free_block_ids(self) -> list[int]:
        return list(self._free)
