"""KV cache groups (the hybrid KV cache manager) on Gemma-3-shaped models: memory, and a run.

Capacity (computed from the layouts the engine builds, pagedjax.models.layers.kv_groups and
scheduler.kv_cache_groups, no model run): for Gemma-3-1B, 4B and 27B's real shapes at 4k, 8k
and 32k tokens, the KV blocks and bytes one sequence needs and the sequences a pool holds,
with KV cache groups (a full group and sliding groups of the same number of layers; a sliding
group holds its window and one step's tokens, max_num_batched_tokens 2048) against every layer
keeping the whole context. Pool: 16 GiB a device; 27B at TP 8. table_kib_per_row: the block
tables a row of a step's plan carries with groups (the full group's max_model_len-wide table,
each sliding group's ring of its bound: ShapeBuckets.group_table_width) against every group's
table max_model_len wide (max_model_len = the context).

Run (measured, same run, same pool bytes): a Gemma-3-shaped model scaled down to the CPU
(12 layers, every 6th global, window 64, random weights) serves a mixed long-context workload
(prompts of 256-1,024 tokens, 32 output tokens each, all queued at once) both ways: output
tokens/s, the most sequences running at once, preemptions, steps. The same pool bytes hold
more blocks with groups (a block is one group's layers, not all of them).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from common import recorded_args, write_results

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models import get_config, init_model
from pagedjax.models.layers.kv_groups import kv_cache_groups
from pagedjax.scheduler import ShapeBuckets
from pagedjax.tools.capacity_commands import kv_capacity

SHAPES = {"gemma-3-1b": 1, "gemma-3-4b": 1, "gemma-3-27b": 8}  # name -> TP


def capacity_rows(pool_gib: float, block_size: int, step_tokens: int) -> list[dict]:
    rows = []
    for name, tp in SHAPES.items():
        config = get_config(name)
        for context in (4096, 8192, 32768):
            both = {}
            for label, hybrid in (("groups", True), ("full", False)):
                both[label] = kv_capacity(config, kv_cache_groups(config, hybrid), block_size,
                                          int(pool_gib * 2**30), context, tp, 2, step_tokens)
            buckets = ShapeBuckets.create(
                max_num_batched_tokens=step_tokens, max_num_seqs=1, max_model_len=context,
                block_size=block_size, group_windows=kv_cache_groups(config).windows)
            num_groups = both["groups"]["groups"]
            width, ring = buckets.table_widths
            rows.append({
                "model": name, "tp": tp, "context": context,
                "table_kib_per_row_ring": round((width + (num_groups - 1) * ring) * 4 / 1024, 1),
                "table_kib_per_row_wide": round(num_groups * width * 4 / 1024, 1),
                "groups": both["groups"]["groups"],
                "mib_per_seq_groups": round(both["groups"]["kv_bytes_per_seq"] / 2**20, 1),
                "mib_per_seq_full": round(both["full"]["kv_bytes_per_seq"] / 2**20, 1),
                "seqs_groups": both["groups"]["sequences"],
                "seqs_full": both["full"]["sequences"],
                "seqs_ratio": round(both["groups"]["sequences"]
                                    / max(1, both["full"]["sequences"]), 2)})
    return rows


def small_gemma3(window: int):
    config = get_config("gemma-3-1b")
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                  for i in range(12))
    return dataclasses.replace(config, vocab_size=2048, hidden_size=256, intermediate_size=512,
                               num_layers=12, num_heads=4, num_kv_heads=1, head_dim=64,
                               sliding_window=window, layer_types=types,
                               query_pre_attn_scalar=64, max_position_embeddings=4096)


def run_rows(args) -> list[dict]:
    model = init_model(small_gemma3(args.window), seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2048, int(n)).tolist()
               for n in rng.integers(256, 1025, args.num_requests)]
    full_bytes_per_block = None
    rows = []
    for label, hybrid in (("every layer full", False), ("KV cache groups", True)):
        base = dict(block_size=16, max_model_len=1088, max_num_seqs=16,
                    max_num_batched_tokens=512, enable_prefix_caching=False,
                    disable_hybrid_kv_cache_manager=not hybrid)
        probe = LLMEngine(model, EngineConfig(**base, num_blocks=2))
        if full_bytes_per_block is None:
            full_bytes_per_block = probe.bytes_per_block
        pool_bytes = args.full_pool_blocks * full_bytes_per_block  # the same bytes both ways
        num_blocks = pool_bytes // probe.bytes_per_block
        del probe
        engine = LLMEngine(model, EngineConfig(**base, num_blocks=num_blocks))
        engine.warmup()
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        most, tokens, start = 0, 0, time.perf_counter()
        while engine.has_unfinished():
            tokens += sum(len(o.output_token_ids) for o in engine.step() if o.finished)
            most = max(most, len(engine.scheduler.state.running))
        seconds = time.perf_counter() - start
        rows.append({"run": label, "pool_mib": round(pool_bytes / 2**20, 2),
                     "pool_blocks": num_blocks, "seconds": round(seconds, 2),
                     "output_tokens_per_s": round(tokens / seconds, 1),
                     "most_running": most,
                     "preemptions": engine.scheduler.state.num_preemptions,
                     "steps": engine.stats.num_steps})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=16.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--step-tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--full-pool-blocks", type=int, default=257,
                        help="the pool, in blocks of the every-layer-full layout (its bytes "
                        "are given to both runs)")
    args = parser.parse_args()
    rows = capacity_rows(args.pool_gib, args.block_size, args.step_tokens)
    for row in rows:
        print(row)
    rows += run_rows(args)
    write_results("kv_groups", "KV cache groups on Gemma-3-shaped models: memory and a run",
                  rows, recorded_args(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
