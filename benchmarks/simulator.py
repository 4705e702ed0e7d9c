"""The scheduler simulator against the real engine: fit on one workload, predict others.

The step-time model (scheduler.simulator.StepCostModel: per step kind, seconds linear in the
padded token count T, padded sequence count B and KV tokens attended, plus each compiled
shape's mean residual) is fitted to the steps of two runs of the engine (demo-small, log-normal
workloads of 96 requests: one arriving at once, one as a Poisson stream at 70% of the first's
rate, so that large and small batches are both in the fit).
Then each validation workload runs twice: on the engine (pagedjax.tools.profiling.run_trace, real
time) and in the simulator (the same scheduler code on predicted time), and the table sets
them side by side:

- same config, another seeded workload, all at once;
- the same workload in a pool a third the size (preemptions);
- Poisson arrivals at 70% of the rate the fitting run sustained (replayed in real time);
- 8 groups of 8 requests sharing a 256-token prefix (prefix caching).

Arriving all at once, the simulated schedule must be the engine's step for step (steps,
prefill steps, preemptions equal); times are predictions, errors in the last columns.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import add_engine_flags, engine_config, lognormal_workload, recorded_args, write_results

from pagedjax import LLMEngine, load_model
from pagedjax.scheduler.cost_model import StepCostModel
from pagedjax.scheduler.simulator import simulate
from pagedjax.scheduler.trace import TraceRequest
from pagedjax.tools.profiling import run_trace


def trace_of(pairs, arrivals=None) -> list[TraceRequest]:
    arrivals = np.zeros(len(pairs)) if arrivals is None else arrivals
    return [TraceRequest(float(a), p, o) for (p, o), a in zip(pairs, arrivals)]


def compare_rows(name: str, real, sim) -> list[dict]:
    """The engine's run and the simulator's of one workload, with the simulator's errors."""
    rows = []
    for source, result in (("engine", real), ("simulator", sim)):
        s = result.summary()
        row = {"workload": name, "run": source, "steps": s["steps"],
               "prefill_steps": s["prefill_steps"], "preemptions": s["preemptions"],
               "prefix_hit_rate": s["prefix_hit_rate"], "makespan_s": s["makespan_s"],
               **{f"{m}_p{q}_ms": s[f"{m}_p{q}_s"] * 1e3 for m in ("ttft", "tpot")
                  for q in (50, 95, 99)}}
        if source == "simulator":
            r = real.summary()
            row["makespan_err"] = s["makespan_s"] / r["makespan_s"] - 1
            row["ttft_p50_err"] = s["ttft_p50_s"] / r["ttft_p50_s"] - 1
            row["tpot_p50_err"] = s["tpot_p50_s"] / r["tpot_p50_s"] - 1
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--small-num-blocks", type=int, default=86)
    add_engine_flags(parser, num_blocks=257, block_size=16, max_model_len=512, max_num_seqs=32,
                     max_num_batched_tokens=256, seed=0)
    args = parser.parse_args()

    model = load_model(args.model, seed=args.seed)
    engines = {}

    def engine_for(num_blocks: int) -> LLMEngine:
        if num_blocks not in engines:
            engine = LLMEngine(model, engine_config(args, num_blocks=num_blocks))
            engine.warmup()
            engines[num_blocks] = engine
        return engines[num_blocks]

    def workload(seed):
        return lognormal_workload(args.num_requests, seed=seed, max_model_len=args.max_model_len)

    fit_trace = trace_of(workload(args.seed))
    measured, samples = run_trace(engine_for(args.num_blocks), fit_trace)
    capacity_rps = len(fit_trace) / measured.makespan_s
    rng = np.random.default_rng(args.seed + 7)
    fit_poisson = trace_of(workload(args.seed + 3), np.cumsum(
        rng.exponential(1 / (0.7 * capacity_rps), args.num_requests)))
    measured_poisson, more = run_trace(engine_for(args.num_blocks), fit_poisson)
    samples += more
    cost = StepCostModel.fit(samples)
    shared = [TraceRequest(0.0, 256 + int(rng.integers(8, 64)), int(rng.integers(16, 64)),
                           prefix_group=g, prefix_len=256) for g in range(8) for _ in range(8)]
    poisson = np.cumsum(rng.exponential(1 / (0.7 * capacity_rps), args.num_requests))
    fitted = {id(fit_trace): measured, id(fit_poisson): measured_poisson}
    cases = [("fit: workload 0, all at once", fit_trace, args.num_blocks),
             ("fit: workload 3, Poisson 0.7x", fit_poisson, args.num_blocks),
             ("workload 1, all at once", trace_of(workload(args.seed + 1)), args.num_blocks),
             (f"workload 1, {args.small_num_blocks}-block pool", trace_of(workload(args.seed + 1)),
              args.small_num_blocks),
             ("workload 2, Poisson 0.7x", trace_of(workload(args.seed + 2), poisson),
              args.num_blocks),
             ("8 x 8 sharing a 256-token prefix", shared, args.num_blocks)]
    rows = []
    for name, trace, num_blocks in cases:
        engine = engine_for(num_blocks)
        real = fitted.get(id(trace)) or run_trace(engine, trace)[0]
        sim = simulate(trace, engine.config.scheduler_config(), num_blocks=num_blocks,
                       block_size=args.block_size, buckets=engine.buckets, cost=cost,
                       vocab_size=engine.model_config.vocab_size)
        rows += compare_rows(name, real, sim)
    write_results("simulator", "Scheduler simulator vs the engine (fit once, predict the rest)",
                  rows, {**recorded_args(args), "cost_model": cost.coef,
                         "fit_steps": len(samples)}, __doc__.split("\n", 2)[2])


if __name__ == "__main__":
    main()
