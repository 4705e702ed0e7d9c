"""gpt-oss and DeepSeek (latent attention): memory and decode step time against the same models
with plain KV and a dense model of the same active size.

Capacity (computed from the layouts the engine builds: pagedjax.tools.capacity_commands'
capacity_layouts, no model run), bf16 KV, block 16, a 16 GiB pool on one device, 32k-token
sequences, prefill chunks of 2,048 tokens: KV bytes a token and a sequence, and the sequences
the pool holds, for gpt-oss-20b and -120b on their KV cache groups (the sliding layers keep
their 128-token window and a chunk) against every layer keeping the whole context; with the
weights a device holds, bf16 against the MXFP4 experts the checkpoints ship. DeepSeek-V2-Lite
and V3 on their latent cache (kv_lora_rank + qk_rope_head_dim = 576 values a token a layer, one
plane) against the same models caching every head's expanded K and V (MHA, V padded to the
key's 192 dims: what an engine without latent attention holds) and against a GQA cache of 8 KV
heads of 128 (a Llama-3-70B-like layout at the same depth).

Run (this machine, every model in the same run): a gpt-oss-shaped model scaled down to the CPU
(4 layers alternating 128-token windows and full attention, sinks, 8 experts of which 2 a token,
biases, the clamped SwiGLU; random weights) and a DeepSeek-V2-Lite-shaped one (4 layers of
latent attention with V2-Lite's ratios, a latent of 128 and a RoPE key of 16, the first layer
dense, 8 experts of which 2 a token and a shared one) against a dense Llama of about the same
active size (within 3% of both) (its MLP as wide as the 2 experts a
token together, no sinks, no windows): p50/p95/p99 of a decode step (engine.step(), one token a
sequence, after every prompt is in) at growing context, and the KV each sequence holds.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import percentiles, recorded_args, timed_decode, write_results

from pagedjax.models import get_config, init_model
from pagedjax.models.config import LlamaConfig
from pagedjax.parallel.sharding import weight_bytes_per_device
from pagedjax.tools.capacity_commands import capacity_layouts, kv_capacity

CAPACITY_MODELS = ("gpt-oss-20b", "gpt-oss-120b", "deepseek-v2-lite", "deepseek-v3")
CHUNK = 2048


def capacity_rows(pool_gib: float, block_size: int, context: int) -> list[dict]:
    rows = []
    for name in CAPACITY_MODELS:
        config = get_config(name)
        layouts = plain_layouts(config, block_size)
        both = {label: kv_capacity(layout_config, layout, block_size, int(pool_gib * 2**30),
                                   context, max_tokens_per_step=CHUNK)
                for label, (layout_config, layout) in layouts.items()}
        mxfp4 = config.expert_layout == "interleaved"  # (gpt-oss ships MXFP4 experts)
        rows.append({
            "model": name, "context": context,
            "kv_bytes_per_token_every_layer": config.kv_bytes_per_token(2),
            **{f"mib_per_seq_{label}": round(row["kv_bytes_per_seq"] / 2**20, 1)
               for label, row in both.items()},
            **{f"seqs_{label}": row["sequences"] for label, row in both.items()},
            "seqs_ratio": round(both["served"]["sequences"]
                                / max(1, both["plain_kv"]["sequences"]), 2),
            "weights_gib_bf16": round(weight_bytes_per_device(config, 1, 2) / 2**30, 2),
            "weights_gib_mxfp4": round(weight_bytes_per_device(config, 1, 2, "mxfp4") / 2**30,
                                       2) if mxfp4 else None})
    return rows


def plain_layouts(config: LlamaConfig, block_size: int) -> dict:
    """label -> (the config its blocks are counted by, its KV cache groups): as served, with
    plain KV (every layer the whole context; a latent model's heads expanded, MHA) and, for a
    latent model, a GQA cache of 8 KV heads of 128."""
    groups, full = capacity_layouts(config, block_size)
    if not config.kv_lora_rank:
        return {"served": (config, groups), "plain_kv": (config, full)}
    expanded = dataclasses.replace(config, kv_lora_rank=0, num_kv_heads=config.num_heads)
    gqa = dataclasses.replace(config, kv_lora_rank=0, num_kv_heads=8, head_dim=128,
                              qk_nope_head_dim=64)
    return {"served": (config, groups), "plain_kv": (expanded, full), "gqa8x128": (gqa, full)}


def small_models() -> dict[str, LlamaConfig]:
    gpt_oss = dataclasses.replace(
        get_config("gpt-oss-20b"), vocab_size=4096, hidden_size=256, intermediate_size=256,
        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=16384,
        layer_types=("sliding_attention", "full_attention") * 2)
    dense = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=2 * 256,
                        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                        attention_bias=True, o_proj_bias=True, max_position_embeddings=16384)
    # V2-Lite's ratios (latent 4 x the no-RoPE dims, RoPE half of them) at the CPU's scale
    deepseek = dataclasses.replace(
        get_config("deepseek-v2-lite"), vocab_size=4096, hidden_size=256, intermediate_size=768,
        num_layers=4, num_heads=8, head_dim=48, kv_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=160, shared_expert_intermediate_size=160,
        mlp_types=("dense",) + ("sparse",) * 3, max_position_embeddings=16384)
    return {"gpt-oss-shaped": gpt_oss, "deepseek-v2-lite-shaped": deepseek,
            "dense, same active size": dense}


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
    write_results("new_architectures", "gpt-oss and DeepSeek: memory and decode step time "
                  "against plain KV and a dense model of the same active size", rows, recorded_args(args),
                  __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
