"""Prefix-affinity placement, pure bookkeeping (no I/O): which of several instances a request
should go to, so that it lands where its prompt's prefix is most likely cached. The router
(pagedjax.serving.router) places requests on server instances with it, the data-parallel engine
(pagedjax.frontend.data_parallel) on its replicas.

Nobody outside an instance sees its block hashes, so the policy keeps its own approximate
picture, as SGLang's cache-aware router does: for each instance, the chained hashes of the
prompt chunks sent there (about one KV block a chunk), in an LRU of bounded size (size it to
what an instance holds: with the host and disk tiers of its prefix cache, far more than its
device pool). A request's match on an instance is the number of its leading chunks found
there. An instance that can answer for itself (a data-parallel replica, whose chunks are its
real block hashes) has a `lookup`: the leading blocks it holds in any tier of its prefix cache
(device, host, disk), and its match is the larger of the two. Policy `kv_aware`:

1. if the loads (requests in flight) are out of balance (max - min > balance_abs and max >
   balance_rel * min), the least loaded instance;
2. else the instance with the longest match, when that match covers at least min_match of the
   prompt's chunks (ties: least loaded);
3. else the least loaded, ties broken by the smallest index (the most room for a new prefix),
   then in turn.

`round_robin` and `least_loaded` are there to compare against.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Hashable, Sequence

from pagedjax.scheduler.block_hash import chained_hashes

POLICIES = ("kv_aware", "round_robin", "least_loaded")


@dataclasses.dataclass
class Backend:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    index: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    # chunks -> how many leading ones the instance holds itself (None: the index alone)
    lookup: Callable[[Sequence], int] | None = dataclasses.field(default=None, compare=False)

    def alive(self, now: float) -> bool:
        return now >= self.down_until


def prompt_chunks(prompt: str | Sequence[int], text_chunk: int = 64,
                  ids_chunk: int = 16, model: str | None = None) -> list[int]:
    """Chained hashes of a prompt's whole chunks (a chunk's hash covers everything before it,
    so equal hashes mean equal prefixes), rooted in the model the request names: a LoRA
    adapter's requests match each other's prefixes (and the instance holding that KV), never
    another adapter's, whose KV no instance would share."""
    items: str | tuple[int, ...]
    if isinstance(prompt, str):
        size, items = text_chunk, prompt
    else:
        size, items = ids_chunk, tuple(prompt)
    root = 0 if model is None else hash(("model", model))
    return chained_hashes(items, size, lambda parent, piece: hash((parent, piece)), root)


class RoutingPolicy:
    """Picks a backend for a prompt's chunk hashes; pure bookkeeping, no I/O."""

    def __init__(self, backends: Sequence[Backend], policy: str = "kv_aware", *,
                 balance_abs: int = 8, balance_rel: float = 1.5, min_match: float = 0.25,
                 index_capacity: int = 100_000):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not backends:
            raise ValueError("at least one backend is needed")
        if balance_abs < 0 or balance_rel < 1:
            raise ValueError(f"balance_abs must be >= 0 and balance_rel >= 1, got "
                             f"{balance_abs}, {balance_rel}")
        if not 0 <= min_match <= 1:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        if index_capacity < 1:
            raise ValueError(f"index_capacity must be >= 1, got {index_capacity}")
        self.backends = list(backends)
        self.policy = policy
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.min_match = min_match
        self.index_capacity = index_capacity
        self._turn = 0

    @staticmethod
    def match(backend: Backend, chunks: Sequence) -> int:
        n = 0
        for h in chunks:
            if h not in backend.index:
                break
            n += 1
        if backend.lookup is not None and n < len(chunks):
            n = max(n, backend.lookup(chunks))
        return n

    def _next_turn(self, candidates: list[Backend]) -> Backend:
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def choose(self, chunks: Sequence[Hashable], exclude: Sequence[Backend] = (),
               now: float | None = None) -> tuple[Backend, int]:
        """(backend, matched chunks); raises LookupError when no backend is alive."""
        now = time.monotonic() if now is None else now
        alive = [b for b in self.backends if b.alive(now) and b not in exclude]
        if not alive:
            raise LookupError("no backend is reachable")
        if self.policy == "round_robin":
            backend = self._next_turn(alive)
            return backend, self.match(backend, chunks)
        loads = [b.in_flight for b in alive]
        least = min(loads)
        least_loaded = [b for b in alive if b.in_flight == least]
        if self.policy == "kv_aware":
            imbalanced = (max(loads) - least > self.balance_abs
                          and max(loads) > self.balance_rel * least)
            if not imbalanced and chunks:
                matches = [self.match(b, chunks) for b in alive]
                best = max(matches)
                if best > 0 and best >= self.min_match * len(chunks):
                    tied = [b for b, m in zip(alive, matches) if m == best]
                    backend = min(tied, key=lambda b: b.in_flight)
                    return backend, best
            smallest = min(len(b.index) for b in least_loaded)
            least_loaded = [b for b in least_loaded if len(b.index) == smallest]
        backend = self._next_turn(least_loaded)
        return backend, self.match(backend, chunks)

    def record(self, backend: Backend, chunks: Sequence[Hashable]) -> None:
        """The backend now holds (or will) these chunks: most recently used last."""
        index = backend.index
        for h in chunks:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.index_capacity:
            index.popitem(last=False)
