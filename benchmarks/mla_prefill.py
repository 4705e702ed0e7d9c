"""Multi-head latent attention's prefill: the absorbed form (MQA over the latent) against the
expanded one (every head's keys and values up-projected, plain attention:
pagedjax.models.layers.mla_expanded), on this machine, in the same run.

A DeepSeek-V2-Lite-shaped model at the CPU's scale (benchmarks/new_architectures.py's: 4 layers,
8 heads, a latent of 128, no-RoPE and value dims of 32, a RoPE key of 16; random weights) on the
jnp reference backend: p50/p95/p99 of a prefill step (engine.step() with `batch` fresh prompts of
`length` tokens, one step, no prefix caching) at growing prompt lengths, each form forced with
--mla-prefill; `per_crossover` is length over mla_expanded.crossover_tokens of this shape (the
multiply-add crossover: 85 tokens here, 341 at DeepSeek's own dims).

What it found (2026-12-05, the rows below): on the jnp reference the absorbed form is ahead at
13 of the 14 shapes (not at 32 tokens of one sequence), 1.7-1.85x from 512 tokens up: the reference gathers every query token's pages, so its
cost follows the bytes gathered (the latent's 144 values a key against 8 heads x 96), not the
multiply-adds. "auto" therefore keeps the absorbed form on the reference and takes the
multiply-add crossover on the Pallas kernels (mla_expanded.EXPANDED_AUTO_BACKENDS), whose
prefill reads each page once a tile: `--attention-backend gpu` / `tpu` on a device measures
them, and mla_expanded.MEASURED_CROSSOVER is to be set from that run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import percentiles, recorded_args, write_results
from new_architectures import small_models

from pagedjax.models import init_model
from pagedjax.models.layers.mla_expanded import crossover_tokens


def prefill_times(model, form: str, length: int, batch: int, repeats: int,
                  backend: str) -> list[float]:
    """Seconds of each of `repeats` prefill steps (after one to compile)."""
    from pagedjax import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(model, EngineConfig(
        block_size=16, max_model_len=length + 16, max_num_seqs=batch, min_seq_bucket=batch,
        max_num_batched_tokens=batch * length, enable_prefix_caching=False, mla_prefill=form,
        attention_backend=backend,
        num_blocks=batch * (length // 16 + 2) + 1))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):
        for _ in range(batch):
            engine.add_request(rng.integers(0, 4096, length).tolist(), params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--attention-backend", default="reference",
                        help="reference here; gpu or tpu on a device (the Pallas kernels, where "
                        "mla_expanded.MEASURED_CROSSOVER is to be set from)")
    args = parser.parse_args()
    config = small_models()["deepseek-v2-lite-shaped"]
    model = init_model(config, seed=0)
    cross = crossover_tokens(config.kv_lora_rank, config.qk_nope_head_dim,
                             config.qk_rope_head_dim, config.v_head_dim)
    rows = []
    for batch in args.batches:
        for length in args.lengths:
            times = {form: prefill_times(model, form, length, batch, args.repeats,
                                         args.attention_backend)
                     for form in ("absorbed", "expanded")}
            row = {"batch": batch, "length": length,
                   "per_crossover": round(length / cross, 2)}
            for form, values in times.items():
                row.update(percentiles(values, form))
            row["expanded_over_absorbed_p50"] = round(
                row["expanded_p50_ms"] / row["absorbed_p50_ms"], 3)
            rows.append(row)
            print(row, flush=True)
    write_results("mla_prefill", "Latent attention's prefill: absorbed against expanded "
                  "(CPU, jnp reference)", rows, recorded_args(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
