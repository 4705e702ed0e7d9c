"""Block size against what it costs: KV waste, host time per step, attention time and the
granularity of prefix hits.

For each block size (--block-sizes, 8 to 128 tokens), over one KV memory budget (--kv-tokens
token slots), the same seeded workload runs through the real scheduler with a fake sampler (host
only: the scheduler and the plan builder are what a block size changes on the host):

- waste: (allocated slots - tokens held) / allocated slots at the allocation peak and averaged
  over steps (internal fragmentation: a sequence's last block is partly empty; a block shared
  through the prefix cache counts its tokens once);
- host time per step: scheduler.schedule + build_plan, p50/p95/p99 (the block tables' width and
  the per-block bookkeeping grow as blocks shrink);
- prefix-hit granularity: every request starts with the same --shared-tokens system prompt (not
  a multiple of any block size); hits / shared tokens of the requests after the first (a hit is
  whole blocks only, so bigger blocks leave more of the prompt to recompute).

Then the attention itself: the reference paged decode attention (pallas_kernels.reference, the
CPU path; jitted) over --batch sequences of --context tokens in a pool laid out at each block
size, p50/p95/p99 of --calls calls (a block is the unit the kernel gathers).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
from common import lognormal_workload, percentiles, write_results

from pagedjax.engine.kv_snapshot import tokens_stored
from pagedjax.scheduler import (KVCacheManager, Request, SamplingParams, SchedulerConfig,
                                SchedulerState, ShapeBuckets, add_request, build_plan, schedule,
                                update)


def run_scheduler(block_size: int, args) -> dict:
    """The workload through the scheduler at block_size: waste, host time, prefix hits."""
    kv = KVCacheManager(1 + args.kv_tokens // block_size, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
                             max_model_len=args.max_model_len, enable_prefix_caching=True)
    buckets = ShapeBuckets.create(max_num_batched_tokens=512, max_num_seqs=args.max_num_seqs,
                                  max_model_len=args.max_model_len, block_size=block_size)
    state = SchedulerState(config, kv)
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, 32000, args.shared_tokens).tolist()
    workload = lognormal_workload(args.requests, seed=args.seed,
                                  max_model_len=args.max_model_len - args.shared_tokens)
    for i, (prompt_len, output_len) in enumerate(workload):
        add_request(state, Request(str(i), shared + rng.integers(0, 32000, prompt_len).tolist(),
                                   SamplingParams(max_tokens=output_len, temperature=0.0),
                                   seed=0, arrival_time=0.0))
    host_s, sum_alloc, sum_held, peak = [], 0, 0, (0, 0)
    steps = 0
    while state.requests:
        steps += 1
        start = time.perf_counter()
        state, output = schedule(state, float(steps))
        build_plan(output, kv, buckets)
        host_s.append(time.perf_counter() - start)
        update(state, output, [1] * (len(output.scheduled) + len(output.forks)), float(steps))
        allocated = kv.num_used_blocks * block_size
        held = tokens_stored(SimpleNamespace(kv_manager=kv, state=state))  # shared: once
        sum_alloc, sum_held = sum_alloc + allocated, sum_held + held
        peak = max(peak, (allocated, held))
    reusable = args.shared_tokens * (args.requests - 1)
    return {"peak_waste_pct": round(100.0 * (peak[0] - peak[1]) / peak[0], 2),
            "mean_waste_pct": round(100.0 * (sum_alloc - sum_held) / sum_alloc, 2),
            "steps": steps, "preemptions": state.num_preemptions,
            **percentiles(host_s, "host_step"),
            "prefix_hit_tokens": state.num_prefix_hit_tokens,
            "shared_prefix_hit_pct": round(100.0 * min(state.num_prefix_hit_tokens, reusable)
                                           / reusable, 2)}


def time_attention(block_size: int, args) -> dict:
    """The reference paged decode attention at block_size: p50/p95/p99 of --calls calls."""
    import jax
    import jax.numpy as jnp

    from pagedjax.pallas_kernels.reference import paged_decode_attention_reference

    blocks_per_seq = -(-args.context // block_size)
    num_blocks = 1 + args.batch * blocks_per_seq
    key = jax.random.key(args.seed)
    kv = jax.random.normal(key, (2, args.kv_heads, num_blocks, block_size, args.head_dim),
                           jnp.float32)
    q = jax.random.normal(key, (args.batch, args.heads, args.head_dim), jnp.float32)
    tables = (1 + np.random.default_rng(args.seed).permutation(num_blocks - 1)).reshape(
        args.batch, blocks_per_seq).astype(np.int32)
    lens = jnp.full(args.batch, args.context, jnp.int32)
    attend = jax.jit(lambda q, kv, lens, tables: paged_decode_attention_reference(
        q, kv, lens, tables, jnp.int32(args.batch), scale=args.head_dim ** -0.5))
    attend(q, kv, lens, tables).block_until_ready()  # compile
    seconds = []
    for _ in range(args.calls):
        start = time.perf_counter()
        attend(q, kv, lens, tables).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return percentiles(seconds, "attention")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-sizes", default="8,16,32,64,128")
    parser.add_argument("--kv-tokens", type=int, default=24576, help="the pool, in token slots")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--shared-tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="attention: sequences")
    parser.add_argument("--context", type=int, default=1024, help="attention: tokens each")
    parser.add_argument("--heads", type=int, default=9)  # SmolLM2-135M's attention shape
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for block_size in map(int, args.block_sizes.split(",")):
        rows.append({"block_size": block_size, **run_scheduler(block_size, args),
                     **time_attention(block_size, args)})
        print(rows[-1], flush=True)
    base = next(r for r in rows if r["block_size"] == 16) if any(
        r["block_size"] == 16 for r in rows) else rows[0]
    for row in rows:
        row["host_ratio_vs_16"] = round(row["host_step_p50_ms"] / base["host_step_p50_ms"], 3)
        row["attention_ratio_vs_16"] = round(row["attention_p50_ms"] / base["attention_p50_ms"],
                                             3)
    write_results("block_size", "Block size: KV waste, host time per step, attention time, "
                  "prefix-hit granularity", rows, vars(args), __doc__.split("\n", 2)[2])


if __name__ == "__main__":
    main()
