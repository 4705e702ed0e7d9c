"""Preemption under a deliberately small KV pool: recompute vs swap, LIFO vs fewest-computed.

Same model, workload (log-normal lengths, greedy) and pool on every row; outputs are checked
equal across rows. Recomputed tokens are computed tokens thrown away by recompute preemption;
their ratio to generated tokens is the wasted work per useful token. Prompt tokens computed
count every prompt position a step computed (recomputation included, prefix-cache hits not):
the rows with the prefix cache and its host tier show how much of the recomputation the cache
serves instead (the tier the size of swap's pool: the question is whether the tiered prefix
cache can be swap preemption's offload, one host pool instead of two).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import lognormal_workload, write_results

from pagedjax import EngineConfig, LLMEngine, SamplingParams, load_model


def run(model, prompts, params, config):
    engine = LLMEngine(model, EngineConfig(**config))
    engine.warmup()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    seconds = time.perf_counter() - start
    stats = engine.stats
    generated = sum(len(t) for t in done.values())
    return {"preemptions": stats.num_preemptions, "swap_outs": stats.num_swap_outs,
            "prompt_tokens_computed": stats.num_prompt_tokens_computed,
            "host_tier_blocks_loaded": stats.kv_tiers.get("host", {}).get("blocks_out", 0),
            "recomputed_tokens": stats.num_recomputed_tokens,
            "recomputed_per_generated": stats.num_recomputed_tokens / generated,
            "steps": stats.num_steps, "seconds": seconds,
            "output_tokens_per_s": generated / seconds}, [done[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = load_model(args.model, seed=args.seed)
    workload = lognormal_workload(args.num_requests, seed=args.seed, max_model_len=512,
                                  prompt_mu=4.0, output_mu=4.0)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.config.vocab_size, p).tolist() for p, _ in workload]
    params = [SamplingParams(max_tokens=o, temperature=0.0) for _, o in workload]
    base = dict(block_size=16, num_blocks=args.num_blocks, max_model_len=512, max_num_seqs=16,
                max_num_batched_tokens=256, min_token_bucket=32, min_seq_bucket=4,
                enable_prefix_caching=False)
    swap_bytes = 4 * args.num_blocks * 16384  # demo-small: 16 KiB per block of 16 tokens
    variants = [
        ("recompute, lifo", dict(preemption_mode="recompute", victim_policy="lifo")),
        ("recompute, fewest_computed", dict(preemption_mode="recompute",
                                            victim_policy="fewest_computed")),
        ("swap, lifo", dict(preemption_mode="swap", swap_space_bytes=swap_bytes)),
        # The tiered prefix cache as the offload (vLLM V1's choice: no swap, a CPU offloading
        # connector): a preempted request's full blocks stay cached, evicted blocks go to a
        # host tier of swap's size, and readmission loads them back instead of recomputing.
        ("recompute, lifo, prefix cache", dict(preemption_mode="recompute",
                                               enable_prefix_caching=True)),
        ("recompute, lifo, prefix cache + host tier",
         dict(preemption_mode="recompute", enable_prefix_caching=True,
              kv_offload_bytes=swap_bytes)),
    ]
    rows, reference = [], None
    for name, extra in variants:
        row, tokens = run(model, prompts, params, {**base, **extra})
        if reference is None:
            reference = tokens
        elif tokens != reference:
            raise RuntimeError(f"{name} produced different tokens")
        rows.append({"preemption": name, **row})
        print(rows[-1], flush=True)
    write_results("preemption", "Preemption under a small KV pool", rows,
                  dict(vars(args), kv_budget_tokens=(args.num_blocks - 1) * 16),
                  notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
