"""Compile time and decode step time of a 26-layer Gemma-3-shaped model's serving forms, beside
a Llama of the same size.

Gemma 3's layers differ (five sliding-window layers, then a global one, with their own windows
and RoPE bases, static to the kernels), so one scanned layer cannot stand for all of them. The
serving form scans over the repeating period instead (pagedjax.models.paged_forward: one scan step runs the
period's six layers, each layer's KV cache group and slot traced; the two layers after the
four whole periods unrolled), or unrolls all 26. The alternative the issue names, one scanned
layer taking its window and RoPE base as traced per-layer values, is not built: the kernels
take the window as a static argument to skip the pages before it, and a traced window would
make them visit every page.

Each form: an LLMEngine on random weights (hidden 256, 4 heads, 1 KV head of 64, window 64,
KV cache groups on), `warmup()` (every step program the buckets allow, persistent cache off)
timed, then 8 sequences of 128-token prompts decoding: the median of 32 decode steps.
The Llama rows: the same sizes with every layer global (one scanned layer, or unrolled).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from common import recorded_args, write_results

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models import get_config, init_model


def configs(num_layers: int, window: int):
    gemma = get_config("gemma-3-1b")
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                  for i in range(num_layers))
    gemma = dataclasses.replace(gemma, vocab_size=2048, hidden_size=256, intermediate_size=512,
                                num_layers=num_layers, num_heads=4, num_kv_heads=1,
                                head_dim=64, sliding_window=window, layer_types=types,
                                query_pre_attn_scalar=64, max_position_embeddings=4096)
    llama = dataclasses.replace(get_config("demo-small"), vocab_size=2048, hidden_size=256,
                                intermediate_size=512, num_layers=num_layers, num_heads=4,
                                num_kv_heads=1, head_dim=64)
    return gemma, llama


def measure(model, scan_layers: bool, steps: int) -> dict:
    config = EngineConfig(block_size=16, max_model_len=512, max_num_seqs=8,
                          max_num_batched_tokens=256, compilation_cache="off",
                          scan_layers=scan_layers, enable_prefix_caching=False)
    engine = LLMEngine(model, config)
    start = time.perf_counter()
    programs = engine.warmup()
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    for _ in range(8):
        engine.add_request(rng.integers(0, 2048, 128).tolist(),
                           SamplingParams(max_tokens=steps + 40, temperature=0.0,
                                          ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in engine.scheduler.state.requests.values()):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    graph = engine.runner.graph
    return {"programs": programs, "warmup_compile_s": round(compile_s, 1),
            "decode_step_p50_ms": round(1e3 * float(np.median(times)), 2),
            "scanned": graph.scan_layers, "period": graph.period or ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=26)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    gemma, llama = configs(args.num_layers, args.window)
    rows = []
    for name, config, scan in (("gemma-3 shape, scanned by period", gemma, True),
                               ("gemma-3 shape, unrolled", gemma, False),
                               ("llama, scanned", llama, True),
                               ("llama, unrolled", llama, False)):
        rows.append({"form": name, **measure(init_model(config, seed=0), scan, args.steps)})
        print(rows[-1], flush=True)
    write_results("gemma_scan", "Gemma-3-shaped serving forms: compile and decode step time",
                  rows, recorded_args(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
