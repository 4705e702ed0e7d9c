"""Data-parallel placement by prefix affinity: requests that share a prompt head land on the
replica whose prefix cache holds it (the router's kv_aware rule), while a new head goes to the
least-loaded replica. Two replicas over one CPU device (a mesh may name a device twice), so
this runs in the fast suite; tests/test_tensor_parallel.py runs them on disjoint devices."""

from __future__ import annotations

import jax

from pagedjax import SamplingParams
from pagedjax.engine.admission import PromptSpec
from pagedjax.engine.config import EngineConfig
from pagedjax.parallel.data_parallel import DataParallelEngine

CONFIG = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, block_size=4,
              data_parallel_size=2)


def _replicas_of(engine, ids) -> set[int]:
    return {r for i in ids for r, replica in enumerate(engine.replicas)
            if i in replica.request_groups}


def test_requests_sharing_a_prefix_land_on_one_replica(tiny_model):
    device = jax.devices()[0]
    engine = DataParallelEngine(tiny_model, EngineConfig(**CONFIG), devices=[device, device])
    params = SamplingParams(max_tokens=4, temperature=0)
    heads = [list(range(10, 26)), list(range(100, 116))]  # four blocks each
    placed = []
    for head in heads:  # one at a time
        placed.append(_replicas_of(engine, [engine.add_request(head + [200 + i], params)
                                            for i in range(3)]))
    assert sorted(placed, key=min) == [{0}, {1}]
    # Several in one call: its own placements count as load, and the heads still decide.
    ids = engine.add_requests([PromptSpec(heads[i % 2] + [220 + i], params) for i in range(4)])
    assert _replicas_of(engine, ids[0::2]) == placed[0]
    assert _replicas_of(engine, ids[1::2]) == placed[1]
    # A head no replica holds goes to the less loaded one.
    engine.add_request(heads[0] + [230], params)
    fresh = engine.add_request(list(range(150, 166)), params)
    assert _replicas_of(engine, [fresh]) == placed[1]
