"""n = 4 parallel sampling vs four independent requests: KV blocks and prompt tokens computed.

The same prompts and seeds on both sides (sample i of a request uses seed + i, which is what the
i-th independent request gets), prefix caching off on both so that only forking shares blocks.
Outputs are checked equal. Peak blocks are read after every step.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import write_results

from pagedjax import EngineConfig, LLMEngine, SamplingParams, load_model


def run(model, requests, config) -> dict:
    engine = LLMEngine(model, EngineConfig(**config))
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done, peak = {}, 0
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        peak = max(peak, engine.scheduler.kv_manager.num_used_blocks)
    stats = engine.stats
    tokens = [s.token_ids for i in ids for s in done[i].outputs]
    # Every sample's first token comes from a prompt step; the others from one decode token each.
    prompt_computed = stats.num_scheduled_tokens - (stats.num_generated_tokens - len(tokens))
    return {"peak_blocks": peak, "prompt_tokens_computed": prompt_computed,
            "steps": stats.num_steps}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    args = parser.parse_args()
    model = load_model(args.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, args.prompt_len).tolist()
               for _ in range(args.num_prompts)]
    config = dict(block_size=16, max_model_len=1024, max_num_seqs=32,
                  max_num_batched_tokens=512, enable_prefix_caching=False, min_seq_bucket=4,
                  min_token_bucket=64)

    def params(seed, n=1):
        return SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, n=n)

    forked, forked_tokens = run(model, [(p, params(10 * j, args.n))
                                        for j, p in enumerate(prompts)], config)
    independent, solo_tokens = run(model, [(p, params(10 * j + i)) for j, p in enumerate(prompts)
                                           for i in range(args.n)], config)
    if forked_tokens != solo_tokens:
        raise RuntimeError("parallel samples differ from the independent seeded requests")
    rows = [{"mode": f"n={args.n} (fork + copy-on-write)", **forked},
            {"mode": f"{args.n} independent requests", **independent}]
    for row in rows:
        row["blocks_vs_independent"] = row["peak_blocks"] / independent["peak_blocks"]
    write_results("parallel_sampling", "Parallel sampling: KV blocks vs independent requests",
                  rows, vars(args), notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
