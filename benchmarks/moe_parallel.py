"""Expert parallel against tensor parallel experts on the 8-device CPU mesh: what XLA makes of
each layout's step, and what a device holds.

A Qwen3-MoE-shaped model scaled to the CPU (4 layers, hidden 512, 16 experts of 256, k 4,
8 query / 4 KV heads, f32, random weights) served by the engine at TP 4 (each expert's MLP
split 4 ways; the MoE layer ends with the all-reduce a dense MLP has) and at EP 4 (4 whole
experts a device, each running its own experts' assignments under shard_map, then one psum of
[T, D]): 8 requests of 128-token prompts and 64 output tokens each, greedy, all queued at once;
decode step times (p50/p95/p99 over the decode steps after the first), the run's output
tokens/s, and device 0's bytes of expert weights. Both layouts must give the same tokens (they
do; checked in the run). TP 1 is the baseline of the ratios.

The 8 CPU "devices" share this machine's 2 cores and one memory: step times show the
collectives' and partitioning's overhead as XLA's CPU backend runs them, not a chip's speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from common import ROOT, write_results

CHILD = textwrap.dedent('''
    import json, sys, time
    import jax
    import numpy as np
    from pagedjax.models import LlamaConfig, init_model
    from pagedjax import EngineConfig, LLMEngine, SamplingParams
    fields = json.loads(sys.argv[1])
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4,
                         num_heads=8, num_kv_heads=4, head_dim=64, num_experts=16,
                         num_experts_per_tok=4, moe_intermediate_size=256, qk_norm=True,
                         max_position_embeddings=1024, model_type="qwen3_moe")
    engine = LLMEngine(init_model(config, seed=0), EngineConfig(
        max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, block_size=16,
        enable_prefix_caching=False, **fields))
    engine.warmup()
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(rng.integers(0, 4096, 128).tolist(), params) for _ in range(8)]
    done, decode, start = {}, [], time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        if engine.last_schedule is not None and engine.last_schedule.kind == "decode":
            decode.append(time.perf_counter() - t0)
        done.update({o.request_id: o.output_token_ids for o in outs if o.finished})
    seconds = time.perf_counter() - start
    expert_bytes = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(engine.runner.params):
        if "experts" in jax.tree_util.keystr(path):
            expert_bytes += leaf.addressable_shards[0].data.nbytes
    print(json.dumps({"decode": decode[1:], "seconds": seconds,
                      "tokens": [done[i] for i in ids], "expert_bytes": expert_bytes}))
''')
RUNS = {"tp1": {}, "tp4": dict(tensor_parallel_size=4),
        "ep4": dict(tensor_parallel_size=4, enable_expert_parallel=True)}


def run(fields: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDJAX_COMPILATION_CACHE": "off",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(fields)], env=env,
                         capture_output=True, text=True, timeout=1200, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from common import percentiles

    results = {name: run(fields) for name, fields in RUNS.items()}
    base = results["tp1"]
    rows = []
    for name, result in results.items():
        if result["tokens"] != base["tokens"]:
            raise SystemExit(f"{name}'s tokens differ from TP 1's")
        tokens = sum(len(t) for t in result["tokens"])
        row = {"layout": name, **percentiles(result["decode"], "decode_step"),
               "output_tokens_per_s": round(tokens / result["seconds"], 1),
               "vs_tp1": round(tokens / result["seconds"]
                               / (tokens / base["seconds"]), 2),
               "expert_mib_device0": round(result["expert_bytes"] / 2**20, 2),
               "decode_steps": len(result["decode"]) + 1}
        rows.append(row)
        print(row, flush=True)
    write_results("moe_parallel", "MoE on the 8-device CPU mesh: expert vs tensor parallel",
                  rows, {"runs": RUNS}, __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
