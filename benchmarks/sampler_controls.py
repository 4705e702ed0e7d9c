"""The sampler's cost with vLLM's controls (min_p, logit_bias), batch 32, against the sampler
without them in the same run.

Each row times the jitted `pagedjax.engine.sampler.sample` on f32[B, V] logits (the model is
not run: this is the step's sampling part alone): "baseline" is the sampler as it was before the
controls (no min_p, no logit_bias arguments); "controls off" is what every engine step now runs
when no request uses them (min_p 0, 64 empty bias slots a row); "controls on" has every row
using min_p 0.05 and 64 biased tokens. Greedy rows take argmax only; sampled rows sort (top-k /
top-p). p50/p95/p99 over the timed calls, after a compile and warm-up call; ratio_vs_baseline
is the p50 over the baseline's p50 of the same mode.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import write_results

from pagedjax.engine.sampler import sample
from pagedjax.scheduler.request import MAX_LOGIT_BIAS


def timed(fn, args, calls: int) -> np.ndarray:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return np.asarray(seconds)


def variants(batch: int, vocab: int, rng):
    off = (jnp.zeros(batch, jnp.float32), (jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.int32),
                                           jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.float32)))
    on = (jnp.full(batch, 0.05, jnp.float32),
          (jnp.asarray(rng.integers(0, vocab, (batch, MAX_LOGIT_BIAS)), jnp.int32),
           jnp.asarray(rng.normal(size=(batch, MAX_LOGIT_BIAS)), jnp.float32)))
    return {"baseline": None, "controls off": off, "controls on": on}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    batch = args.batch
    logits = jnp.asarray(rng.normal(size=(batch, args.vocab)), jnp.float32)
    common = (jnp.full(batch, -1, jnp.int32), jnp.full(batch, 0.95, jnp.float32),
              jnp.arange(batch, dtype=jnp.uint32), jnp.zeros(batch, jnp.int32))
    rows = []
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        temps = jnp.full(batch, temperature, jnp.float32)
        base_p50 = None
        for name, controls in variants(batch, args.vocab, rng).items():
            if controls is None:
                fn = jax.jit(lambda lg, t, k, p, s, pos: sample(lg, t, k, p, s, pos))
                extra = ()
            else:
                fn = jax.jit(lambda lg, t, k, p, s, pos, m, b: sample(
                    lg, t, k, p, s, pos, min_p=m, logit_bias=b))
                extra = controls
            seconds = timed(fn, (logits, temps, *common, *extra), args.calls) * 1e3
            p50, p95, p99 = np.percentile(seconds, [50, 95, 99])
            base_p50 = base_p50 or p50
            rows.append({"mode": mode, "sampler": name, "p50_ms": p50, "p95_ms": p95,
                         "p99_ms": p99, "ratio_vs_baseline": p50 / base_p50})
            print(rows[-1], flush=True)
    write_results("sampler_controls", "The sampler with vLLM's controls (min_p, logit_bias) "
                  "against without them", rows, vars(args), notes=__doc__.split("\n\n", 1)[1],
                  reproduce=".venv/bin/python benchmarks/sampler_controls.py")


if __name__ == "__main__":
    main()
