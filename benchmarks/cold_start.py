"""Cold start: a fresh process from `LLM(...)` to its first token, a full warmup and the
steady decode step, for the embedded model (4 layers) and a 30-layer configuration
(SmolLM2-135M's shapes, random weights), against transformers' first generate on the same
weights; every run in its own process.

Runs, per model:
- before: the program set and form this issue started from (a prefill program per (T, B),
  layers unrolled), compilation cache off;
- unrolled: today's bucket set (a prefill program per token bucket), layers unrolled, cache off;
- scan, cache off / cold / warm: the default engine (layers under one lax.scan), with JAX's
  persistent compilation cache off, then an empty directory (cold), then the directory the
  cold run filled (warm);
- transformers: `from_pretrained(dir)` + a one-token greedy `generate`, torch CPU.

Columns:
- first_token_s: process start (imports included) to the first token of a one-token greedy
  generate, as a user's first call runs it (loading, compiling what it needs);
- warmup_s / programs: LLMEngine.warmup() afterwards, every step program the buckets allow;
- compiled / cache_hits: programs XLA compiled vs loaded from the persistent cache in that
  process (JAX's monitoring events, every jit program of the process);
- decode_step_ms: median wall time of an engine step while 8 sequences decode (32-token
  prompts), after warmup: host path, dispatch and device time together;
- first_token_vs_transformers: first_token_s over the transformers run of the same model.

The embedded model is a pagedjax checkpoint; its transformers row runs random weights of the
same shapes (the time to a first token does not depend on the values). The 30-layer model is
one random Hugging Face checkpoint that both sides load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from common import ROOT, write_results

ENGINE_CHILD = textwrap.dedent('''
    import json, sys, time
    start = time.perf_counter()
    from jax import monitoring
    counts = {}
    monitoring.register_event_listener(
        lambda event, **kw: counts.__setitem__(event, counts.get(event, 0) + 1))
    import numpy as np
    from pagedjax import LLM, SamplingParams
    model, kwargs = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(**kwargs) if model == "default" else LLM(model, **kwargs)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    first_token = time.perf_counter() - start
    start = time.perf_counter()
    programs = llm.engine.warmup()
    warmup = time.perf_counter() - start
    requests = counts.get("/jax/compilation_cache/compile_requests_use_cache", 0)
    hits = counts.get("/jax/compilation_cache/cache_hits", 0)
    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    for i in range(8):
        engine.add_request([(7 * i + j) % vocab for j in range(32)],
                           SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        decodes, tick = engine.stats.num_decode_steps, time.perf_counter()
        engine.step()
        if engine.stats.num_decode_steps > decodes:
            times.append(time.perf_counter() - tick)
    print(json.dumps({"first_token_s": first_token, "warmup_s": warmup, "programs": programs,
                      "compiled": requests - hits, "cache_hits": hits,
                      "decode_step_ms": 1000 * float(np.median(times[2:]))}))
''')

HF_CHILD = textwrap.dedent('''
    import json, sys, time
    start = time.perf_counter()
    import torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=1, pad_token_id=0)
    print(json.dumps({"first_token_s": time.perf_counter() - start}))
''')

# (run, EngineConfig fields, compilation cache: "off" or "dir")
ENGINE_RUNS = [
    ("before (41-program set, unrolled)", dict(prefill_seqs="bucketed", scan_layers=False),
     "off"),
    ("unrolled, cache off", dict(scan_layers=False), "off"),
    ("scan, cache off", {}, "off"),
    ("scan, cold cache", {}, "dir"),
    ("scan, warm cache", {}, "dir"),
]


def child(code: str, args: list[str], cache: str = "off") -> dict:
    env = {**os.environ, "PAGEDJAX_COMPILATION_CACHE": cache}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            env=env, cwd=ROOT.parent, timeout=3600)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    row = json.loads(result.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - start
    return row


def save_hf(config, directory: str) -> None:
    """Random transformers Llama weights of a models.LlamaConfig's shapes."""
    import torch
    import transformers
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, rms_norm_eps=config.rms_norm_eps,
        bos_token_id=None, eos_token_id=None, initializer_range=0.02)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(directory)


def model_rows(name: str, runs: list, max_model_len: int, tmp: str) -> list[dict]:
    from pagedjax.models import CONFIGS, DEFAULT_CHECKPOINT
    from pagedjax.models.loading.checkpoint import read_checkpoint_config
    config = (read_checkpoint_config(DEFAULT_CHECKPOINT)[0] if name == "default"
              else CONFIGS[name])
    config = dataclasses.replace(config, max_position_embeddings=max(
        config.max_position_embeddings, max_model_len))
    hf_dir = os.path.join(tmp, f"hf-{name}")
    save_hf(config, hf_dir)
    source = "default" if name == "default" else hf_dir
    cache = os.path.join(tmp, f"jax-cache-{name}")
    rows = []
    for run, fields, cache_mode in runs:
        row = child(ENGINE_CHILD, [source, json.dumps({"max_model_len": max_model_len,
                                                       **fields})],
                    cache if cache_mode == "dir" else "off")
        rows.append({"model": name, "layers": config.num_layers, "run": run, **row})
        print(rows[-1], flush=True)
    hf = child(HF_CHILD, [hf_dir])
    rows.append({"model": name, "layers": config.num_layers, "run": "transformers", **hf})
    print(rows[-1], flush=True)
    for row in rows:
        row["first_token_vs_transformers"] = round(row["first_token_s"] / hf["first_token_s"], 2)
        for key in ("first_token_s", "warmup_s", "process_s", "decode_step_ms"):
            if key in row:
                row[key] = round(row[key], 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,smollm2-135m",
                        help="'default' (the embedded model) and/or models.CONFIGS names")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--skip-before", action="store_true",
                        help="leave out the 41-program unrolled run (the slowest)")
    args = parser.parse_args()
    runs = ENGINE_RUNS[1:] if args.skip_before else ENGINE_RUNS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows += model_rows(name, runs, args.max_model_len, tmp)
    write_results("cold_start", "Cold start: first token, warmup and decode step, layers "
                  "unrolled / scanned, compilation cache off / cold / warm, vs transformers",
                  rows, {"models": args.models, "max_model_len": args.max_model_len},
                  __doc__.split("\n\n", 1)[1],
                  reproduce=f"`.venv/bin/python benchmarks/cold_start.py --models {args.models}`")


if __name__ == "__main__":
    main()
