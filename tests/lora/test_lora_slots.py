"""LoRA's slots (issue 53): the scheduler's slot assignment (scheduler.lora_slots: hold back,
skip, LRU eviction of idle adapters only) and the step's adapted projection (models/layers/lora.py:
the masked jnp reference equal to a per-token gather and to a plain per-token loop)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_request

from pagedjax.pallas_kernels.lora import lora_delta
from pagedjax.scheduler import Scheduler, SchedulerConfig
from pagedjax.scheduler.lora_slots import LoRASlots


def lora_request(request_id, lora_id, prompt_len=4):
    request = make_request(request_id, prompt_len, 4)
    request.lora_id, request.lora_key = lora_id, None if lora_id is None else str(lora_id)
    return request


def test_slots_evict_only_idle_adapters_least_recently_used_first():
    slots = LoRASlots(2)
    assert slots.acquire(7, set()) == 0 and slots.acquire(8, {7}) == 1
    assert slots.take_loads() == [(0, 7), (1, 8)]
    assert slots.acquire(7, {7, 8}) == 0 and not slots.take_loads()  # resident: no load
    assert not slots.can_acquire(9, {7, 8})  # both in use: held back
    assert slots.can_acquire(9, {7})
    assert slots.acquire(9, {7}) == 1 and slots.take_loads() == [(1, 9)]  # 8 evicted
    assert slots.acquire(8, set()) == 0  # 7 is now the least recently used
    assert (slots.num_loads, slots.num_evictions) == (4, 2)
    slots = LoRASlots(2)
    slots.acquire(1, set()), slots.acquire(2, set())
    assert slots.acquire(3, {1}) == 1  # the least recently used (1) runs: 2 goes instead
    slots.evict(1)
    assert slots.acquire(4, {3}) == 0 and slots.slot_of == {3: 1, 4: 0}
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        LoRASlots(0)


def test_scheduler_holds_back_a_request_whose_adapter_gets_no_slot():
    """One slot: adapter 1's requests run; adapter 2's waits (keeping its place at the head)
    while a base request and another of adapter 1 behind it are admitted; it runs once
    adapter 1's requests are done."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, num_blocks=32, block_size=4, max_loras=1)
    first, second, base, again = (lora_request("a", 1), lora_request("b", 2),
                                  lora_request("c", None), lora_request("d", 1))
    for request in (first, second, base, again):
        scheduler.add_request(request)
    output = scheduler.schedule(now=0.0)
    assert [s.request.request_id for s in output.scheduled] == ["a", "c", "d"]
    assert output.lora_loads == [(0, 1)]
    assert (first.lora_slot, again.lora_slot) == (0, 0)
    assert [r.request_id for r in scheduler.state.waiting] == ["b"]
    for request in (first, again):
        scheduler.abort(request.request_id, now=1.0)
    output = scheduler.schedule(now=2.0)
    assert [s.request.request_id for s in output.scheduled] == ["c", "b"]
    assert output.lora_loads == [(0, 2)] and second.lora_slot == 0


@pytest.mark.parametrize("implementation", ["masked", "gather"])
def test_adapted_projection_is_each_tokens_own_adapter(implementation):
    """delta[t] = (x[t] @ a[s]) @ b[s] for token t's slot s, 0 for base tokens (-1)."""
    rng = np.random.default_rng(0)
    tokens, inputs, outputs, slots, rank = 11, 24, 40, 3, 8
    x = rng.normal(size=(tokens, inputs)).astype(np.float32)
    a = rng.normal(size=(slots, inputs, rank)).astype(np.float32)
    b = rng.normal(size=(slots, rank, outputs)).astype(np.float32)
    token_slots = rng.integers(-1, slots, tokens).astype(np.int32)
    token_slots[:2] = (-1, slots - 1)
    got = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b),
                                jnp.asarray(token_slots), implementation))
    for t, s in enumerate(token_slots):
        expected = np.zeros(outputs) if s < 0 else (x[t] @ a[s]) @ b[s]
        np.testing.assert_allclose(got[t], expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="implementation must be one of"):
        lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(token_slots),
                   "bgmv")
