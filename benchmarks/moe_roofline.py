"""The roofline simulator's decode throughput for a mixture of experts beside a dense model of
the same active size (pagedjax.parallel.plan.roofline_cost; an estimate from the chip's
datasheet peaks, not a measurement).

Qwen3-30B-A3B (128 experts, 8 a token, 3.35B of 30.5B parameters active) and the dense model
that computes the same per token (its MLP 8 x 768 = 6,144 wide, 3.35B parameters), both bf16 on
one H200 with bf16 KV, decode steps of B sequences at 2,048 tokens of context each: the step
time and output tokens/s by B. At small B the mixture reads only the experts its tokens pick
(1 - (1 - 8/128)^B of them, a balanced router), so it starts near the dense model's time; by B
~ 64 it reads every expert (9x the dense model's weights) and is bandwidth-bound on them until
its FLOPs (the same as the dense model's) catch up. ratio: the mixture's tokens/s over the
dense model's, same B.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from common import recorded_args, write_results

from pagedjax.models import get_config
from pagedjax.parallel.plan import roofline_cost
from pagedjax.scheduler import DECODE
from pagedjax.scheduler.chips import CHIPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--chip", default="h200", choices=sorted(CHIPS))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    args = parser.parse_args()
    moe = get_config(args.model)
    dense = dataclasses.replace(moe, num_experts=0, moe_intermediate_size=None,
                                intermediate_size=moe.num_experts_per_tok
                                * moe.expert_intermediate_size, model_type="qwen3")
    costs = {"moe": roofline_cost(moe, CHIPS[args.chip]),
             "dense": roofline_cost(dense, CHIPS[args.chip])}
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        features = np.array([1.0, batch, batch, batch * args.context, batch * args.context])
        row = {"batch": batch}
        for name, cost in costs.items():
            step = cost.predict(DECODE, features)
            row[f"{name}_step_ms"] = round(step * 1e3, 3)
            row[f"{name}_tok_s"] = round(batch / step, 1)
            row[f"{name}_weights_gib"] = round(cost.weights_read(batch) / 2**30, 2)
        row["ratio"] = round(row["moe_tok_s"] / row["dense_tok_s"], 3)
        rows.append(row)
    params = {**recorded_args(args), "moe_params": moe.num_params,
              "moe_active_params": moe.num_active_params, "dense_params": dense.num_params}
    write_results("moe_roofline", f"Roofline decode throughput: {args.model} vs a dense model "
                  f"of its active size on {args.chip}", rows, params,
                  __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
