"""The Responses API's store (pagedjax.serving.response_store) on its own: bounded in count, in
bytes and in age, the oldest ended entries dropped first, and a running background response
kept whatever the bounds until it ends (issue 57: evicted ones ran on, unreachable, and a
count-only bound let a few large fields hold gigabytes)."""

from __future__ import annotations

import pytest

from pagedjax.serving.response_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def response(status: str = "completed", text: str = "") -> dict:
    return {"status": status, "user": text}


def test_a_running_response_outlives_the_count_bound_until_it_ends():
    store = ResponseStore(max_entries=2)
    store.put("bg", response("queued"), [], running=True)
    for i in range(5):
        store.put(f"r{i}", response(), [])
    assert store.get("bg") is not None and len(store) == 2  # it counts, and it stays
    assert [k for k in ("r0", "r1", "r2", "r3", "r4") if store.get(k)] == ["r4"]
    store.update("bg", response("in_progress"))
    assert store.get("bg").running
    store.update("bg", response("completed"), running=False)  # ended: evictable again
    store.put("r5", response(), [])
    assert [k for k in ("bg", "r4", "r5") if store.get(k)] == ["r4", "r5"]


def test_bytes_bound_drops_the_oldest_ended_entries():
    store = ResponseStore(max_entries=100, max_bytes=10_000)
    for i in range(6):
        assert store.put(f"r{i}", response(text="x" * 3_000), [])
    assert store.num_bytes <= 10_000
    assert [k for k in (f"r{i}" for i in range(6)) if store.get(k)] == ["r3", "r4", "r5"]
    assert not store.put("huge", response(text="x" * 20_000), [])  # larger than the store
    assert store.get("huge") is None and store.get("r5") is not None
    store.delete("r5")
    assert store.num_bytes == sum(store.get(k).size for k in ("r3", "r4"))


def test_a_running_response_never_expires_and_an_ended_one_does():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=60, clock=clock)
    store.put("bg", response("queued"), [], running=True)
    store.put("done", response(), [])
    clock.now = 120
    assert store.get("done") is None and store.get("bg") is not None
    store.update("bg", response(), running=False)  # its time starts when it ends
    clock.now = 179.5
    assert store.get("bg") is not None
    clock.now = 180  # ended at 120: its 60 s are up at 180, not after
    assert store.get("bg") is None


def test_bad_bounds_are_refused_by_name():
    with pytest.raises(ValueError, match="bytes"):
        ResponseStore(max_bytes=0)


def test_the_byte_bound_is_inclusive():
    """An entry exactly the store's size is kept; a store of one byte is a store (make mutants
    found both boundaries unpinned)."""
    probe = ResponseStore(max_bytes=1 << 20)
    probe.put("x", response(), [])
    size = probe.get("x").size
    store = ResponseStore(max_bytes=size)
    assert store.put("x", response(), []) and store.get("x") is not None
    assert not store.put("y", response(text="z"), [])  # one byte over
    assert ResponseStore(max_bytes=1).max_bytes == 1
