"""Scheduling policies under the same load: mixed, decode_first and prefill_first on TTFT, TPOT
and throughput.

One engine per policy (the same model, pool and token budget, warmed up), the same seeded
workload: --requests requests arriving as a Poisson process at --rate requests/s, log-normal
prompt and output lengths (clipped to --max-model-len), greedy, EOS ignored so every policy
generates exactly the same tokens. Requests are added when their arrival time comes (the engine
stepped in real time in between). TTFT: arrival to first token; TPOT: a request's mean time per
output token after its first. Reported: p50/p95/p99 of both (milliseconds), output tokens/s
over the run, preemptions, and the ratios of the p50s against mixed (the default) in the same
run.

- mixed: running requests first (decodes and prefill chunks alike), then new ones, in one step;
- decode_first: a step of decodes whenever any request decodes; prefills only otherwise;
- prefill_first: running prefill chunks and new requests first, decodes when none is left.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import (add_engine_flags, engine_config, lognormal_workload, percentiles, recorded_args,
                    write_results)

from pagedjax import LLMEngine, SamplingParams, load_model
from pagedjax.scheduler import POLICIES


def run(engine: LLMEngine, workload, arrivals) -> dict:
    """The workload into the engine at its arrival times; per request TTFT and TPOT."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, p).tolist() for p, _ in workload]
    start, next_request, finished = time.perf_counter(), 0, []
    preempted = engine.stats.num_preemptions
    while len(finished) < len(workload):
        now = time.perf_counter() - start
        while next_request < len(workload) and arrivals[next_request] <= now:
            _, output_len = workload[next_request]
            engine.add_request(prompts[next_request], SamplingParams(
                max_tokens=output_len, temperature=0, ignore_eos=True),
                arrival_time=start + arrivals[next_request])
            next_request += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrivals[next_request] - now, 0.01)))
            continue
        finished += engine.step(final_only=True)
    seconds = time.perf_counter() - start
    ttft = [o.metrics.ttft for o in finished]
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.output_token_ids) - 1)
            for o in finished if len(o.output_token_ids) > 1]
    tokens = sum(len(o.output_token_ids) for o in finished)
    return {**percentiles(ttft, "ttft"), **percentiles(tpot, "tpot"),
            "output_tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 2),
            "preemptions": engine.stats.num_preemptions - preempted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second")
    add_engine_flags(parser, num_blocks=513, block_size=16, max_model_len=512, max_num_seqs=32,
                     max_num_batched_tokens=256, seed=0)
    args = parser.parse_args()
    workload = lognormal_workload(args.requests, seed=args.seed,
                                  max_model_len=args.max_model_len)
    arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1 / args.rate,
                                                                      args.requests))
    model = load_model(args.model, seed=args.seed)
    rows = []
    for policy in POLICIES:
        engine = LLMEngine(model, engine_config(args, policy=policy))
        engine.warmup()
        rows.append({"policy": policy, **run(engine, workload, arrivals)})
        print(rows[-1], flush=True)
    base = next(r for r in rows if r["policy"] == "mixed")
    for row in rows:
        for name in ("ttft_p50_ms", "tpot_p50_ms"):
            row[f"{name.split('_')[0]}_p50_vs_mixed"] = round(row[name] / base[name], 3)
    write_results("policies", "Scheduling policies under the same load: TTFT, TPOT, "
                  "throughput", rows, {**recorded_args(args),
                                       "workload_output_tokens": sum(o for _, o in workload)},
                  __doc__.split("\n", 2)[2])


if __name__ == "__main__":
    main()
