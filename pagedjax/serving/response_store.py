"""The Responses API's store: responses kept in memory for `GET /v1/responses/{id}` and for a
later request's `previous_response_id`, bounded in count (the oldest go first) and in age.

A stored entry is the response as sent and the conversation behind it (the chat messages of
its input, earlier turns included, then its output), which a follow-up continues. The store is
this process's alone: behind a router, a follow-up must reach the same instance.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_TTL_S = 3600.0


@dataclasses.dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation a follow-up continues
    expires: float


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock=time.monotonic):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 0:
            raise ValueError(f"responses store size must be an integer >= 0, got {max_entries!r}")
        if not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"responses store TTL must be a number of seconds > 0, got {ttl_s!r}")
        self.max_entries, self.ttl_s, self.clock = max_entries, float(ttl_s), clock
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def _expire(self, now: float) -> None:
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._entries.popitem(last=False)

    def put(self, response_id: str, response: dict, messages: list[dict]) -> None:
        with self._lock:
            now = self.clock()
            self._expire(now)
            self._entries[response_id] = Stored(response, messages, now + self.ttl_s)
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire(self.clock())
            return self._entries.get(response_id)

    def update(self, response_id: str, response: dict) -> None:
        """A stored response's new state (a background response as it runs and ends)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                entry.response = response

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire(self.clock())
            return len(self._entries)
