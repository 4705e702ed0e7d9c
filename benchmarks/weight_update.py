"""New weights for a running engine (issue 52): `LLM.update_weights` in place against building a
new engine from a checkpoint of the same weights, SmolLM2-135M's shapes (30 layers, random
weights, float32) and, with --big, Llama-3.2-1B's (bfloat16), on this CPU.

Per model, one process:
- in_place_s: `llm.update_weights(model)` (serving form, checks, placement leaf by leaf), the
  engine warm (its programs compiled by a first generate); steady_update_s: the best of the next
  two updates (the small programs an update itself runs are compiled by then: an RL loop's
  case), steady_speedup: new_engine_s over it;
- sleep_wake_s: `llm.sleep(1)` then `llm.wake_up()` (weights to host memory and back, the KV
  pool dropped and zeroed again); freed_asleep_gib: device memory (JAX's live arrays) freed
  while asleep, of engine_gib (the engine's weights and KV pool; the embedding, norm and head
  alias the caller's model there, which keeps them);
- compiles_after_update: XLA backend compiles from the update through a second generate of the
  same prompts (0: the programs take the new leaves as they are);
- new_engine_s: `LLM(checkpoint_dir)` (an orbax checkpoint of the same weights, read into
  place) and the same generate, compiled programs served by JAX's persistent compilation cache
  (this process filled it: the best case for a restart);
- speedup: new_engine_s / in_place_s;
- weights_gib: the engine's weights; peak_extra_gib: the most device memory (JAX's live arrays,
  sampled every millisecond by a thread) held during the update beyond the engine's weights and
  the new model's (the caller's copy): the serving form's transients (the stacked layers) and the
  leaf in flight;
- outputs_equal: the updated engine's greedy tokens equal the new engine's.

    .venv/bin/python benchmarks/weight_update.py [--big]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
from common import write_results
from jax import monitoring

from pagedjax import LLM, SamplingParams
from pagedjax.models import get_config, init_model
from pagedjax.models.loading.checkpoint import save_checkpoint

COMPILES = [0]
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: COMPILES.__setitem__(0, COMPILES[0] + 1)
    if event == "/jax/core/compile/backend_compile_duration" else None)
GIB = 1 << 30


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


class PeakSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, live_bytes())
            time.sleep(0.001)


def measure(name: str, dtype: str) -> dict:
    compute = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    config = get_config(name)
    old = init_model(config, seed=0, dtype=compute, param_dtype=compute)
    new = init_model(config, seed=1, dtype=compute, param_dtype=compute)
    engine_args = dict(tokenizer="byte", dtype=dtype, max_model_len=256, max_num_seqs=4,
                       max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)
    prompts = [{"prompt_token_ids": list(range(5 + i, 37 + i))} for i in range(4)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(old, **engine_args)
    llm.generate(prompts, greedy, use_tqdm=False)
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(llm.engine.runner.params))
    baseline = live_bytes()
    sampler = PeakSampler()
    sampler.start()
    compiles = COMPILES[0]
    start = time.perf_counter()
    llm.update_weights(new, version="next")
    in_place = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    got = llm.generate(prompts, greedy, use_tqdm=False)
    compiles = COMPILES[0] - compiles
    steady = []
    for model in (old, new):  # later updates: the small programs they use are compiled
        start = time.perf_counter()
        llm.update_weights(model)
        steady.append(time.perf_counter() - start)
    awake = live_bytes()
    start = time.perf_counter()
    llm.sleep(1)
    asleep = live_bytes()
    llm.wake_up()
    wake = time.perf_counter() - start
    engine_bytes = weights + sum(leaf.nbytes for leaf in jax.tree.leaves(
        llm.engine.runner.kv_cache))
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(new, directory)
        del llm
        start = time.perf_counter()
        fresh = LLM(directory, **engine_args)
        expected = fresh.generate(prompts, greedy, use_tqdm=False)
        new_engine = time.perf_counter() - start
    return {"model": name, "dtype": dtype, "weights_gib": round(weights / GIB, 3),
            "in_place_s": round(in_place, 3), "steady_update_s": round(min(steady), 3),
            "compiles_after_update": compiles,
            "sleep_wake_s": round(wake, 3),
            "freed_asleep_gib": round((awake - asleep) / GIB, 3),
            "engine_gib": round(engine_bytes / GIB, 3),
            "new_engine_s": round(new_engine, 2), "speedup": round(new_engine / in_place, 1),
            "steady_speedup": round(new_engine / min(steady), 1),
            "peak_extra_gib": round(max(0, sampler.peak - baseline) / GIB, 3),
            "outputs_equal": [o.outputs[0].token_ids for o in got]
            == [o.outputs[0].token_ids for o in expected]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also Llama-3.2-1B's shapes, bf16")
    args = parser.parse_args()
    rows = [measure("smollm2-135m", "float32")]
    if args.big:
        rows.append(measure("llama-3.2-1b", "bfloat16"))
    write_results("weight_update", "update_weights in place vs a new engine from a checkpoint",
                  rows, {"big": args.big},
                  notes="peak_extra_gib is beyond the engine's weights and the caller's new "
                        "model: the serving form's stacked layers (a transient copy of the "
                        "layers' weights) and the leaf in flight.",
                  reproduce=".venv/bin/python benchmarks/weight_update.py --big")


if __name__ == "__main__":
    main()
