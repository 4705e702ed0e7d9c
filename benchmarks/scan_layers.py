"""Steady-state decode step: layers under one lax.scan vs unrolled, at 4 and 30 layers.

The same decode plan (--batch sequences of --context tokens, distinct blocks) runs on two
runners of the same model, one with the layers scanned (the default) and one unrolled, measured
round-robin in a shuffled order each round (donation.interleaved_medians) so drift spreads
evenly. Models: the embedded checkpoint (4 layers) and SmolLM2-135M's shapes (30 layers, random
weights). The step is the runner's whole step (model, KV write, attention, sampler), after its
program is compiled. scan_vs_unrolled: the scanned step's median over the unrolled one's.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import write_results
from donation import decode_plan, interleaved_medians

from pagedjax import load_model
from pagedjax.engine.runner import ModelRunner
from pagedjax.models import CONFIGS, DEFAULT_CHECKPOINT, init_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    models = {"embedded (4 layers)": load_model(DEFAULT_CHECKPOINT),
              "smollm2-135m shapes (30 layers)": init_model(CONFIGS["smollm2-135m"])}
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
                         "scan_vs_unrolled": round(medians[0] / medians[1], 3)})
            print(rows[-1], flush=True)
    write_results("scan_layers", "Decode step: layers scanned vs unrolled", rows, vars(args),
                  __doc__.split("\n\n", 1)[1])


def interleaved_medians_donated(runners, plan, iters: int) -> list[float]:
    """donation.interleaved_medians, donated steps only: one median per runner."""
    medians = interleaved_medians(runners, plan, iters, donate_options=(True,))
    return [medians[(i, True)] for i in range(len(runners))]


if __name__ == "__main__":
    main()
