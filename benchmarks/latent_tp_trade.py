"""DeepSeek under tensor parallelism: the latent cache replicated on every chip (what pagedjax
serves) against data-parallel attention (SGLang's --enable-dp-attention), from the formulas
the engine sizes its pool by (no model run, nothing compiled).

Latent attention has one KV "head", so splitting the query heads over TP chips leaves each chip
a whole copy of every sequence's latent: the slice holds the sequences one chip's pool holds.
Data-parallel attention instead gives each chip its own sequences (the slice holds TP times
as many) and pays with the attention's weights whole on every chip (q/kv down- and
up-projections and o_proj, not split) and with an all-gather of the step's hidden states into
the experts (and a scatter back) each layer, which this table does not price.

Each chip's pool is what 90% of its HBM leaves past its weights and 1 GiB for temporaries (the
TPU tables' rule, benchmarks/tpu_tensor_parallel.py), bf16 KV on the TPU layout (the latent row
padded to 640 lanes), block 16, 32k-token sequences.
"""

from __future__ import annotations

import argparse

from common import recorded_args, write_results

from pagedjax.models import get_config
from pagedjax.models.param_count import mla_params
from pagedjax.parallel.sharding import weight_bytes_per_device
from pagedjax.tools.capacity_commands import capacity_layouts, kv_capacity

TEMP_GIB = 1.0
# (model, weights, chips, HBM GiB a chip): V2-Lite on a v5e-8 slice, V3 (fp8 weights, as it
# ships) on 8 H200s
CASES = [("deepseek-v2-lite", None, 8, 16.0, "v5e-8"), ("deepseek-v2-lite", None, 4, 16.0, "v5e-4"),
         ("deepseek-v3", "fp8", 8, 141.0, "8x H200")]


def trade_row(name, quantization, tp, hbm_gib, slice_name, block_size, context) -> dict:
    config = get_config(name)
    groups, _ = capacity_layouts(config, block_size)
    weights = weight_bytes_per_device(config, tp, 2, quantization)
    itemsize = 1 if quantization else 2  # the attention's stored bytes a parameter (+ scales)
    attention = mla_params(config) * config.num_attention_layers * itemsize
    dp_weights = weights + attention * (tp - 1) // tp  # split over TP -> whole on every chip
    row = {"model": name, "weights": quantization or "bf16", "slice": slice_name, "tp": tp,
           "context": context, "attention_weights_gib": round(attention / 2**30, 2)}
    for label, chip_weights, heads_tp, replicas in (("replicated", weights, tp, 1),
                                                    ("dp_attention", dp_weights, 1, tp)):
        pool = 0.9 * hbm_gib * 2**30 - chip_weights - TEMP_GIB * 2**30
        capacity = kv_capacity(config, groups, block_size, max(0, int(pool)), context, heads_tp,
                               2, 2048, "tpu")
        row[f"weights_gib_{label}"] = round(chip_weights / 2**30, 2)
        row[f"pool_gib_{label}"] = round(max(0.0, pool) / 2**30, 2)
        row[f"seqs_{label}"] = capacity["sequences"] * replicas
    row["seqs_ratio"] = round(row["seqs_dp_attention"] / max(1, row["seqs_replicated"]), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    rows = [trade_row(*case, args.block_size, args.context) for case in CASES]
    for row in rows:
        print(row)
    write_results("latent_tp_trade", "DeepSeek under TP: the latent cache replicated against "
                  "data-parallel attention (computed)", rows, recorded_args(args),
                  __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
