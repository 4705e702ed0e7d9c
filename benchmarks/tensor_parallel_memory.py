"""What one device holds under tensor parallelism: weights + KV pool at TP 1/2/4/8, measured on
the engine's real arrays (8 CPU devices), and the concurrent sequences a replica serves for a
fixed per-device budget.

Two tables in one run:
1. measured: a 4-layer Llama (hidden 1024, 16 query / 8 KV heads, vocab 32000, f32) built by
   the engine at each TP with kv_cache_memory_bytes = the same per-device budget; device 0's
   bytes of weights and KV summed from its addressable shards, against `pagedjax capacity`'s
   formulas (pagedjax.parallel.sharding) and against TP 1;
2. planned: Llama-3-8B (bf16) on a 16 GiB chip (v5e) and an 80 GiB GPU from the same formulas:
   the weights a device holds, the KV pool left under a 90% memory utilisation, and the 8k-token
   sequences that pool holds per replica (TP 1 on 16 GiB holds none: the weights alone exceed
   the chip). The TPU AOT table (benchmarks/tpu_tensor_parallel.py) checks the same per-device
   weights against libtpu's compiled memory analysis.

CPU devices share one host's memory and cores: these are bytes, not speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from common import ROOT, write_results

DEVICES = 8
BUDGET = 32 * 2**20  # KV bytes a device may hold
MAX_MODEL_LEN = 1024
CHILD = textwrap.dedent('''
    import json, sys
    import jax
    import numpy as np
    from pagedjax.models import LlamaConfig, init_model
    from pagedjax import LLMEngine, EngineConfig
    from pagedjax.parallel.sharding import kv_bytes_per_block_per_device, weight_bytes_per_device
    args = json.loads(sys.argv[1])
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_layers=4, num_heads=16, num_kv_heads=8, max_position_embeddings=4096)
    model = init_model(config, seed=0)
    rows = []
    for tp in (1, 2, 4, 8):
        engine = LLMEngine(model, EngineConfig(
            tensor_parallel_size=tp, kv_cache_memory_bytes=args["budget"], block_size=16,
            max_model_len=args["max_model_len"], compilation_cache="off"))
        runner = engine.runner
        def device0(tree):
            return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
                       for s in leaf.addressable_shards if s.device == jax.devices()[0])
        blocks_per_seq = -(-args["max_model_len"] // 16)
        rows.append({"tp": tp, "weights_bytes": device0(runner.params),
                     "formula_weights_bytes": weight_bytes_per_device(config, tp, 4),
                     "kv_bytes": device0(runner.kv_cache),
                     "formula_kv_bytes": engine.num_blocks * kv_bytes_per_block_per_device(
                         config, 16, tp, np.float32),
                     "num_blocks": engine.num_blocks,
                     "max_seqs": (engine.num_blocks - 1) // blocks_per_seq})
        del engine, runner
    print(json.dumps(rows))
''')


def measured() -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(
        {"budget": BUDGET, "max_model_len": MAX_MODEL_LEN})], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=1200)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    one = rows[0]["weights_bytes"] + rows[0]["kv_bytes"]
    for row in rows:
        total = row["weights_bytes"] + row["kv_bytes"]
        row["device_bytes"] = total
        row["vs_tp1"] = round(total / one, 3)
        row["weights_vs_tp1"] = round(row["weights_bytes"] / rows[0]["weights_bytes"], 3)
        row["formulas_match"] = (row["weights_bytes"] == row["formula_weights_bytes"]
                                 and row["kv_bytes"] == row["formula_kv_bytes"])
        row["max_seqs_vs_tp1"] = round(row["max_seqs"] / max(1, rows[0]["max_seqs"]), 2)
    return rows


def planned() -> list[dict]:
    from pagedjax.models import get_config
    from pagedjax.parallel.sharding import kv_bytes_per_block_per_device, weight_bytes_per_device

    config = get_config("llama-3-8b")
    rows = []
    for chip, hbm in (("v5e (16 GiB)", 16 * 2**30), ("H100 (80 GiB)", 80 * 2**30)):
        for tp in (1, 2, 4, 8):
            weights = weight_bytes_per_device(config, tp, 2)
            kv = max(0, int(0.9 * hbm) - weights)
            blocks = kv // kv_bytes_per_block_per_device(config, 16, tp, "bfloat16")
            rows.append({"chip": chip, "tp": tp, "weights_gib": round(weights / 2**30, 2),
                         "kv_pool_gib": round(kv / 2**30, 2),
                         "seqs_of_8k_tokens": max(0, blocks - 1) // (8192 // 16)})
    return rows


def main() -> None:
    rows = measured()
    params = {"devices": DEVICES, "kv_budget_bytes_per_device": BUDGET,
              "max_model_len": MAX_MODEL_LEN, "block_size": 16, "dtype": "float32",
              "model": "4 layers, hidden 1024, 16 heads / 8 KV heads, vocab 32000"}
    write_results("tensor_parallel_memory", "Per-device bytes under tensor parallelism "
                  "(measured on 8 CPU devices)", rows, params,
                  notes="device_bytes = weights + KV pool on device 0, summed from the engine's "
                  "addressable shards; formula_* from pagedjax.parallel.sharding (what `pagedjax "
                  "capacity --tensor-parallel-size` prints). Replicated: embedding and norms "
                  "(the weights never shrink below them). The per-device KV budget is fixed, so "
                  "the pool's blocks (and sequences a replica holds) grow TP-fold while K >= TP.")
    write_results("tensor_parallel_plan", "Llama-3-8B bf16 per device under tensor "
                  "parallelism (pagedjax.parallel.sharding's formulas, 90% of HBM)", planned(),
                  {"model": "llama-3-8b", "dtype": "bfloat16", "block_size": 16,
                   "memory_utilization": 0.9},
                  reproduce=".venv/bin/python benchmarks/tensor_parallel_memory.py")


if __name__ == "__main__":
    main()
