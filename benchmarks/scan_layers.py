"""Steady-state decode step: layers under one lax.scan vs unrolled, small and large layers.

The same decode plan (--batch sequences of --context tokens, distinct blocks) runs on two
runners of the same model, one with the layers scanned (the default) and one unrolled, measured
round-robin in a shuffled order each round (donation.interleaved_medians) so drift spreads
evenly. Models: the embedded checkpoint (4 layers), SmolLM2-135M's shapes (30 layers, random
weights) and Qwen3-0.6B's layer shapes (4 of its 28 layers, random weights). The step is the runner's whole step (model, KV write, attention, sampler), after its
program is compiled. scan_vs_unrolled: the scanned step's median over the unrolled one's.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from common import write_results
from donation import decode_plan, interleaved_medians

from pagedjax import load_model
from pagedjax.engine.runner import ModelRunner
from pagedjax.models import CONFIGS, DEFAULT_CHECKPOINT, init_model, paged_forward

# Qwen3-0.6B's layers (hidden 1024, MLP 3072, 16 query / 8 KV heads of 128) and vocabulary, 4
# of its 28 layers, as Llama layers (its q/k norms aside, the same weights a layer)
QWEN3_06B_LAYERS = dataclasses.replace(
    CONFIGS["smollm2-135m"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
    num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    models = {"embedded (4 layers)": load_model(DEFAULT_CHECKPOINT),
              "smollm2-135m shapes (30 layers)": init_model(CONFIGS["smollm2-135m"]),
              "qwen3-0.6b layer shapes (4 layers)": init_model(QWEN3_06B_LAYERS)}
    rows = []
    for name, model in models.items():
        for batch in map(int, args.batches.split(",")):
            blocks = batch * -(-args.context // args.block_size)
            table_width = -(-args.context // args.block_size) + 1
            plan = decode_plan(batch, args.context, args.block_size, table_width)
            runners = [ModelRunner(model, num_blocks=1 + blocks, block_size=args.block_size,
                                   dtype=np.float32, scan_layers=scan) for scan in (True, False)]
            medians = interleaved_medians_donated(runners, plan, args.iters)
            rows.append({"model": name, "layers": model.config.num_layers, "batch": batch,
                         "scan_step_ms": round(1e3 * medians[0], 3),
                         "unrolled_step_ms": round(1e3 * medians[1], 3),
                         "scan_vs_unrolled": round(medians[0] / medians[1], 3),
                         "layer_mib": round(paged_forward.layer_bytes(model.layers[0]) / 2**20,
                                            1),
                         "default": "scan" if paged_forward.scan_by_default(
                             model, runners[0].device.platform) else "unrolled"})
            print(rows[-1], flush=True)
    write_results("scan_layers", "Decode step: layers scanned vs unrolled", rows, vars(args),
                  __doc__.split("\n\n", 1)[1])


def interleaved_medians_donated(runners, plan, iters: int) -> list[float]:
    """donation.interleaved_medians, donated steps only: one median per runner."""
    medians = interleaved_medians(runners, plan, iters, donate_options=(True,))
    return [medians[(i, True)] for i in range(len(runners))]


if __name__ == "__main__":
    main()
