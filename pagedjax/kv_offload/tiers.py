"""The engine's side of the tiered prefix cache (scheduler.host_tier keeps the books): the host
tier's arrays, the transfers each step's schedule asks for, the disk tier under it, the model
key that names a block's content across processes, and the tiers' counters.

A step's transfers run before its forward (KVTiers.copy_out, copy_in): the host tier's spills
are read out for the disk tier, the device blocks the schedule evicted are copied out, then the
host hits are copied into their new device blocks. The copies out are dispatched and their host copies
started without waiting (`copy_to_host_async`): they land in the host arrays when something
needs them (a load of the same slot, a spill, a disk read, the next step's flush), so an
offload never waits on the step in flight. The loads are dispatched too: the step that reads
them is ordered after them on the device.

Disk hits come up before a schedule (KVTiers.prefetch): the waiting requests the next step may
admit have their prefix walked past what the device and host hold, and the blocks found on disk
are read into host slots, where the schedule finds them as host hits. A request whose walk
found the host tier full of what the others took up waits one schedule for the rest
(Request.awaiting_kv), unless nothing else would run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.kv_offload.block_transfers import host_block, set_host_block, store_blocks
from pagedjax.kv_offload.disk_tier import DiskTier
from pagedjax.scheduler import RequestStatus
from pagedjax.scheduler.block_hash import block_hashes


def weights_fingerprint(params, samples: int = 64) -> str:
    """Names a model's weights across processes without reading them all: every leaf's shape,
    dtype and `samples` values strided over it (two checkpoints of one architecture differ in
    nearly every weight, fine-tunes included)."""
    leaves = jax.tree.leaves(params)

    def sample(leaf):
        flat = leaf.reshape(-1)
        stride = max(1, flat.size // samples)
        return flat[::stride][:samples].astype(jnp.float32)

    values = jax.jit(lambda ls: [sample(leaf) for leaf in ls])(leaves)
    digest = hashlib.blake2b(digest_size=16)
    for leaf, value in zip(leaves, values):
        digest.update(repr((leaf.shape, str(leaf.dtype))).encode())
        digest.update(np.asarray(value).tobytes())
    return digest.hexdigest()


@dataclasses.dataclass
class TierTransfers:
    """Blocks and time moved between the device and the host tier."""

    blocks_to_host: int = 0
    blocks_to_device: int = 0
    transfer_s: float = 0.0  # host time issuing transfers and waiting for them


class KVTiers:
    def __init__(self, runner, num_blocks: int, bytes_per_block: int,
                 disk: DiskTier | None = None):
        self.runner = runner
        self.num_layers = runner.graph.num_kv_slots
        self.host_pool = runner.init_host_pool(num_blocks)
        runner.attach_tier_pool(self.host_pool)  # a multi-host follower's moves use it
        # Multi-host, every copy out is announced to the followers and waited for (each
        # process stores its own shards at once); single-host they land asynchronously.
        self._synchronous = runner.channel is not None or not all(
            leaf.is_fully_addressable for leaf in jax.tree.leaves(runner.kv_cache))
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.disk = disk
        self.moved = TierTransfers()
        self._pending: list[tuple[list[int], object]] = []  # copies out not yet in host_pool
        self._pending_slots: set[int] = set()
        # (request id, preemptions): a waiting request whose prefix was walked (again once
        # preempted: its blocks may have gone down the tiers since)
        self._prefetched: set[tuple[str, int]] = set()
        self._retried: set[tuple[str, int]] = set()  # those that waited a schedule for more
        self._awaiting: list = []  # the request waiting this schedule (Request.awaiting_kv)
        # the host tier's counts of schedulers before this one (fail_all starts a new one)
        self._counted = {"hits": 0, "misses": 0, "evictions": 0, "overflow": 0}

    def copy_out(self, output) -> None:
        """A schedule's spills, offloads and overflow: the first of its transfers, before any
        write into the device cache (its swaps, its loads). The previous step's copies out land
        first (dispatched a step ago, they are done unless that step is the one in flight)."""
        self.flush()
        if not (output.tier_spills or output.tier_offloads or output.tier_overflow):
            return
        start = time.perf_counter()
        disk = self.disk if self.disk is not None and self.disk.enabled else None
        if disk is not None:
            self._write_down(disk, output.tier_spills)
        if output.tier_offloads:
            device, slots = map(list, zip(*output.tier_offloads))
            if self._synchronous:
                self.runner.blocks_to_host(device, self.host_pool, slots)
            else:
                self._pending.append((slots, self._read(device)))
                self._pending_slots.update(slots)
            self.moved.blocks_to_host += len(slots)
        if output.tier_overflow and disk is not None:
            device, hashes = map(list, zip(*output.tier_overflow))
            self._pending.append((hashes, self._read(device)))
        self.moved.transfer_s += time.perf_counter() - start

    def _read(self, device: list[int]):
        blocks = self.runner.read_blocks(device)
        for leaf in jax.tree.leaves(blocks):
            leaf.copy_to_host_async()
        return blocks

    def copy_in(self, output) -> None:
        """A schedule's loads: host hits into their new device blocks, the last transfers."""
        if not output.tier_loads:
            return
        start = time.perf_counter()
        slots, device = map(list, zip(*output.tier_loads))
        if self._pending_slots.intersection(slots):
            self.flush()
        self.runner.write_blocks(device, self.host_pool, slots)
        self.moved.blocks_to_device += len(slots)
        self.moved.transfer_s += time.perf_counter() - start

    def flush(self) -> None:
        """Lands every copy out (waiting for those still in flight): in the host arrays, or,
        the overflow's (named by hashes), in the disk tier's queue."""
        for targets, blocks in self._pending:
            if isinstance(targets[0], bytes):
                blocks = jax.tree.map(np.asarray, blocks)
                for i, block_hash in enumerate(targets):
                    self.disk.write(block_hash, host_block(blocks, i, self.num_layers))
            else:
                store_blocks(self.host_pool, targets, blocks, self.num_layers)
        self._pending.clear()
        self._pending_slots.clear()

    def prefetch(self, state) -> None:
        """Brings the disk tier's blocks of the waiting requests the next step may admit into
        host slots (see the module docstring); a request's prefix is walked once an
        admission (again after a preemption)."""
        for request in self._awaiting:
            request.awaiting_kv = False
        self._awaiting.clear()
        disk = self.disk
        if disk is None or not disk.enabled or not disk.num_blocks:
            return
        kv = state.kv_manager
        room = max(0, state.config.max_num_seqs - state.num_seqs)
        walk = [r for r in itertools.islice(state.waiting, room)
                if (r.request_id, r.num_preemptions) not in self._prefetched
                and r.status != RequestStatus.SWAPPED
                and not r.computes_whole_prompt]
        if not walk:
            return
        start = time.perf_counter()
        self.flush()  # no copy out may land on a slot after a disk block is written there
        # and the last step's loads have staged their host blocks: its slots are free to reuse
        kv.host_tier.release()
        for request in walk:
            rid = request.request_id, request.num_preemptions
            if self._bring_up(kv, request, disk) or rid in self._retried:
                self._prefetched.add(rid)
                continue
            # The host tier is full of what this schedule takes up: the request waits one
            # schedule for the rest of its blocks (if another request makes progress in it).
            self._retried.add(rid)
            if state.running or request is not state.waiting[0]:
                request.awaiting_kv = True
                self._awaiting.append(request)
            break
        if len(self._prefetched) > 4 * state.config.max_num_seqs:
            self._prefetched = {k for k in self._prefetched if k[0] in state.requests}
            self._retried = {k for k in self._retried if k[0] in state.requests}
        self.moved.transfer_s += time.perf_counter() - start

    def _bring_up(self, kv, request, disk: DiskTier) -> bool:
        """Walks request's prompt blocks (every KV cache group's) until one is held nowhere;
        False when the host tier had no room left for the next (the walk is to be resumed)."""
        tier = kv.host_tier
        suffixes = kv.hash_suffixes
        max_blocks = (request.num_tokens - 1) // kv.block_size
        for block_hash in block_hashes(request, kv.block_size, max_blocks, kv.cache_key):
            held = False
            for suffix in suffixes:
                key = block_hash + suffix
                found = kv.pool.lookup(key)
                if found is not None:
                    if found < 0:  # in the host tier: not to be evicted by this walk's own
                        tier.hold(key)
                    held = True
                    continue
                if key not in disk:
                    disk.num_misses += 1
                    continue
                if not tier.has_room():  # every host slot is in use by this step
                    return False
                leaves = disk.read(key)
                if leaves is None:
                    continue
                slot = tier.insert(key)
                self._write_down(disk, tier.spills)  # what it evicted, before its slot is reused
                tier.spills.clear()
                set_host_block(self.host_pool, slot, leaves, self.num_layers)
                held = True
            if not held:
                return True
        return True

    def _write_down(self, disk: DiskTier, spills) -> None:
        """Queues the host blocks (hash, slot) the host tier evicted for the disk tier (those it
        does not hold already)."""
        for block_hash, slot in spills:
            if block_hash not in disk:
                disk.write(block_hash, host_block(self.host_pool, slot, self.num_layers))

    def counters(self, kv) -> dict[str, dict[str, float]]:
        """Each tier's running totals (blocks, bytes, seconds; additive over replicas):
        hits, misses, evictions, blocks and bytes in (into the tier) and out (back up),
        transfer time, bytes used and capacity, and what went wrong."""
        tier, moved, size, before = kv.host_tier, self.moved, self.bytes_per_block, self._counted
        counts = {"host": {
            "hits": before["hits"] + tier.num_hits,
            "misses": before["misses"] + tier.num_misses,
            "evictions": before["evictions"] + tier.num_evictions,
            "blocks_in": moved.blocks_to_host, "blocks_out": moved.blocks_to_device,
            "bytes_in": moved.blocks_to_host * size, "bytes_out": moved.blocks_to_device * size,
            "transfer_s": moved.transfer_s, "used_bytes": tier.num_used_blocks * size,
            "capacity_bytes": tier.num_blocks * size,
            "overflow": before["overflow"] + tier.num_overflow}}
        disk = self.disk
        if disk is not None:
            counts["disk"] = {
                "hits": disk.num_hits, "misses": disk.num_misses,
                "evictions": disk.num_evictions, "blocks_in": disk.num_writes,
                "blocks_out": disk.num_hits, "bytes_in": disk.bytes_written,
                "bytes_out": disk.bytes_read, "transfer_s": disk.read_s + disk.write_s,
                "used_bytes": disk.bytes_used, "capacity_bytes": disk.capacity_bytes,
                "corrupt": disk.num_corrupt, "dropped_writes": disk.num_dropped_writes,
                "write_errors": disk.num_write_errors}
        return counts

    def start_over(self, kv) -> None:
        """The engine starts over with a new scheduler (StepRecovery.fail_all), its host tier
        empty: copies out in flight are dropped, kv's tier's counts carried on."""
        tier = kv.host_tier
        for name, count in (("hits", tier.num_hits), ("misses", tier.num_misses),
                            ("evictions", tier.num_evictions), ("overflow", tier.num_overflow)):
            self._counted[name] += count
        self._pending.clear()
        self._pending_slots.clear()
        self._awaiting.clear()
        self._prefetched.clear()
        self._retried.clear()

    def close(self, kv) -> None:
        """Shutdown: with a disk tier, writes down every cached block the host tier and the
        device pool (kv's) hold that the disk lacks, so that a restart finds them all, and
        waits for the writer."""
        disk = self.disk
        if disk is None:
            return
        if disk.enabled:
            self.flush()
            tier = kv.host_tier
            for block_hash, slot in list(tier.slots.items()):
                if block_hash not in disk:
                    disk.write(block_hash, host_block(self.host_pool, slot, self.num_layers),
                               wait=True)
            cached = [(h, b) for h, b in kv.pool.cached.items() if h not in disk]
            for start in range(0, len(cached), 64):
                chunk = cached[start:start + 64]
                blocks = jax.tree.map(np.asarray, self.runner.read_blocks([b for _, b in chunk]))
                for i, (block_hash, _) in enumerate(chunk):
                    disk.write(block_hash, host_block(blocks, i, self.num_layers), wait=True)
        disk.close()


def disk_key(runner, config) -> str:
    """What a disk tier's files name as their content's origin: the weights the runner serves
    (their fingerprint) and the engine's dtype."""
    return f"{weights_fingerprint(runner.params)}:{config.dtype}"


def make_kv_tiers(runner, config, bytes_per_block: int) -> KVTiers | None:
    """The engine's tiers from its config (None without kv_offload_bytes)."""
    if not config.kv_offload_bytes:
        return None
    num_blocks = config.kv_offload_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_offload_bytes ({config.kv_offload_bytes}) holds no KV block "
                         f"({bytes_per_block} bytes a block)")
    disk = None
    if config.kv_disk_dir is not None:
        leaves = [[[2, a.shape[1], runner.graph.num_kv_slots, *a.shape[3:]], a.dtype.name]
                  for a in jax.tree.leaves(runner.kv_cache)]
        layout = {"block_size": config.block_size, "kv_cache_dtype": config.kv_cache_dtype,
                  "backend": runner.backend.name, "leaves": leaves}
        disk = DiskTier(config.kv_disk_dir, config.kv_disk_bytes, disk_key(runner, config),
                        layout)
    return KVTiers(runner, num_blocks, bytes_per_block, disk)


def cached_prefix_blocks(kv, disk: DiskTier | None, hashes) -> int:
    """How many of a prompt's leading blocks (their chained hashes) kv's device pool, its host
    tier or the disk tier hold (the first KV cache group's blocks)."""
    suffix = kv.hash_suffixes[0]
    held = 0
    for block_hash in hashes:
        key = block_hash + suffix
        if kv.pool.lookup(key) is None and (disk is None or key not in disk):
            break
        held += 1
    return held


def tier_rows(counters: dict[str, dict[str, float]]) -> list[tuple[str, str]]:
    """The engine table's lines for KVTiers.counters (one a tier)."""
    rows = []
    for tier, c in counters.items():
        asked = c["hits"] + c["misses"]
        ratio = f"{100 * c['hits'] / asked:.1f}%" if asked else "-"
        failures = ", ".join(f"{c[k]} {k.replace('_', ' ')}" for k in (
            "overflow", "corrupt", "dropped_writes", "write_errors") if c.get(k))
        rows.append((f"{tier} tier", (
            f"{c['hits']} block hits of {asked} asked ({ratio}); {c['blocks_in']} blocks in, "
            f"{c['blocks_out']} out ({(c['bytes_in'] + c['bytes_out']) / 2**20:.1f} MiB, "
            f"{c['transfer_s']:.3f} s); {c['evictions']} evicted; "
            f"{c['used_bytes'] / 2**20:.1f} of {c['capacity_bytes'] / 2**20:.1f} MiB held"
            + (f"; {failures}" if failures else ""))))
    return rows
