"""Cold start: a fresh process from `LLM(...)` to its first token, and a full warmup, with JAX's
persistent compilation cache cold (an empty directory) and warm (the directory the cold run
filled), and with the cache off: the same model and config each time, each in its own process.

- first_token_s: LLM(...) (loading the model) + a one-token greedy generate, as a user's first
  call runs it (compiling what it needs);
- warmup_s / programs: LLMEngine.warmup() afterwards, every step program the buckets allow;
- compiled / cache_hits: programs XLA compiled vs loaded from the cache in that process (JAX's
  monitoring events), all of the process's jit programs included.

Ratios are against the cache-off run measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from common import ROOT, write_results

CHILD = textwrap.dedent('''
    import json, sys, time
    start = time.perf_counter()
    from jax import monitoring
    counts = {}
    monitoring.register_event_listener(
        lambda event, **kw: counts.__setitem__(event, counts.get(event, 0) + 1))
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
    print(json.dumps({"first_token_s": first_token, "warmup_s": warmup, "programs": programs,
                      "compiled": requests - hits, "cache_hits": hits}))
''')


def run(model: str, kwargs: dict, cache: str) -> dict:
    env = {**os.environ, "PAGEDJAX_COMPILATION_CACHE": cache}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(kwargs)],
                            capture_output=True, text=True, env=env, cwd=ROOT.parent,
                            timeout=3600)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    row = json.loads(result.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default",
                        help="'default' (the embedded model) or a models.CONFIGS name")
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    kwargs = {"max_model_len": args.max_model_len}
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name, setting in (("cache off", "off"), ("cold cache", cache), ("warm cache", cache)):
            row = {"run": name, **run(args.model, kwargs, setting)}
            rows.append(row)
            print(row, flush=True)
    base = rows[0]
    for row in rows:
        row["first_token_vs_off"] = round(row["first_token_s"] / base["first_token_s"], 3)
        row["warmup_vs_off"] = round(row["warmup_s"] / base["warmup_s"], 3)
        for key in ("first_token_s", "warmup_s", "process_s"):
            row[key] = round(row[key], 2)
    write_results("cold_start", "Cold start: first token and warmup, compilation cache off / "
                  "cold / warm", rows, {"model": args.model, **kwargs},
                  __doc__.split("\n\n", 1)[1],
                  reproduce=f"`.venv/bin/python benchmarks/cold_start.py --model {args.model}`")


if __name__ == "__main__":
    main()
