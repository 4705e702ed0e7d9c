"""gpt-oss (and, with issue 55's second part, DeepSeek's latent attention): memory and decode step
time against the same models with plain KV and a dense model of the same active size.

Capacity (computed from the layouts the engine builds: pagedjax.tools.plan_commands'
capacity_layouts, no model run), bf16 KV, block 16, a 16 GiB pool on one device, 32k-token
sequences, prefill chunks of 2,048 tokens: KV bytes a token and a sequence, and the sequences
the pool holds, for gpt-oss-20b and -120b on their KV cache groups (the sliding layers keep
their 128-token window and a chunk) against every layer keeping the whole context; with the
weights a device holds, bf16 against the MXFP4 experts the checkpoints ship.

Run (this machine, every model in the same run): a gpt-oss-shaped model scaled down to the CPU
(4 layers alternating 128-token windows and full attention, sinks, 8 experts of which 2 a token,
biases, the clamped SwiGLU; random weights) against a dense Llama of the same active size (its
MLP as wide as the 2 experts a token together, no sinks, no windows): p50/p95/p99 of a decode
step (engine.step(), one token a sequence, after every prompt is in) at growing context, and the
KV each sequence holds.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import percentiles, recorded_args, timed_decode, write_results

from pagedjax.models import get_config, init_model
from pagedjax.models.config import LlamaConfig
from pagedjax.parallel.sharding import weight_bytes_per_device
from pagedjax.tools.plan_commands import capacity_layouts, kv_capacity

CAPACITY_MODELS = ("gpt-oss-20b", "gpt-oss-120b")
CHUNK = 2048


def capacity_rows(pool_gib: float, block_size: int, context: int) -> list[dict]:
    rows = []
    for name in CAPACITY_MODELS:
        config = get_config(name)
        groups, full = capacity_layouts(config, block_size)
        both = {label: kv_capacity(config, layout, block_size, int(pool_gib * 2**30), context,
                                   max_tokens_per_step=CHUNK)
                for label, layout in (("served", groups), ("plain", full))}
        rows.append({
            "model": name, "context": context,
            "kv_bytes_per_token_every_layer": config.kv_bytes_per_token(2),
            "mib_per_seq_served": round(both["served"]["kv_bytes_per_seq"] / 2**20, 1),
            "mib_per_seq_plain_kv": round(both["plain"]["kv_bytes_per_seq"] / 2**20, 1),
            "seqs_served": both["served"]["sequences"],
            "seqs_plain_kv": both["plain"]["sequences"],
            "seqs_ratio": round(both["served"]["sequences"]
                                / max(1, both["plain"]["sequences"]), 2),
            "weights_gib_bf16": round(weight_bytes_per_device(config, 1, 2) / 2**30, 2),
            "weights_gib_mxfp4": round(weight_bytes_per_device(config, 1, 2, "mxfp4") / 2**30,
                                       2)})
    return rows


def small_models() -> dict[str, LlamaConfig]:
    gpt_oss = dataclasses.replace(
        get_config("gpt-oss-20b"), vocab_size=4096, hidden_size=256, intermediate_size=256,
        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=16384,
        layer_types=("sliding_attention", "full_attention") * 2)
    dense = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=2 * 256,
                        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                        attention_bias=True, o_proj_bias=True, max_position_embeddings=16384)
    return {"gpt-oss-shaped": gpt_oss, "dense, same active size": dense}


def run_rows(args) -> list[dict]:
    rows = []
    for context in args.contexts:
        for label, config in small_models().items():
            bytes_per_seq, times = timed_decode(init_model(config, seed=0), context=context,
                                                batch=args.batch, steps=args.steps)
            rows.append({"context": context, "model": label, "batch": args.batch,
                         "active_params": config.num_active_params,
                         "kv_mib_per_seq": round(bytes_per_seq / 2**20, 3),
                         **percentiles(times[2:], "decode_step")})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=16.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768, help="the capacity rows'")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed a context")
    args = parser.parse_args()
    rows = capacity_rows(args.pool_gib, args.block_size, args.context)
    for row in rows:
        print(row)
    rows += run_rows(args)
    write_results("new_architectures", "gpt-oss: memory and decode step time against plain KV "
                  "and a dense model of the same active size", rows, recorded_args(args),
                  __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
