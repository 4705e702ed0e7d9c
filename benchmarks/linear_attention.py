"""Hybrid linear attention (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers in the KV cache's state
group) against the same model with every layer keeping full KV: memory, and decode step time.

Capacity (computed from the layouts the engine builds: pagedjax.tools.capacity_commands'
capacity_layouts, no model run): Qwen3.5-9B's shapes (transformers' Qwen3_5TextConfig defaults:
24 Gated DeltaNet and 8 full-attention layers) on one device and Qwen3-Next-80B-A3B's (36 and
12) at TP 4, bf16 KV, block 16, a 16 GiB pool a device, at 4k / 32k / 128k tokens: the MiB a
sequence holds and the sequences the pool holds, with the state group (each linear layer's
state a fixed number of blocks a sequence) against every layer keeping the whole context.

Run (measured on this machine, both models in the same run): a Qwen3.5-shaped model scaled
down to the CPU (8 layers: 6 linear, 2 full; random weights) and the same config with every
layer full attention decode a batch of sequences at growing context: p50/p95/p99 of a decode
step (engine.step(), one token a sequence, after every prompt is in), and the KV bytes each
sequence holds (its blocks in every group times the block's bytes).
"""

from __future__ import annotations

import argparse
import dataclasses

from common import percentiles, recorded_args, timed_decode, write_results

from pagedjax.models import get_config, init_model
from pagedjax.tools.capacity_commands import capacity_layouts, kv_capacity

SHAPES = {"qwen3.5-9b": 1, "qwen3-next-80b-a3b": 4}  # name -> TP


def capacity_rows(pool_gib: float, block_size: int) -> list[dict]:
    rows = []
    for name, tp in SHAPES.items():
        config = get_config(name)
        groups, full = capacity_layouts(config, block_size, tp)
        for context in (4096, 32768, 131072):
            both = {label: kv_capacity(config, layout, block_size, int(pool_gib * 2**30),
                                       context, tp, 2)
                    for label, layout in (("state", groups), ("full", full))}
            rows.append({
                "model": name, "tp": tp, "context": context,
                "mib_per_seq_state_group": round(both["state"]["kv_bytes_per_seq"] / 2**20, 1),
                "mib_per_seq_every_layer_kv": round(both["full"]["kv_bytes_per_seq"] / 2**20, 1),
                "seqs_state_group": both["state"]["sequences"],
                "seqs_every_layer_kv": both["full"]["sequences"],
                "seqs_ratio": round(both["state"]["sequences"]
                                    / max(1, both["full"]["sequences"]), 2)})
    return rows


def small_qwen3_5(linear: bool):
    config = get_config("qwen3.5-9b")
    types = tuple("full_attention" if (i + 1) % 4 == 0 or not linear else "linear_attention"
                  for i in range(8))
    return dataclasses.replace(
        config, vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=8,
        num_heads=4, num_kv_heads=2, head_dim=64, layer_types=types, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        max_position_embeddings=16384)


def run_rows(args) -> list[dict]:
    rows = []
    for context in args.contexts:
        for label, linear in (("every layer full", False), ("state group", True)):
            model = init_model(small_qwen3_5(linear), seed=0)
            bytes_per_seq, times = timed_decode(model, context=context, batch=args.batch,
                                                steps=args.steps)
            rows.append({"context": context, "model": label, "batch": args.batch,
                         "kv_mib_per_seq": round(bytes_per_seq / 2**20, 3),
                         **percentiles(times[2:], "decode_step")})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=16.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed a context")
    args = parser.parse_args()
    rows = capacity_rows(args.pool_gib, args.block_size)
    for row in rows:
        print(row)
    rows += run_rows(args)
    write_results("linear_attention", "Hybrid linear attention (Qwen3.5-shaped): memory and "
                  "decode step time against every layer keeping KV", rows, recorded_args(args),
                  __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
