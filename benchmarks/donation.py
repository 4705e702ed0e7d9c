"""Donation check: decode step time must not grow with the size of the KV pool.

The same decode plan (same sequences, same context, same blocks) runs against a pool 1x and 8x
larger. With the cache donated, XLA updates it in place and the two times match; the same step
jitted without donation is measured beside it, where every step copies the whole pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np
from common import write_results

from pagedjax import load_model
from pagedjax.engine.runner import ModelRunner
from pagedjax.engine.step_functions import step_fn
from pagedjax.pallas_kernels import kv_cache_bytes_per_block
from pagedjax.scheduler import DECODE, BatchPlan
from pagedjax.scheduler.plan import padding_plan

_undonated_step = jax.jit(step_fn, static_argnums=(0, 1, 2))


def decode_plan(num_seqs: int, context: int, block_size: int, table_width: int) -> BatchPlan:
    """A decode step of num_seqs sequences of context tokens on distinct blocks (a padding plan
    of the runner's with the real rows filled in)."""
    blocks_per_seq = -(-context // block_size)
    tables = np.zeros((num_seqs, table_width), np.int32)
    tables[:, :blocks_per_seq] = 1 + np.arange(num_seqs * blocks_per_seq).reshape(num_seqs, -1)
    slots = tables[:, (context - 1) // block_size] * block_size + (context - 1) % block_size
    return dataclasses.replace(
        padding_plan(DECODE, num_seqs, num_seqs, table_width),
        token_ids=np.arange(num_seqs, dtype=np.int32),
        positions=np.full(num_seqs, context - 1, np.int32), slot_mapping=slots.astype(np.int32),
        block_tables=tables, kv_lens=np.full(num_seqs, context, np.int32),
        cu_q_lens=np.arange(num_seqs + 1, dtype=np.int32),
        logits_indices=np.arange(num_seqs, dtype=np.int32),
        num_seqs=np.asarray(num_seqs, np.int32))


def run_step(runner: ModelRunner, plan: BatchPlan, donate: bool) -> float:
    start = time.perf_counter()
    if donate:
        runner.step(plan)
    else:
        (ids, *_), runner.kv_cache = _undonated_step(
            runner.graph, runner.backend, 0, runner.params, runner.kv_cache, plan)
        np.asarray(ids)
    return time.perf_counter() - start


def interleaved_medians(runners, plan, iters: int, donate_options=(True, False)) -> dict:
    """Median step time of every (runner, donate) pair, measured round-robin in a shuffled order
    each round, so drift and cache effects of the neighbouring case spread evenly."""
    cases = [(i, donate) for i in range(len(runners)) for donate in donate_options]
    times = {case: [] for case in cases}
    rng = np.random.default_rng(0)
    for round_index in range(iters + 3):
        for k in rng.permutation(len(cases)):
            i, donate = cases[k]
            elapsed = run_step(runners[i], plan, donate)
            if round_index >= 3:  # the first rounds compile and warm caches
                times[(i, donate)].append(elapsed)
    return {case: float(np.median(t)) for case, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()

    model = load_model(args.model)
    config = model.config
    active_blocks = args.num_seqs * -(-args.context // args.block_size)
    table_width = -(-config.max_position_embeddings // args.block_size)
    plan = decode_plan(args.num_seqs, args.context, args.block_size, table_width)
    bytes_per_block = kv_cache_bytes_per_block(config.num_layers, args.block_size,
                                               config.num_kv_heads, config.head_dim, np.float32)
    scales = (1, 8)
    runners = [ModelRunner(model, num_blocks=1 + active_blocks * scale,
                           block_size=args.block_size, dtype=np.float32)
               for scale in scales]
    medians = interleaved_medians(runners, plan, args.iters)
    rows = []
    for i, scale in enumerate(scales):
        num_blocks = 1 + active_blocks * scale
        rows.append({"pool": f"{scale}x", "num_blocks": num_blocks,
                     "pool_mib": num_blocks * bytes_per_block / 2**20,
                     "donated_step_ms": 1e3 * medians[(i, True)],
                     "undonated_step_ms": 1e3 * medians[(i, False)]})
    for row in rows:
        row["donated_ratio_vs_1x"] = row["donated_step_ms"] / rows[0]["donated_step_ms"]
        row["undonated_ratio_vs_1x"] = row["undonated_step_ms"] / rows[0]["undonated_step_ms"]
    write_results("donation", "Decode step time vs KV pool size (donated cache)", rows,
                  dict(vars(args), active_blocks=active_blocks), notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
