"""New weights for a running engine (issue 52): `LLM.update_weights` in place against building a
new engine from a checkpoint of the same weights, SmolLM2-135M's shapes (30 layers, random
weights, float32) and, with --big, Llama-3.2-1B's (bfloat16), on this CPU.

Per model, one process:
- in_place_s: `llm.update_weights(model)` (checks, then each served leaf written in place by a
  small program that takes the old leaf donated), the engine warm (its step programs compiled by
  a first generate); update_compiles: the programs that first update compiled (one a kind of
  leaf); steady_compiles: those the next updates compiled (0); steady_update_s: the best of the next three updates (an RL loop's case),
  steady_speedup: new_engine_s over it; by_name_s: the best of two updates by Hugging Face name
  (`hf_state_dict(model)`: every tensor in HF's layout, transposed back as written);
- sleep_wake_s: `llm.sleep(1)` then `llm.wake_up()` (weights to host memory and back, the KV
  pool dropped and zeroed again); freed_asleep_gib: device memory (JAX's live arrays) freed
  while asleep, of engine_gib (the engine's weights and KV pool; the embedding, norm and head
  alias the caller's model there, which keeps them);
- step_compiles: step programs compiled from the first update through a second generate of the
  same prompts (0: the programs take the new leaves as they are);
- new_engine_s: `LLM(checkpoint_dir)` (an orbax checkpoint of the same weights, read into
  place) and the same generate, compiled programs served by JAX's persistent compilation cache
  (this process filled it: the best case for a restart);
- speedup: new_engine_s / in_place_s;
- weights_gib: the engine's weights; peak_extra_gib: the most device memory (JAX's live arrays,
  sampled every millisecond by a thread) held during the first update beyond the engine's
  weights and the new model's (the caller's copy): the leaf in flight (the first update copies
  the leaves the engine still shares with the model it was built from: the embedding here);
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
from pagedjax.engine.runner import num_step_compiles
from pagedjax.models import get_config, init_model
from pagedjax.models.loading.checkpoint import save_checkpoint
from pagedjax.models.loading.names import hf_state_dict

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
    compiles, step_compiles = COMPILES[0], num_step_compiles()
    start = time.perf_counter()
    llm.update_weights(new, version="next")
    in_place = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    compiles = COMPILES[0] - compiles
    got = llm.generate(prompts, greedy, use_tqdm=False)
    step_compiles = num_step_compiles() - step_compiles
    steady, by_name, before_steady = [], [], COMPILES[0]
    for model in (old, new, old, new):  # later updates: their programs are compiled
        start = time.perf_counter()
        llm.update_weights(model)
        steady.append(time.perf_counter() - start)
    steady_compiles = COMPILES[0] - before_steady
    for model in (old, new):
        tensors = hf_state_dict(model)
        start = time.perf_counter()
        llm.update_weights(tensors)
        by_name.append(time.perf_counter() - start)
        del tensors
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
            "in_place_s": round(in_place, 3), "update_compiles": compiles,
            "steady_update_s": round(min(steady[1:]), 3), "by_name_s": round(min(by_name), 3),
            "step_compiles": step_compiles, "steady_compiles": steady_compiles,
            "sleep_wake_s": round(wake, 3),
            "freed_asleep_gib": round((awake - asleep) / GIB, 3),
            "engine_gib": round(engine_bytes / GIB, 3),
            "new_engine_s": round(new_engine, 2), "speedup": round(new_engine / in_place, 1),
            "steady_speedup": round(new_engine / min(steady[1:]), 1),
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
                        "model: the leaf in flight (the first update copies the embedding the "
                        "engine shared with the model it was built from). update_compiles: the "
                        "first update's writing programs (none later); step_compiles: 0.",
                  reproduce=".venv/bin/python benchmarks/weight_update.py --big")


if __name__ == "__main__":
    main()
