"""Which prefill buckets earn their compile: a program per (T, B) pair ("bucketed") against one
program per token bucket T with B padded to the most sequences T tokens can hold
("per_token_bucket"), on the same model, config and workload.

Each configuration runs in a fresh process (compilation cache off), three times over the same
seeded log-normal workload (greedy, every request queued at once, as `LLM.generate` does):

- first run: no warmup, so the programs it needs compile as they appear (a user's first call);
- warmup: `warmup()` afterwards compiles the rest of the bucket set (the full count is reported);
- warm run: the same workload again, nothing left to compile.

prefill_step_s sums the runner's forward time in prefill steps of the warm run (the sampler
after it is not counted): what padding the rows of a prefill step costs. Ratios are against "bucketed" in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

from common import ROOT, write_results

CHILD = textwrap.dedent('''
    import json, sys, time
    import jax
    sys.path.insert(0, "benchmarks")
    import numpy as np
    from common import lognormal_workload
    from pagedjax import LLM, SamplingParams
    from pagedjax.engine.runner import num_step_traces
    args = json.loads(sys.argv[1])
    llm = LLM(args["model"], max_model_len=args["max_model_len"],
              prefill_seqs=args["prefill_seqs"], compilation_cache="off")
    engine = llm.engine
    rng = np.random.default_rng(0)
    workload = lognormal_workload(args["num_requests"], seed=0,
                                  max_model_len=args["max_model_len"], prompt_mu=4.0,
                                  output_mu=3.5)
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, p).tolist() for p, _ in workload]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in workload]

    def timed():
        stats = engine.stats
        prefill_time = [0.0]
        runner = engine.runner

        def counting(plan):  # the step's forward, waited for (the sampler comes after it)
            start = time.perf_counter()
            logits = type(runner).dispatch_forward(runner, plan)
            jax.block_until_ready(logits)
            if plan.kind == "prefill":
                prefill_time[0] += time.perf_counter() - start
            return logits

        runner.dispatch_forward = counting
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        del runner.dispatch_forward  # the class's again
        tokens = sum(len(o.output_token_ids) for o in outputs)
        return elapsed, tokens, prefill_time[0], [o.output_token_ids for o in outputs]

    traces = num_step_traces()
    first_s, tokens, _, first_ids = timed()
    first_programs = num_step_traces() - traces
    start = time.perf_counter()
    programs = engine.warmup()
    warmup_s = time.perf_counter() - start
    warm_s, _, prefill_s, warm_ids = timed()
    assert warm_ids == first_ids
    print(json.dumps({"first_run_s": first_s, "first_run_programs": first_programs,
                      "warmup_programs": programs, "warmup_s": warmup_s, "warm_run_s": warm_s,
                      "prefill_step_s": prefill_s, "output_tokens": tokens,
                      "digest": hash(str(warm_ids)) % 10**8}))
''')


def run(args: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                            text=True, cwd=ROOT.parent, timeout=3600,
                            env={**os.environ, "PYTHONHASHSEED": "0"})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/checkpoints/pagedjax-tiny")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    rows = []
    for mode in ("bucketed", "per_token_bucket"):
        row = {"prefill_seqs": mode, **run(dict(model=args.model, max_model_len=args.max_model_len,
                                                num_requests=args.num_requests,
                                                prefill_seqs=mode))}
        print(row, flush=True)
        rows.append(row)
    assert len({r["digest"] for r in rows}) == 1, "the two bucket sets gave different tokens"
    base = rows[0]
    for row in rows:
        for key in ("first_run_s", "warmup_s", "warm_run_s", "prefill_step_s"):
            row[f"{key.removesuffix('_s')}_ratio"] = round(row[key] / base[key], 3)
            row[key] = round(row[key], 2)
        row["first_run_tokens_per_s"] = round(row["output_tokens"] / row["first_run_s"], 1)
        del row["digest"]
    write_results("prefill_buckets", "Prefill buckets: a program per (T, B) vs one per T",
                  rows, vars(args), __doc__.split("\n\n", 1)[1],
                  reproduce="`.venv/bin/python benchmarks/prefill_buckets.py`")


if __name__ == "__main__":
    main()
