"""Dropless expert computation (models/layers/moe.py): step time of one MoE layer's experts by
implementation, batch 1 to 256 tokens, measured in one run on this machine's backend.

Shapes: Qwen3-30B-A3B's expert count and top-k (128 experts, k = 8) with its expert MLP scaled
down to fit the CPU (D = 1024, F = 384, f32: 1.2 GB of expert weights a layer); the router's
choices are drawn uniformly (a balanced router). Each row: one jitted call of Experts on T
tokens (their T x 8 assignments sorted, through the experts, summed back), best of the repeats
after a warm-up call. Implementations: "segments" (tiles of a group's rows, one loop over the
tiles that exist), "ragged_dot" (lax.ragged_dot, as XLA lowers it on this backend) and "dense"
(every expert on every token: the reference, too slow past 64 tokens to run). The ratio
columns divide by segments' time in the same run. A bound to compare against: the weights the
step must read (the distinct experts its tokens pick) at the measured single-expert rate.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import recorded_args, write_results
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.layers.moe import Experts


def time_call(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--tokens", default="1,4,16,64,256")
    parser.add_argument("--dense-max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=8, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_layers=1, num_heads=8,
                         num_kv_heads=8, num_experts=args.experts,
                         num_experts_per_tok=args.top_k)
    experts = Experts(config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    graph, state = nnx.split(experts)
    rng = np.random.default_rng(0)
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.normal(size=(num_tokens, args.hidden)), jnp.float32)
        ids = np.stack([rng.choice(args.experts, args.top_k, replace=False)
                        for _ in range(num_tokens)]).astype(np.int32)
        weights = jnp.asarray(rng.uniform(size=ids.shape), jnp.float32)
        row = {"tokens": num_tokens, "assignments": num_tokens * args.top_k,
               "experts_picked": len(np.unique(ids))}
        for name in ("segments", "ragged_dot", "dense"):
            if name == "dense" and num_tokens > args.dense_max_tokens:
                continue
            fn = jax.jit(lambda state, x, w, i, name=name: nnx.merge(graph, state)(
                x, w, i, implementation=name))
            row[f"{name}_ms"] = round(1e3 * time_call(fn, state, x, weights, jnp.asarray(ids),
                                                      repeats=args.repeats), 2)
        for name in ("ragged_dot", "dense"):
            if f"{name}_ms" in row:
                row[f"{name}_vs_segments"] = round(row[f"{name}_ms"] / row["segments_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    write_results("moe_experts", "Dropless MoE experts: segments vs ragged_dot vs dense", rows,
                  recorded_args(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
