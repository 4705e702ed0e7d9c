"""Async scheduling against synchronous stepping: decode steps of the same requests, timed end to
end (LLMEngine.step, outputs every step as streaming reads them), both modes in one run.

Each run queues `batch` requests (random prompts, top-k sampling, ignore_eos), steps until
every sequence decodes, then times --steps engine steps. Synchronous: schedule, plan, dispatch,
wait for the device, update. Async (EngineConfig.async_scheduling): the next step is scheduled,
planned and dispatched before this one's results are waited for, so the host's part of a step
overlaps the device's (what it can save is the host share of a synchronous step). Rounds run
sync, async, sync, async, ...; the ratio is async's output tokens/s over sync's of the same
round.

debug-tiny has a host part as large as its device part (an accelerator's case: a fast device
step); smollm2-135m (random weights of its shapes, f32) is matmul-bound on this CPU.
"""

from __future__ import annotations

import argparse
import time

from common import percentiles, write_results
from host_path import decoding_engine

from pagedjax.models import get_config, init_model


def run(model, batch: int, async_scheduling: bool, *, steps: int, prompt_len: int) -> dict:
    engine = decoding_engine(model, batch, steps=steps, prompt_len=prompt_len,
                             async_scheduling=async_scheduling)
    times, tokens = [], 0
    ahead_before = engine.stats.num_ahead_steps
    start = time.perf_counter()
    for _ in range(steps):
        begin = time.perf_counter()
        tokens += sum(len(o.outputs[0].token_ids) > 0 for o in engine.step())
        times.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - start
    ahead = engine.stats.num_ahead_steps - ahead_before  # of the timed steps
    return {"batch": batch, "mode": "async" if async_scheduling else "sync",
            "output_tok_s": round(tokens / elapsed, 1), **percentiles(times, "step"),
            "steps_ahead": ahead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="debug-tiny", help="a models.CONFIGS name")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="async_scheduling",
                        help="the results' file name under benchmarks/results/")
    args = parser.parse_args()
    model = init_model(get_config(args.model))
    rows = []
    for batch in map(int, args.batches.split(",")):
        for round_ in range(args.rounds):
            sync, async_ = (run(model, batch, mode, steps=args.steps,
                                prompt_len=args.prompt_len) for mode in (False, True))
            async_["vs_sync"] = round(async_["output_tok_s"] / sync["output_tok_s"], 3)
            for row in (sync, async_):
                rows.append({"model": args.model, "round": round_, **row})
                print(rows[-1], flush=True)
    write_results(args.name, "Async scheduling vs synchronous stepping (decode steps)", rows,
                  vars(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
