"""Multi-LoRA serving (issue 53): decode throughput with 1, 4 and 16 distinct rank-16 adapters
mixed in a batch of 32 against the base model alone, and the time an adapter takes to load, on
this CPU, SmolLM2-135M's shapes (30 layers, random weights, float32).

Rows, one engine each (the same random base model), 32 requests of 16 prompt tokens decoding
--max-tokens tokens each, all admitted at once (one prefill step, then decode steps of 32 rows):
- base: an engine without LoRA (the baseline, measured in the same run);
- lora_k: an engine with enable_lora (max_loras 16, max_lora_rank 16), request i under adapter
  i % k (k = 0: every request on the base model, the slots' cost alone); every adapter targets
  all seven projections of every layer at rank 16.
decode_step_p50/p95/p99_ms: the engine's decode steps (LLMEngine.step, host work included), after
a first identical run compiled every program; decode_tok_s: 32 rows / the p50 step;
vs_base: decode_tok_s over base's.

Load rows (the lora engine, 16 adapters not yet read): from_disk_ms: LLMEngine.add_lora (the
PEFT directory read and checked, its host arrays padded to rank 16) plus the write into a slot;
from_host_ms: the write into a slot of an adapter already read (runner.write_lora_slot, waited
for); p50 over the 16.

    .venv/bin/python benchmarks/lora.py [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import jax
import numpy as np
from common import percentiles, write_results

from pagedjax import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from pagedjax.lora.peft_adapter import TARGETS, random_adapter, save_peft_adapter
from pagedjax.models import get_config, init_model

BATCH, PROMPT_LEN, RANK, MAX_LORAS = 32, 16, 16, 16


def write_adapter(directory: pathlib.Path, config, seed: int) -> str:
    """A random rank-16 PEFT adapter of all seven projections (what save_pretrained writes)."""
    return save_peft_adapter(random_adapter(config, RANK, sorted(TARGETS), seed, std=0.02),
                             str(directory))


def decode_steps(engine: LLMEngine, loras: list, max_tokens: int) -> list[float]:
    """The decode steps' times of one batch (request i under loras[i % len] or the base)."""
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(rng.integers(0, 1000, PROMPT_LEN).tolist(), params,
                           lora_request=loras[i % len(loras)] if loras else None)
    times = []
    for _ in range(10 * max_tokens):
        if not engine.has_unfinished():
            break
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.last_schedule.kind == "decode":
            times.append(elapsed)
    return times


def throughput_rows(model, adapters: list, max_tokens: int) -> list[dict]:
    common = dict(max_model_len=128, max_num_seqs=BATCH, max_num_batched_tokens=BATCH * PROMPT_LEN,
                  block_size=16, min_seq_bucket=BATCH, compilation_cache="off")
    rows, base_tok_s = [], None
    cases = [("base", None)] + [(f"lora_{k}", k) for k in (0, 1, 4, 16)]
    for name, k in cases:
        lora = {} if k is None else dict(enable_lora=True, max_loras=MAX_LORAS,
                                         max_lora_rank=RANK)
        engine = LLMEngine(model, EngineConfig(**common, **lora))
        loras = [] if not k else adapters[:k]
        decode_steps(engine, loras, max_tokens)  # compiles, reads the adapters
        times = decode_steps(engine, loras, max_tokens)
        tok_s = BATCH / float(np.percentile(times, 50))
        base_tok_s = base_tok_s or tok_s
        rows.append({"case": name, "adapters": k or 0, "decode_steps": len(times),
                     **percentiles(times, "decode_step"), "decode_tok_s": round(tok_s, 1),
                     "vs_base": round(tok_s / base_tok_s, 3)})
    return rows


def load_row(model, adapters: list) -> dict:
    engine = LLMEngine(model, EngineConfig(max_model_len=128, enable_lora=True,
                                           max_loras=MAX_LORAS, max_lora_rank=RANK,
                                           compilation_cache="off"))
    runner, manager = engine.runner, engine.lora_manager
    disk, host = [], []
    for slot, lora in enumerate(adapters):
        start = time.perf_counter()
        engine.add_lora(lora)
        runner.write_lora_slot(slot, manager.arrays(lora.lora_int_id))
        jax.block_until_ready(runner.lora)
        disk.append(time.perf_counter() - start)
    for slot, lora in enumerate(adapters):
        start = time.perf_counter()
        runner.write_lora_slot(slot, manager.arrays(lora.lora_int_id))
        jax.block_until_ready(runner.lora)
        host.append(time.perf_counter() - start)
    mib = manager.spec.nbytes / MAX_LORAS / 2**20
    return {"adapter_mib": round(mib, 2), "from_disk_ms": round(np.median(disk) * 1e3, 2),
            "from_host_ms": round(np.median(host) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    config = get_config("smollm2-135m")
    model = init_model(config, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(pathlib.Path(tmp) / f"a{i}",
                                                              config, i))
                    for i in range(MAX_LORAS)]
        rows = throughput_rows(model, adapters, args.max_tokens)
        load = load_row(model, adapters)
    notes = (f"Adapter load (p50 of {MAX_LORAS}, rank {RANK}, all seven projections, "
             f"{load['adapter_mib']} MiB in float32): from disk {load['from_disk_ms']} ms, "
             f"from the host cache {load['from_host_ms']} ms.\n\n" + __doc__.split("\n\n", 1)[1])
    write_results("lora", "Multi-LoRA decode throughput, SmolLM2-135M shapes, batch 32 (CPU)",
                  rows, {"max_tokens": args.max_tokens, "batch": BATCH, "rank": RANK,
                         "max_loras": MAX_LORAS, **{f"load_{k}": v for k, v in load.items()}},
                  notes)


if __name__ == "__main__":
    main()
