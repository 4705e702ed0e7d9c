"""The state group (scheduler/state_group.py) under a hypothesis state machine, in a hybrid KV
cache of a full-attention group and two state groups of 2 blocks a request: requests admitted
with 0-2 parallel samples (their blocks reserved with their leader's, all or nothing over the
groups), grown, forked (the state copied, never shared), swapped out and in, freed whole;
samples aborted before their fork. Invariants: the pool's counts, no state block held by two
live requests, every live request's state tables whole, nothing left after."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from helpers import check_kv_invariants, make_request
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedjax.scheduler.kv_cache_groups import HybridKVCacheManager, blocks_for
from pagedjax.scheduler.state_group import StateWindow

BLOCK, STATE = 4, 2
WINDOWS = (None, StateWindow(STATE), StateWindow(STATE))


class StateGroupMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = HybridKVCacheManager(30, BLOCK, WINDOWS, enable_prefix_caching=True,
                                       num_host_blocks=12)
        self.live, self.swapped, self.next_id = {}, {}, 0

    def request(self, prompt_len, followers=0):
        request = make_request(self.next_id, prompt_len, 8)
        self.next_id += 1
        request.followers = [self.request(prompt_len) for _ in range(followers)]
        return request

    @rule(prompt_len=st.integers(1, 12), followers=st.integers(0, 2))
    def admit(self, prompt_len, followers):
        request = self.request(prompt_len, followers)
        assert self.kv.find_cached_prefix(request) == []  # nothing is ever served
        free = self.kv.num_free_blocks
        needed = self.kv.num_new_blocks(request, prompt_len)
        assert needed == blocks_for(WINDOWS, BLOCK, prompt_len) + 2 * STATE * followers
        if self.kv.allocate_slots(request, prompt_len) is None:
            assert self.kv.num_free_blocks == free and needed > free
            assert all(t == [] for t in self.kv.get_block_tables(request.request_id))
            return
        assert free - self.kv.num_free_blocks == needed
        request.num_computed_tokens = prompt_len
        self.kv.publish_full_blocks(request)
        self.live[request.request_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        request.output_token_ids.append(1)
        if self.kv.allocate_slots(request, 1) is None:
            request.output_token_ids.pop()
            return
        request.num_computed_tokens += 1
        self.kv.publish_full_blocks(request)  # as the engine does: nothing may be published

    @precondition(lambda self: any(r.followers for r in self.live.values()))
    @rule(data=st.data(), abort=st.booleans())
    def fork_or_abort(self, data, abort):
        leader = self.live[data.draw(st.sampled_from(
            sorted(i for i, r in self.live.items() if r.followers)))]
        follower = leader.followers.pop(0)
        if abort:  # aborted before its fork: its reservation goes back
            free = self.kv.num_free_blocks
            self.kv.free(follower)
            assert self.kv.num_free_blocks == free + 2 * STATE
            return
        self.kv.fork(leader, follower)
        follower.num_computed_tokens = leader.num_computed_tokens
        copies = self.kv.take_pending_state_copies()
        leader_state = sum(self.kv.get_block_tables(leader.request_id)[1:], [])
        child_state = sum(self.kv.get_block_tables(follower.request_id)[1:], [])
        assert sorted(copies) == sorted(zip(leader_state, child_state))
        assert not set(leader_state) & set(child_state)
        self.live[follower.request_id] = follower

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[request_id]
        if self.kv.swap_out(request):
            self.swapped[request_id] = self.live.pop(request_id)
            assert self.kv.get_block_tables(request_id) == [[], [], []]

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped)))
        request = self.swapped[request_id]
        if self.kv.swap_in(request, 1) is not None:
            self.kv.take_pending_swaps()
            self.kv.release_host_blocks()
            self.live[request_id] = self.swapped.pop(request_id)

    @invariant()
    def invariants_hold(self):
        check_kv_invariants(self.kv)
        state_blocks = [b for r in self.live for table in self.kv.get_block_tables(r)[1:]
                        for b in table]
        assert len(state_blocks) == len(set(state_blocks)), "a state block is shared"
        for request_id in self.live:
            assert [len(t) for t in self.kv.get_block_tables(request_id)[1:]] == [STATE] * 2

    def teardown(self):
        for request in [*self.live.values(), *self.swapped.values()]:
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.pool.num_usable_blocks, "blocks leaked"
        assert self.kv.num_free_host_blocks == 12, "host blocks leaked"


TestStateGroupMachine = StateGroupMachine.TestCase
TestStateGroupMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)


def test_a_state_window_is_at_least_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        StateWindow(0)
