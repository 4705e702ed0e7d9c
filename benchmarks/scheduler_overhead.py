"""Host time per step of schedule + build_plan (and of update) at a steady decode batch.

N requests are prefilled, then timed over decode steps where all N are running: the host-side
gap the accelerator would wait for between two steps (vLLM users report 5-6 ms at batch 256).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import percentiles, write_results

from pagedjax.scheduler import (Request, SamplingParams, Scheduler, SchedulerConfig, ShapeBuckets,
                                build_plan)


def measure(num_seqs: int, *, prompt_len: int, block_size: int, max_model_len: int,
            num_steps: int) -> dict:
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                             max_model_len=max_model_len)
    blocks_per_seq = -(-max_model_len // block_size)
    scheduler = Scheduler(config, num_seqs * blocks_per_seq + 1, block_size)
    buckets = ShapeBuckets.create(max_num_batched_tokens=8192, max_num_seqs=num_seqs,
                                  max_model_len=max_model_len, block_size=block_size)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        scheduler.add_request(Request(
            str(i), rng.integers(0, 32000, prompt_len).tolist(),
            SamplingParams(max_tokens=max_model_len - prompt_len, temperature=0.7),
            seed=i, arrival_time=0.0))
    now = 0.0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.state.running) \
            or scheduler.state.waiting:
        now += 1
        output = scheduler.schedule(now)
        scheduler.update(output, [1] * len(output.scheduled), now)
    plan_times, update_times = [], []
    sampled = np.ones(num_seqs, np.int32)
    for _ in range(num_steps):
        now += 1
        t0 = time.perf_counter()
        output = scheduler.schedule(now)
        build_plan(output, scheduler.kv_manager, buckets)
        t1 = time.perf_counter()
        scheduler.update(output, sampled, now)
        t2 = time.perf_counter()
        assert len(output.scheduled) == num_seqs and output.kind == "decode"
        plan_times.append(t1 - t0)
        update_times.append(t2 - t1)
    plan_ms = 1e3 * np.array(plan_times)
    update_ms = 1e3 * np.array(update_times)
    return {"running_seqs": num_seqs,
            **percentiles(plan_ms, "schedule_plus_plan", scale=1.0),
            **percentiles(update_ms, "update", scale=1.0),
            **percentiles(plan_ms + update_ms, "total_host", scale=1.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-steps", type=int, default=300)
    args = parser.parse_args()
    rows = [measure(n, prompt_len=args.prompt_len, block_size=args.block_size,
                    max_model_len=args.max_model_len, num_steps=args.num_steps)
            for n in (32, 128, 256)]
    write_results("scheduler_overhead", "Scheduler + plan-building host time per decode step",
                  rows, vars(args), notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
