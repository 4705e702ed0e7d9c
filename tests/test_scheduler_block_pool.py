"""Property-based state machine over the block pool and the KV cache manager."""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
import pytest

from helpers import check_kv_invariants, make_request
from scheduler import NULL_BLOCK, BlockPool, KVCacheManager


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
