"""KV cache groups (scheduler.kv_cache_groups): a full-attention and sliding-window groups over
one block pool. The sliding groups' bound as a request grows, the pool's free count during a
long generation, all-or-nothing allocation, prefix hits every group can serve, and a
property-based state machine (prefix caching, forks, frees) whose every cache hit must hold the
hit's tokens in every group."""

import hypothesis.strategies as st
from helpers import check_kv_invariants, make_request
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedjax.scheduler import NULL_BLOCK
from pagedjax.scheduler.block_hash import block_hashes
from pagedjax.scheduler.kv_cache_groups import HybridKVCacheManager
from pagedjax.scheduler.kv_cache_manager import cdiv


def grow(kv, request, num_new):
    """One step of request: room for num_new tokens, computed, published, window freed."""
    assert kv.allocate_slots(request, num_new) is not None
    request.num_computed_tokens += num_new
    kv.publish_full_blocks(request)
    kv.free_out_of_window(request)


def live_blocks(table):
    return sum(b != NULL_BLOCK for b in table)


def test_a_sliding_group_holds_its_window_and_a_long_generation_frees_as_it_goes():
    block, window, chunk = 4, 10, 8
    kv = HybridKVCacheManager(200, block, (None, window, window), max_tokens_per_step=chunk)
    request = make_request("r", 40, 200)
    while request.num_computed_tokens < request.num_tokens:  # chunked prefill
        grow(kv, request, min(chunk, request.num_tokens - request.num_computed_tokens))
    full_at_prompt = kv.num_free_blocks
    frees = []
    for _ in range(120):  # decode
        before = kv.num_free_blocks
        grow(kv, request, 1)
        frees.append(kv.num_free_blocks - before)
        tables = kv.get_block_tables(request.request_id)
        assert len(tables[0]) == cdiv(request.num_computed_tokens, block)  # full: every block
        for table in tables[1:]:
            assert live_blocks(table) <= cdiv(window - 1 + 1, block) + 1
        check_kv_invariants(kv)
    # The full group took a block every 4 tokens; each sliding group, taking one as often, gave
    # one back in the same step: three groups cost what one does.
    assert kv.num_free_blocks == full_at_prompt - 120 // block
    assert set(frees) == {0, -1} and sum(frees) == -(120 // block)
    kv.free(request)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_an_allocation_takes_from_every_group_or_from_none():
    kv = HybridKVCacheManager(8, 4, (None, 6))  # 7 usable blocks
    first = make_request("a", 12, 4)
    assert kv.allocate_slots(first, 12) is not None  # 3 + 3 blocks
    free = kv.num_free_blocks
    second = make_request("b", 8, 4)  # needs 2 + 2: only 1 free
    assert kv.allocate_slots(second, 8) is None
    assert kv.num_free_blocks == free and kv.get_block_tables("b") == [[], []]
    assert kv.num_allocation_failures == 1
    check_kv_invariants(kv)


def test_a_prefix_hit_is_what_every_group_can_serve():
    block, window = 4, 6
    kv = HybridKVCacheManager(64, block, (None, window), enable_prefix_caching=True)
    first = make_request("a", 30, 4)
    grow(kv, first, 30)
    second = make_request("b", 30, 4)  # the same 30 tokens
    hit = kv.find_cached_prefix(second)
    assert len(hit) == 29 // block  # 7 blocks: the last token is always computed
    full, sliding = hit.groups
    assert full == kv.get_block_tables("a")[0][:7]
    # The sliding group serves only what the next token (position 28) sees: 23..27.
    first_seen = (7 * block - window + 1) // block
    assert sliding[:first_seen] == [NULL_BLOCK] * first_seen
    assert all(b != NULL_BLOCK for b in sliding[first_seen:])
    # Block 5 (positions 20..23) left the first request's window and went back to the pool,
    # still cached: the hit revives it.
    revived = [b for b in sliding if b != NULL_BLOCK and kv.pool.ref_counts[b] == 0]
    assert len(revived) == 1
    free = kv.num_free_blocks
    assert kv.num_new_blocks(second, 2, hit) == 3
    assert kv.allocate_slots(second, 30 - 28, hit) is not None
    assert kv.num_free_blocks == free - 3  # a new block a group, and the revived one
    check_kv_invariants(kv)
    # Once the sliding group's blocks are gone, the hit is only as long as it can still serve.
    kv.free(second)
    kv.free(first)
    evict = make_request("c", 4 * 60, 4)
    evict.prompt_token_ids = [99] * (4 * 60)  # other tokens: takes every free block
    assert kv.allocate_slots(evict, 4 * 30) is not None
    kv.free(evict)
    assert len(kv.find_cached_prefix(make_request("d", 30, 4))) < 7


def test_a_hit_needs_no_sliding_block_out_of_the_next_tokens_window():
    """The sliding group's blocks a request freed out of its window are evicted while it runs:
    a prompt sharing its tokens still hits all 7 blocks (its sliding head is null there, the
    next token does not see them), not 0."""
    block, window = 4, 6
    kv = HybridKVCacheManager(32, block, (None, window), enable_prefix_caching=True)
    first = make_request("a", 30, 4)
    for _ in range(0, 28, 4):  # in steps, as a decode frees its blocks: the oldest first
        grow(kv, first, 4)
    grow(kv, first, 2)  # still running: its full group's blocks and its window's are held
    first_seen = (7 * block - window + 1) // block
    hashes = [h + kv.hash_suffixes[1] for h in block_hashes(first, block, 7, kv.cache_key)]
    other = make_request("c", 120, 4, token=99)
    for _ in range(30):  # its allocations evict the blocks `first` freed out of its window
        if all(kv.pool.lookup(h) is None for h in hashes[:first_seen]):
            break
        grow(kv, other, 4)
    assert all(kv.pool.lookup(h) is None for h in hashes[:first_seen])
    assert kv.pool.lookup(hashes[first_seen]) is not None  # freed last, still cached
    hit = kv.find_cached_prefix(make_request("b", 30, 4))
    assert len(hit) == 7 and hit.groups[1][:first_seen] == [NULL_BLOCK] * first_seen
    assert hit.groups[0] == kv.get_block_tables("a")[0][:7]


class HybridPrefixCacheMachine(RuleBasedStateMachine):
    """As tests/scheduler/test_scheduler_block_pool.py's PrefixCacheMachine, with a full and a
    3-token sliding group: fake KV (token ids) written into each group's blocks; every hit must
    hold the hit's tokens in every block a group serves, every live block within a window must
    hold its tokens, and a sliding group never holds more than its bound."""

    PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [8, 8, 8, 8]]
    BLOCK, WINDOW = 2, 3

    def __init__(self):
        super().__init__()
        self.kv = HybridKVCacheManager(19, self.BLOCK, (None, self.WINDOW),
                                       enable_prefix_caching=True)
        self.content = {}  # block -> {offset: token}
        self.live = {}
        self.next_id = 0

    def write(self, request, start, stop):
        for table in self.kv.get_block_tables(request.request_id):
            for pos in range(start, stop):
                block = table[pos // self.BLOCK]
                if block != NULL_BLOCK:
                    self.content.setdefault(block, {})[pos % self.BLOCK] = \
                        request.token_id_at(pos)

    def block_matches(self, block, tokens):
        stored = self.content.get(block, {})
        return [stored.get(i) for i in range(self.BLOCK)] == list(tokens)

    def step_done(self, request, num_new):
        request.num_computed_tokens += num_new
        self.kv.publish_full_blocks(request)
        self.kv.free_out_of_window(request)

    @rule(prefix=st.sampled_from(range(3)), cut=st.integers(0, 7),
          suffix=st.lists(st.integers(0, 3), max_size=4))
    def admit(self, prefix, cut, suffix):
        tokens = self.PREFIXES[prefix][:cut] + suffix or [0]
        request = make_request(self.next_id, 1, 8)
        request.prompt_token_ids = tokens
        self.next_id += 1
        hit = self.kv.find_cached_prefix(request)
        assert len(hit) * self.BLOCK <= len(tokens) - 1
        for head in getattr(hit, "groups", []):
            assert len(head) == len(hit)
            for i, block in enumerate(head):
                if block != NULL_BLOCK:
                    assert self.block_matches(block, tokens[i * self.BLOCK:(i + 1) * self.BLOCK])
        num_cached = len(hit) * self.BLOCK
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(request, len(tokens) - num_cached, hit) is None:
            assert self.kv.num_free_blocks == free_before
            return
        request.num_computed_tokens = num_cached
        self.write(request, num_cached, len(tokens))
        self.step_done(request, len(tokens) - num_cached)
        self.live[request.request_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        request.output_token_ids.append(token)
        if self.kv.allocate_slots(request, 1) is None:
            request.output_token_ids.pop()
            assert not self.kv.pending_copies
            return
        for src, dst in self.kv.take_pending_copies():
            self.content[dst] = dict(self.content.get(src, {}))
        self.write(request, request.num_computed_tokens, request.num_computed_tokens + 1)
        self.step_done(request, 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = make_request(self.next_id, 1, 8)
        self.next_id += 1
        child.prompt_token_ids = list(parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.request_id] = child

    @invariant()
    def invariants_hold(self):
        check_kv_invariants(self.kv)
        for request in self.live.values():
            n = request.num_computed_tokens
            full, sliding = self.kv.get_block_tables(request.request_id)
            for i in range(n // self.BLOCK):
                tokens = request.token_ids_slice(i * self.BLOCK, (i + 1) * self.BLOCK)
                assert self.block_matches(full[i], tokens), "a live block was overwritten"
                if (i + 1) * self.BLOCK > n - self.WINDOW + 1:  # still seen by the next token
                    assert sliding[i] != NULL_BLOCK and self.block_matches(sliding[i], tokens)
            assert live_blocks(sliding) <= cdiv(self.WINDOW - 1, self.BLOCK) + 1

    def teardown(self):
        for request in list(self.live.values()):
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.pool.num_usable_blocks, "blocks leaked"


TestHybridPrefixCacheMachine = HybridPrefixCacheMachine.TestCase
TestHybridPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=40,
                                                 deadline=None)


def test_kv_pressure_counts_what_each_group_holds():
    """Admission's KV-pressure rule asks the KV cache how many blocks a sequence holds: with a
    full and a sliding group (window 8, block 4, 8-token steps) a 200-token request holds
    50 + 5 blocks, not the 100 two full groups would; a pool of 80 usable blocks admits it under
    kv_overcommit 1 and refuses a second one."""
    from types import SimpleNamespace

    import pytest

    from pagedjax.frontend import admission_control
    from pagedjax.frontend.admission_control import AdmissionLimits, Live, OverloadedError

    kv = HybridKVCacheManager(81, 4, (None, 8), max_tokens_per_step=8)
    assert kv.num_blocks_for(200) == 50 + 5
    limits = AdmissionLimits(kv_overcommit=1.0)
    load = [SimpleNamespace(used_blocks=0, usable_blocks=kv.pool.num_usable_blocks)]
    new = [SimpleNamespace(prompt_token_ids=[1] * 100, num_tokens=200,
                           spec=SimpleNamespace(params=SimpleNamespace(num_samples=1,
                                                                       max_tokens=100),
                                                pooling_params=None))]
    live = [Live(samples=[], streamed=True, long_context=False)]
    admission_control.check(limits, live, new, True, load, kv.num_blocks_for, 0, 0)
    with pytest.raises(OverloadedError, match="KV pressure"):
        admission_control.check(limits, live, new, True, load, kv.num_blocks_for, 200,
                                kv.num_blocks_for(200))


def test_swap_keeps_a_sliding_group_within_its_window():
    """Swapping out a long request copies only the blocks its groups hold (a sliding group's
    freed ones stay null: no host block), and swapping it back in restores the same shape of
    tables, the sliding one still within its bound."""
    block, window = 4, 6
    kv = HybridKVCacheManager(64, block, (None, window), num_host_blocks=40,
                              max_tokens_per_step=4)
    request = make_request("r", 60, 4)
    for _ in range(15):
        grow(kv, request, 4)
    full, sliding = (list(t) for t in kv.get_block_tables("r"))
    live = sum(b != NULL_BLOCK for b in full + sliding)
    assert kv.swap_out(request)
    outs, _ = kv.take_pending_swaps()
    assert len(outs) == live and kv.num_free_host_blocks == 40 - live
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert kv.swap_in(request, 1) is not None
    _, ins = kv.take_pending_swaps()
    assert len(ins) == live
    new_full, new_sliding = kv.get_block_tables("r")
    assert [b == NULL_BLOCK for b in new_sliding[:len(sliding)]] == \
        [b == NULL_BLOCK for b in sliding]
    assert live_blocks(new_sliding) <= cdiv(window - 1 + 4, block) + 1
    assert len(new_full) == len(full) + (60 % block == 0)  # room for the next token
    kv.release_host_blocks()
    kv.free(request)
    assert kv.num_free_host_blocks == 40 and kv.num_free_blocks == kv.pool.num_usable_blocks
    check_kv_invariants(kv)
