"""Property-based state machine over the block pool and the KV cache manager."""

import hypothesis.strategies as st
import pytest
from helpers import check_kv_invariants, make_request
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedjax.scheduler import NULL_BLOCK, BlockPool, KVCacheManager


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=17, block_size=4)
        self.live = {}  # request_id -> Request
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 40))
    def allocate(self, prompt_len):
        request = make_request(self.next_id, prompt_len, 8)
        self.next_id += 1
        free_before = self.kv.num_free_blocks
        blocks = self.kv.allocate_slots(request, prompt_len)
        needed = -(-prompt_len // 4)
        if needed > free_before:
            assert blocks is None
            assert self.kv.num_free_blocks == free_before, "a failed allocation took blocks"
            assert request.request_id not in self.kv.block_tables
        else:
            assert len(blocks) == needed
            request.num_computed_tokens = prompt_len
            self.live[request.request_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_new=st.integers(1, 9))
    def append(self, data, num_new):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[request_id]
        table_before = list(self.kv.get_block_table(request_id))
        blocks = self.kv.allocate_slots(request, num_new)
        if blocks is None:
            assert self.kv.get_block_table(request_id) == table_before
        else:
            assert self.kv.get_block_table(request_id) == table_before + blocks
            request.num_computed_tokens += num_new
            assert len(self.kv.get_block_table(request_id)) * 4 >= request.num_computed_tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        held = len(self.kv.get_block_table(request_id))
        free_before = self.kv.num_free_blocks
        self.kv.free(self.live.pop(request_id))
        assert self.kv.num_free_blocks == free_before + held

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        """Recompute preemption: free everything, then the request starts over."""
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[request_id]
        self.kv.free(request)
        request.num_computed_tokens = 0
        blocks = self.kv.allocate_slots(request, request.num_tokens)
        if blocks is None:
            del self.live[request_id]
        else:
            request.num_computed_tokens = request.num_tokens

    @rule(request_id=st.integers(0, 1000))
    def free_unknown_is_noop(self, request_id):
        free_before = self.kv.num_free_blocks
        self.kv.free(make_request(f"unknown-{request_id}", 1, 1))
        assert self.kv.num_free_blocks == free_before

    @invariant()
    def invariants_hold(self):
        check_kv_invariants(self.kv)

    def teardown(self):
        for request in list(self.live.values()):
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.pool.num_usable_blocks, "blocks leaked"
        check_kv_invariants(self.kv)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_null_block_is_never_allocated():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK not in blocks
    assert pool.allocate(1) is None


def test_double_free_is_caught():
    pool = BlockPool(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="unreferenced"):
        pool.free(blocks)


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests drawn from a few shared prefixes write fake KV (their token ids) into their
    blocks; a cache hit must always return blocks whose content is exactly the hit tokens."""

    PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [8, 8, 8, 8]]
    BLOCK = 2

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=13, block_size=self.BLOCK, enable_prefix_caching=True)
        self.content = {}  # block -> {offset: token}
        self.live = {}
        self.next_id = 0

    def write(self, request, start, stop):
        table = self.kv.get_block_table(request.request_id)
        for pos in range(start, stop):
            block = table[pos // self.BLOCK]
            self.content.setdefault(block, {})[pos % self.BLOCK] = request.token_id_at(pos)

    def block_matches(self, block, tokens):
        stored = self.content.get(block, {})
        return [stored.get(i) for i in range(self.BLOCK)] == list(tokens)

    @rule(prefix=st.sampled_from(range(3)), cut=st.integers(0, 7),
          suffix=st.lists(st.integers(0, 3), max_size=4))
    def admit(self, prefix, cut, suffix):
        tokens = self.PREFIXES[prefix][:cut] + suffix or [0]
        request = make_request(self.next_id, 1, 8)
        request.prompt_token_ids = tokens
        self.next_id += 1
        hits = self.kv.find_cached_prefix(request)
        assert len(hits) * self.BLOCK <= len(tokens) - 1, "a hit must leave the last token"
        for i, block in enumerate(hits):
            assert self.block_matches(block, tokens[i * self.BLOCK:(i + 1) * self.BLOCK]), \
                "a cache hit returned a block holding other tokens"
        free_before = self.kv.num_free_blocks
        num_cached = len(hits) * self.BLOCK
        if self.kv.allocate_slots(request, len(tokens) - num_cached, hits) is None:
            assert self.kv.num_free_blocks == free_before
            assert request.request_id not in self.kv.block_tables
            return
        assert self.kv.get_block_table(request.request_id)[:len(hits)] == hits
        self.write(request, num_cached, len(tokens))
        request.num_computed_tokens = len(tokens)
        self.kv.publish_full_blocks(request)
        self.live[request.request_id] = request

    def apply_copies(self):
        """The device copies the step's copy-on-write blocks before its KV writes."""
        for src, dst in self.kv.take_pending_copies():
            self.content[dst] = dict(self.content.get(src, {}))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        request.output_token_ids.append(token)
        if self.kv.allocate_slots(request, 1) is None:
            request.output_token_ids.pop()
            assert not self.kv.pending_copies, "a failed allocation left a copy behind"
            return
        self.apply_copies()
        self.write(request, request.num_computed_tokens, request.num_computed_tokens + 1)
        request.num_computed_tokens += 1
        self.kv.publish_full_blocks(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        """A parallel sample: shares every block, partly filled last one included."""
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = make_request(self.next_id, 1, 8)
        self.next_id += 1
        child.prompt_token_ids = list(parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        assert self.kv.get_block_table(child.request_id) == self.kv.get_block_table(
            parent.request_id)
        self.live[child.request_id] = child

    @invariant()
    def invariants_hold(self):
        check_kv_invariants(self.kv)
        pool = self.kv.pool
        for block_hash, block in pool.cached.items():
            assert pool.block_hashes[block] == block_hash
        for request in self.live.values():
            table = self.kv.get_block_table(request.request_id)
            for i in range(request.num_computed_tokens // self.BLOCK):
                tokens = request.token_ids_slice(i * self.BLOCK, (i + 1) * self.BLOCK)
                assert self.block_matches(table[i], tokens), "a live block was overwritten"

    def teardown(self):
        for request in list(self.live.values()):
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.pool.num_usable_blocks, "blocks leaked"


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
