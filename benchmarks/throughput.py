"""Offline throughput: continuous batching over paged KV vs static batching, same model and memory.

Both sides run the same model, the same jit step programs (warmed up before timing) and the same
KV memory budget, on the same seeded log-normal workload, greedy:

- engine: LLMEngine, continuous batching, blocks on demand, chunked prefill (mixed policy);
- static: FCFS batches; each row reserves the batch's longest prompt + max_tokens up front, so
  the batch is as large as those reservations allow in the budget; no request joins until the
  whole batch has finished (wait for the longest).

The static baseline is given two advantages over a real padded implementation: prompts are not
padded to the longest (only real tokens are computed), and finished rows leave the decode batch.
Both sides must produce the same tokens, which the script checks.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import add_engine_flags, engine_config, lognormal_workload, recorded_args, write_results

from pagedjax import LLMEngine, load_model
from pagedjax.scheduler import (DECODE, PREFILL, SamplingParams, ScheduledSeq, SchedulerOutput,
                                build_plan, update)


def run_engine(engine: LLMEngine, prompts, params) -> tuple[dict, float]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    return [outputs[i] for i in ids], time.perf_counter() - start


def run_static(engine: LLMEngine, prompts, params) -> tuple[list, float, int, int]:
    """Static batching driven by hand through the engine's own runner and plan builder."""
    state = engine.scheduler.state
    kv = state.kv_manager
    budget_tokens = kv.pool.num_usable_blocks * kv.block_size
    config = engine.config
    requests = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
    start = time.perf_counter()
    next_index, num_batches, num_steps = 0, 0, 0
    while next_index < len(requests):
        batch, longest = [], 0
        while next_index + len(batch) < len(requests) and len(batch) < config.max_num_seqs:
            candidate = requests[next_index + len(batch)]
            reserve = kv.num_blocks_for(max(longest, candidate.max_num_tokens)) * kv.block_size
            if reserve * (len(batch) + 1) > budget_tokens:
                break
            batch.append(candidate)
            longest = max(longest, candidate.max_num_tokens)
        next_index += len(batch)
        num_batches += 1
        for request in batch:
            state.requests[request.request_id] = request
            state.running.append(request)
            kv.allocate_slots(request, longest)  # the whole reservation, up front
        while state.running:
            step = schedule_static(state.running, config.max_num_batched_tokens)
            plan = build_plan(step, kv, engine.buckets)
            update(state, step, engine.runner.step(plan)[0], time.perf_counter())
            num_steps += 1
    elapsed = time.perf_counter() - start
    return [r.output_token_ids for r in requests], elapsed, num_batches, num_steps


def schedule_static(running, token_budget: int) -> SchedulerOutput:
    """Prefill chunks until every prompt is in, then decode every unfinished row."""
    scheduled, budget = [], token_budget
    for request in running:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > 1 and budget > 0:
            n = min(remaining, budget)
            scheduled.append(ScheduledSeq(request, request.num_computed_tokens, n))
            budget -= n
    if scheduled:
        return SchedulerOutput(scheduled, [], PREFILL, token_budget - budget, 0.0)
    scheduled = [ScheduledSeq(r, r.num_computed_tokens, 1) for r in running]
    return SchedulerOutput(scheduled, [], DECODE, len(scheduled), 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-requests", type=int, default=96)
    add_engine_flags(parser, num_blocks=129, block_size=16, max_model_len=512, max_num_seqs=32,
                     max_num_batched_tokens=256, seed=0)
    args = parser.parse_args()

    workload = lognormal_workload(args.num_requests, seed=args.seed,
                                  max_model_len=args.max_model_len, prompt_mu=4.0,
                                  output_mu=3.5)
    rng = np.random.default_rng(args.seed)
    model = load_model(args.model, seed=args.seed)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, p).tolist() for p, _ in workload]
    params = [SamplingParams(max_tokens=o, temperature=0.0) for _, o in workload]
    config = engine_config(args, min_token_bucket=16, min_seq_bucket=4)
    engine = LLMEngine(model, config)
    static_engine = LLMEngine(model, config)
    engine.warmup()  # the same programs serve both sides: nothing compiles while timed

    engine_tokens, engine_s = run_engine(engine, prompts, params)
    static_tokens, static_s, num_batches, static_steps = run_static(static_engine, prompts, params)
    if engine_tokens != static_tokens:
        raise RuntimeError("engine and static batching produced different greedy tokens")
    num_output = sum(o for _, o in workload)
    stats = engine.stats
    rows = [
        {"system": "engine (continuous, paged)", "seconds": engine_s,
         "output_tokens_per_s": num_output / engine_s, "steps": stats.num_steps,
         "preemptions": stats.num_preemptions, "ratio_vs_static": static_s / engine_s},
        {"system": "static batching (reserve longest)", "seconds": static_s,
         "output_tokens_per_s": num_output / static_s,
         "steps": static_steps, "preemptions": 0, "ratio_vs_static": 1.0},
    ]
    write_results("throughput", "Offline throughput: continuous batching vs static batching",
                  rows, dict(recorded_args(args), output_tokens=num_output,
                             static_batches=num_batches,
                             kv_budget_tokens=(args.num_blocks - 1) * args.block_size),
                  notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
