"""The host tier under the device prefix cache: blocks the device pool evicts keep their KV in
host memory, found again by their chained hash (SGLang's HiCache host pool, vLLM's CPU offload
connector).

This is the bookkeeping only (NumPy-free, no I/O): which host slot holds which hash, LRU among
them, and the transfers the next step must run before its forward, in this order:

1. `spills`: (hash, slot) pairs this step's offloads evict from the host tier; their content
   is read (for the disk tier) before anything overwrites the slot.
2. `offloads`: (device block, slot): the device block's content (evicted from the device
   cache by this step's allocations) copied to the slot before the step writes the block;
   `overflow`: (device block, hash) evicted when every slot was in use by this step (read for
   the disk tier straight from the device, lost without one).
3. `loads`: (slot, device block): a host hit copied into a freshly allocated device block.

A slot that this step writes or reads is pinned until the next schedule (`release`), so no
transfer of one step overwrites what another of the same step reads.
"""

from __future__ import annotations

import collections


def host_hit(slot: int) -> int:
    """How a host hit appears in a prefix hit's block list: a negative number (a device block
    is >= 0), the slot recoverable by host_slot."""
    return -(slot + 1)


def host_slot(entry: int) -> int:
    return -entry - 1


class HostTier:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.slots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.slot_hash: list[bytes | None] = [None] * num_blocks
        self._free = collections.deque(range(num_blocks))
        self._pinned: set[int] = set()
        self._held: set[int] = set()  # brought up for the next schedule (insert)
        self.offloads: list[tuple[int, int]] = []
        self.loads: list[tuple[int, int]] = []
        self.spills: list[tuple[bytes, int]] = []
        self.overflow: list[tuple[int, bytes]] = []
        # counters (blocks)
        self.num_stored = 0  # device evictions copied in
        self.num_hits = 0  # blocks loaded back to the device
        self.num_misses = 0  # blocks of admitted prompts asked of this tier and not held
        self.num_evictions = 0  # entries dropped to make room (spilled to disk if it is on)
        self.num_overflow = 0  # device evictions with every slot in use by this step

    @property
    def num_used_blocks(self) -> int:
        return len(self.slots)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding block_hash, or None (no side effect: a lookup is not a use)."""
        return self.slots.get(block_hash)

    def offload(self, block: int, block_hash: bytes) -> None:
        """The device pool evicts block (holding block_hash): keep its content here."""
        if block_hash in self.slots:  # already held (it was loaded from here): a use
            self.slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.overflow.append((block, block_hash))
            self.num_overflow += 1
            return
        self.slots[block_hash] = slot
        self.slot_hash[slot] = block_hash
        self._pinned.add(slot)
        self.offloads.append((block, slot))
        self.num_stored += 1

    def insert(self, block_hash: bytes) -> int | None:
        """A slot for block_hash whose content the caller writes now (a disk hit brought up
        before a schedule), kept from reuse until that schedule's end; None when every slot is
        in use. Already held: its slot."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            slot = self.slots[block_hash]
        else:
            taken = self._take_slot()
            if taken is None:
                return None
            slot = taken
            self.slots[block_hash] = slot
            self.slot_hash[slot] = block_hash
        self._held.add(slot)
        return slot

    def hold(self, block_hash: bytes) -> None:
        """Keeps a held block (found by a walk bringing up the rest of a prefix) from reuse
        until the next schedule's end, as insert does."""
        slot = self.slots.get(block_hash)
        if slot is not None:
            self.slots.move_to_end(block_hash)
            self._held.add(slot)

    def has_room(self) -> bool:
        """Whether insert would find a slot."""
        return bool(self._free) or len(self._pinned | self._held) < len(self.slots)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for block_hash, slot in self.slots.items():  # least recently used first
            if slot not in self._pinned and slot not in self._held:
                del self.slots[block_hash]
                self.slot_hash[slot] = None
                self.spills.append((block_hash, slot))
                self.num_evictions += 1
                return slot
        return None

    def pin(self, slots) -> None:
        """Keeps slots (hits about to be loaded) from being reused until the next release."""
        self._pinned.update(slots)

    def load(self, slot: int, block: int) -> None:
        """Queues the copy of slot into device block for the next step."""
        self._pinned.add(slot)
        block_hash = self.slot_hash[slot]
        assert block_hash is not None, f"host slot {slot} holds no block"
        self.slots.move_to_end(block_hash)
        self.loads.append((slot, block))
        self.num_hits += 1

    def take_transfers(self):
        """(spills, offloads, overflow, loads) for the next step, in the order they run."""
        taken = self.spills, self.offloads, self.overflow, self.loads
        self.spills, self.offloads, self.overflow, self.loads = [], [], [], []
        self._held.clear()  # the schedule has taken what was brought up for it
        return taken

    def clear(self) -> None:
        """Forgets every entry (the engine's reset_prefix_cache): every slot free again."""
        self.slots.clear()
        self.slot_hash = [None] * self.num_blocks
        self._free = collections.deque(range(self.num_blocks))
        self._pinned.clear()
        self._held.clear()

    def release(self) -> None:
        """The previous step ran its transfers: its slots may be reused."""
        self._pinned.clear()
