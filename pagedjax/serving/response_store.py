"""The Responses API's store: responses kept in memory for `GET /v1/responses/{id}` and for a
later request's `previous_response_id`, bounded in count (the oldest go first) and in age.

A stored entry is the response as sent and the conversation behind it (the chat messages of
its input, earlier turns included, then its output), which a follow-up continues. The store is
this process's alone: behind a router, a follow-up must reach the same instance.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 256 * 2**20  # the responses' and conversations' JSON, summed
DEFAULT_TTL_S = 3600.0


@dataclasses.dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation a follow-up continues
    expires: float
    size: int = 0  # bytes of the response's and the conversation's JSON
    running: bool = False  # a background response not ended yet: never evicted nor expired


def _size(response: dict, messages: list[dict]) -> int:
    return len(json.dumps(response, default=str)) + len(json.dumps(messages, default=str))


class ResponseStore:
    """Responses by id, bounded in count, bytes and age: past a bound the oldest ended entries
    go first. A running background response is kept whatever the bounds (it stays reachable,
    for GET, cancel and DELETE, until it ends; admission control bounds how many run)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock=time.monotonic, max_bytes: int = DEFAULT_MAX_BYTES):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 0:
            raise ValueError(f"responses store size must be an integer >= 0, got {max_entries!r}")
        if not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"responses store TTL must be a number of seconds > 0, got {ttl_s!r}")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ValueError(f"responses store bytes must be an integer >= 1, got {max_bytes!r}")
        self.max_entries, self.ttl_s, self.clock = max_entries, float(ttl_s), clock
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def _drop(self, response_id: str) -> Stored | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.size
        return entry

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires <= now and not e.running]:
            self._drop(key)

    def _evict(self) -> None:
        """The oldest ended entries, while the store is over a bound."""
        for key in [k for k, e in self._entries.items() if not e.running]:
            if len(self._entries) <= self.max_entries and self.num_bytes <= self.max_bytes:
                return
            self._drop(key)

    def put(self, response_id: str, response: dict, messages: list[dict],
            running: bool = False) -> bool:
        """Stores (or replaces) a response; False when an ended one is larger than the whole
        store (it is not kept)."""
        size = _size(response, messages)
        with self._lock:
            now = self.clock()
            self._expire(now)
            self._drop(response_id)
            if size > self.max_bytes and not running:
                return False
            self._entries[response_id] = Stored(response, messages, now + self.ttl_s, size,
                                                running)
            self.num_bytes += size
            self._evict()
            return response_id in self._entries

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire(self.clock())
            return self._entries.get(response_id)

    def update(self, response_id: str, response: dict, running: bool = True) -> None:
        """A stored response's new state (a background response as it runs and ends; ended,
        running=False, it is evictable again)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return
            size = _size(response, entry.messages)
            self.num_bytes += size - entry.size
            entry.response, entry.size, entry.running = response, size, running
            if not running:  # evictable from the next put on (a cancel still reads it)
                entry.expires = self.clock() + self.ttl_s

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire(self.clock())
            return len(self._entries)
