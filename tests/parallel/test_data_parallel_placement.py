"""Data-parallel placement by prefix affinity: requests that share a prompt head land on the
replica whose prefix cache holds it (the router's kv_aware rule), while a new head goes to the
least-loaded replica. Two replicas over one CPU device (a mesh may name a device twice), so
this runs in the fast suite; tests/parallel/test_tensor_parallel.py runs them on disjoint devices."""

from __future__ import annotations

import jax

from pagedjax import SamplingParams
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.request_checks import PromptSpec
from pagedjax.frontend.data_parallel import DataParallelEngine

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


def test_placement_finds_the_replica_whose_tiers_hold_a_prefix(tiny_model, tmp_path):
    """A restarted data-parallel engine over the same disk directory: its policy has seen no
    request, but each replica answers for its own disk tier, so a prompt goes to the replica
    holding its head there (and loads it) even when that replica is the busier one."""
    device = jax.devices()[0]
    config = EngineConfig(**CONFIG, kv_offload_bytes=16 * 2048, kv_disk_dir=str(tmp_path),
                          kv_disk_bytes=1 << 22)
    params = SamplingParams(max_tokens=2, temperature=0)
    head = list(range(10, 42))  # eight blocks
    first = DataParallelEngine(tiny_model, config, devices=[device, device])
    (holder,) = _replicas_of(first, [first.add_request(head + [1], params)])
    while first.has_unfinished():
        first.step()
    first.close()  # the cached blocks written down, in the holder's directory
    engine = DataParallelEngine(tiny_model, config, devices=[device, device])
    assert engine.replicas[holder].kv_tiers.disk.num_blocks >= 8
    assert engine.replicas[1 - holder].kv_tiers.disk.num_blocks == 0
    engine.replicas[holder].add_request(list(range(100, 110)), params)  # busier than the other
    placed = engine.add_request(head + [2], params)
    assert _replicas_of(engine, [placed]) == {holder}
    while engine.has_unfinished():
        engine.step()
    stats = engine.replica_stats[holder]
    assert stats.num_prefix_host_hit_tokens >= 28 and stats.kv_tiers["disk"]["hits"] >= 7
    engine.close()
