"""The host tier's bookkeeping (scheduler.host_tier) and the KV cache managers over it: evicted
blocks found again as host hits, loaded into new device blocks, LRU, pins and spill order."""

import pytest
from helpers import check_kv_invariants

from pagedjax.scheduler import KVCacheManager, Request, SamplingParams
from pagedjax.scheduler.host_tier import HostTier, host_hit
from pagedjax.scheduler.kv_cache_groups import HybridKVCacheManager

BLOCK = 4


def request(request_id, tokens):
    return Request(str(request_id), list(tokens), SamplingParams(max_tokens=4), seed=0,
                   arrival_time=0.0)


def publish(kv, req):
    """Computes req's prompt (as a step would) and publishes its full blocks."""
    assert kv.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    kv.publish_full_blocks(req)


def test_lru_pins_and_spills():
    tier = HostTier(2)
    tier.offload(5, b"a")
    tier.offload(6, b"b")
    assert tier.take_transfers() == ([], [(5, 0), (6, 1)], [], [])
    # both slots pinned by the step that copies into them: a third eviction overflows
    tier.offload(7, b"c")
    assert tier.overflow == [(7, b"c")] and tier.num_overflow == 1
    tier.take_transfers()
    tier.release()
    tier.load(tier.lookup(b"a"), 9)  # a is used: b is now the least recently used
    tier.offload(8, b"c")
    spills, offloads, _, loads = tier.take_transfers()
    assert spills == [(b"b", 1)] and offloads == [(8, 1)] and loads == [(0, 9)]
    assert tier.lookup(b"b") is None and tier.lookup(b"c") == 1
    assert tier.num_evictions == 1 and tier.num_hits == 1 and tier.num_stored == 3
    tier.release()
    tier.offload(3, b"a")  # held already (loaded from here): no copy, a use
    assert tier.take_transfers() == ([], [], [], [])


def test_a_hit_is_the_most_recently_used_and_the_coldest_block_goes():
    """With nothing pinned, LRU order alone picks what goes: a block loaded back (a hit), or
    offloaded again while held, is the most recently used (issue 57: a hit moved to the front
    of the LRU, the hottest block evicted first, passed every test)."""
    tier = HostTier(3)
    for block, block_hash in ((5, b"a"), (6, b"b"), (7, b"c")):
        tier.offload(block, block_hash)
    tier.take_transfers()
    tier.release()
    tier.load(tier.lookup(b"a"), 9)  # a hit: a is the most recently used
    tier.take_transfers()
    tier.release()  # its copy ran: nothing is pinned
    tier.offload(4, b"b")  # b held already: a use, no copy
    tier.offload(8, b"d")
    assert tier.take_transfers()[0] == [(b"c", 2)]  # c, the coldest, goes
    tier.release()
    tier.offload(3, b"e")
    assert tier.take_transfers()[0] == [(b"a", 0)]  # then a, used before b and d


def test_insert_holds_its_slot_until_the_schedule_takes_it():
    tier = HostTier(1)
    assert tier.insert(b"x") == 0
    assert not tier.has_room() and tier.insert(b"y") is None
    tier.offload(4, b"z")  # the held slot is not reused: overflow
    assert tier.overflow == [(4, b"z")]
    tier.take_transfers()
    assert tier.has_room() and tier.insert(b"y") == 0
    assert tier.take_transfers()[0] == [(b"x", 0)]


def test_evicted_prefix_comes_back_from_the_host_tier():
    kv = KVCacheManager(6, BLOCK, enable_prefix_caching=True, num_tier_blocks=8)
    first = request("a", range(1, 14))  # 13 tokens: 3 full blocks published
    publish(kv, first)
    blocks = kv.get_block_table("a")[:3]
    kv.free(first)
    other = request("b", range(100, 120))  # takes all 5 blocks: evicts a's 3 cached ones
    assert kv.allocate_slots(other, 20) is not None
    _, offloads, _, _ = kv.host_tier.take_transfers()
    assert sorted(b for b, _ in offloads) == sorted(blocks)
    kv.free(other)
    kv.host_tier.release()
    again = request("c", list(range(1, 14)) + [99])
    hit = kv.find_cached_prefix(again)
    assert hit == [host_hit(s) for b, s in sorted(offloads, key=lambda o: blocks.index(o[0]))]
    assert kv.num_new_blocks(again, 2, hit) == 4  # 3 loads + the block the rest grows into
    assert kv.allocate_slots(again, 2, hit) is not None
    table = kv.get_block_table("c")
    _, _, _, loads = kv.host_tier.take_transfers()
    assert [d for _, d in loads] == table[:3] and all(b > 0 for b in table)
    # the loaded blocks are published: a second request finds them on the device
    assert kv.find_cached_prefix(request("d", list(range(1, 14)) + [5])) == table[:3]
    check_kv_invariants(kv)


def test_a_requests_own_host_hits_are_not_evicted_by_its_allocation():
    kv = KVCacheManager(5, BLOCK, enable_prefix_caching=True, num_tier_blocks=2)
    first = request("a", range(1, 10))  # 2 full blocks
    publish(kv, first)
    kv.free(first)
    filler = request("f", range(50, 66))  # 4 blocks: evicts a's 2 into the 2 host slots
    assert kv.allocate_slots(filler, 16) is not None
    kv.host_tier.take_transfers()
    kv.host_tier.release()
    filler.num_computed_tokens = 16
    kv.publish_full_blocks(filler)
    kv.free(filler)
    again = request("c", list(range(1, 10)))
    hit = kv.find_cached_prefix(again)
    assert all(b < 0 for b in hit) and len(hit) == 2
    # 2 loads and the block of the last token take 3 device blocks, evicting 3 of f's cached
    # ones: the host tier is full of the hits being loaded, so those evictions overflow
    # instead of replacing them
    assert kv.allocate_slots(again, 1, hit) is not None
    spills, _, overflow, loads = kv.host_tier.take_transfers()
    assert spills == [] and len(overflow) == 3 and len(loads) == 2


def test_hybrid_groups_take_host_hits_from_every_group():
    kv = HybridKVCacheManager(17, BLOCK, (None, 8), enable_prefix_caching=True,
                              num_tier_blocks=16, max_tokens_per_step=32)
    first = request("a", range(1, 18))  # 4 full blocks
    publish(kv, first)
    kv.free(first)
    filler = request("f", range(50, 82))  # 8 blocks a group: every block, a's 8 evicted
    assert kv.allocate_slots(filler, 32) is not None
    kv.host_tier.take_transfers()
    kv.free(filler)
    kv.host_tier.release()
    again = request("c", list(range(1, 18)) + [3])
    hit = kv.find_cached_prefix(again)
    assert len(hit) == 4
    assert all(b < 0 for b in hit.groups[0])  # the full group: all 4 from the host
    assert hit.groups[1][:2] == [0, 0] and all(b < 0 for b in hit.groups[1][2:])  # window
    assert kv.allocate_slots(again, 2, hit) is not None
    assert len(kv.host_tier.take_transfers()[3]) == 6
    assert all(b >= 0 for table in kv.get_block_tables("c") for b in table)
    check_kv_invariants(kv)


@pytest.mark.parametrize("blocks", [0, -1])
def test_a_tier_needs_a_block(blocks):
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(blocks)
