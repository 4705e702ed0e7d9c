"""int8 / fp8 KV cache: blocks in a fixed budget, and greedy-token agreement with f32.

Capacity is the KV formula at real model shapes (llama-3-8b: 32 layers, 8 KV heads, head dim
128). Agreement runs the same seeded workload through demo-small with an f32 cache, a bf16 cache
an int8 and an fp8 (e4m3) cache: the share of generated positions whose greedy token matches the f32 run, up to
each sequence's first disagreement and over all positions (a flip changes what follows it).
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
from common import lognormal_workload, write_results

from pagedjax import EngineConfig, LLMEngine, SamplingParams, load_model
from pagedjax.models import get_config
from pagedjax.pallas_kernels import kv_cache_bytes_per_block


def generate(model, prompts, params, **config):
    engine = LLMEngine(model, EngineConfig(block_size=16, max_model_len=512, max_num_seqs=16,
                                           max_num_batched_tokens=256, min_token_bucket=32,
                                           min_seq_bucket=4, **config))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids], engine


def agreement(reference, other):
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(reference, other)]
    total = sum(len(x) for x in reference)
    same = sum(a == b for x, y in zip(reference, other) for a, b in zip(x, y))
    return sum(prefix) / total, same / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    args = parser.parse_args()

    big = get_config("llama-3-8b")
    budget = int(args.budget_gib * 2**30)
    model = load_model(args.model)
    workload = lognormal_workload(args.num_requests, seed=0, max_model_len=512, prompt_mu=4.0,
                                  output_mu=3.5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, p).tolist() for p, _ in workload]
    params = [SamplingParams(max_tokens=o, temperature=0.0) for _, o in workload]
    reference, _ = generate(model, prompts, params)
    rows = []
    for name, dtype, config in [("f32", np.float32, {}),
                                ("bf16", ml_dtypes.bfloat16, dict(dtype="bfloat16")),
                                ("int8", np.int8, dict(kv_cache_dtype="int8")),
                                ("fp8 e4m3", ml_dtypes.float8_e4m3fn,
                                 dict(kv_cache_dtype="fp8"))]:
        per_block = kv_cache_bytes_per_block(big.num_layers, 16, big.num_kv_heads,
                                             big.head_dim, dtype)
        tokens, engine = generate(model, prompts, params, **config)
        prefix, overall = agreement(reference, tokens)
        rows.append({"kv_cache": name, "llama3_8b_block_bytes": per_block,
                     "llama3_8b_blocks_in_budget": budget // per_block,
                     "demo_block_bytes": engine.bytes_per_block,
                     "greedy_agreement_until_first_flip": prefix,
                     "greedy_agreement_all_positions": overall})
    write_results("kv_int8", "int8 KV cache: capacity and agreement with f32", rows,
                  vars(args), notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
