"""`make demo`: serve a mixed batch on the embedded default model and report what the engine did.

Until the project's trained default model lands, the default is `demo-small`: a Llama-family
config built in code with seeded random weights, so the tokens are not meaningful text, but every
number in the table (throughput, KV blocks, waste, preemptions, programs) is real.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedjax.llm import LLM
from scheduler import SamplingParams


def mixed_workload(num_requests: int, vocab_size: int, max_model_len: int, seed: int):
    """Log-normal prompt and output lengths (long tails), a third of them sampled, half of them
    behind a shared 64-token system prompt (prefix caching)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, 64).tolist()
    prompts, params = [], []
    for i in range(num_requests):
        prompt_len = int(np.clip(rng.lognormal(3.5, 1.0), 2, max_model_len // 2 - 64))
        max_tokens = int(np.clip(rng.lognormal(3.0, 0.7), 4, max_model_len // 2))
        head = system if i % 2 else []
        prompts.append(head + rng.integers(0, vocab_size, prompt_len).tolist())
        if i % 3 == 2:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95,
                                         top_k=50, seed=i))
        else:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return prompts, params


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--policy", default="mixed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    llm = LLM(args.model, block_size=args.block_size, num_blocks=args.num_blocks,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, policy=args.policy,
              min_token_bucket=32, min_seq_bucket=4, seed=args.seed)
    engine = llm.engine
    prompts, params = mixed_workload(args.num_requests, engine.model_config.vocab_size,
                                     args.max_model_len, args.seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start

    print(f"\nmodel {args.model}: {engine.model_config.num_params / 1e6:.2f} M parameters, "
          f"random weights (seed {args.seed}); attention backend {engine.runner.backend.name}")
    print(f"{'id':>3} {'prompt':>6} {'output':>6} {'finish':>6} {'TTFT s':>7}  first output ids")
    for out in outputs[:8]:
        ttft = out.metrics.ttft
        print(f"{out.request_id:>3} {len(out.prompt_token_ids):>6} "
              f"{len(out.output_token_ids):>6} {out.finish_reason:>6} {ttft:>7.2f}  "
              f"{out.output_token_ids[:8]}")
    print(f"... and {len(outputs) - 8} more\n")
    print_table(engine, outputs, elapsed)


def print_table(engine, outputs, elapsed: float) -> None:
    stats = engine.stats
    num_out = sum(len(o.output_token_ids) for o in outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = np.array([o.metrics.ttft for o in outputs])
    block_size = engine.config.block_size
    rows = [
        ("requests", f"{len(outputs)}"),
        ("prompt / output tokens", f"{num_prompt} / {num_out}"),
        ("wall time (incl. compiles)", f"{elapsed:.1f} s"),
        ("output tokens/s", f"{num_out / elapsed:.1f}"),
        ("TTFT p50 / p99", f"{np.percentile(ttfts, 50):.2f} / {np.percentile(ttfts, 99):.2f} s"),
        ("steps (prefill / decode)", f"{stats.num_prefill_steps} / {stats.num_decode_steps}"),
        ("KV pool", f"{stats.num_blocks} blocks x {block_size} tokens "
                    f"({stats.num_blocks * engine.bytes_per_block / 2**20:.1f} MiB)"),
        ("KV blocks used at peak", f"{stats.peak_used_blocks} "
                                   f"({stats.peak_used_tokens} tokens held)"),
        ("KV waste at peak", f"{100 * stats.peak_waste:.1f}%"),
        ("max concurrent sequences", f"{stats.max_running}; reserving max_model_len each "
                                     f"would need {stats.max_running * engine.config.max_blocks_per_seq} blocks"),
        ("prefix cache hits", f"{stats.num_prefix_hit_tokens} of "
                              f"{stats.num_prefix_query_tokens} prompt tokens "
                              f"({100 * stats.prefix_hit_rate:.1f}%), "
                              f"{stats.num_evictions} evictions"),
        ("preemptions", f"{stats.num_preemptions}"),
        ("compiled programs", f"{engine.num_compiled_programs} "
                              f"(bound {engine.buckets.num_programs})"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    main()
