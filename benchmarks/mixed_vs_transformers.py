"""The engine against transformers on a mixed workload, compiles counted: useful output tokens/s
of `LLM(dir).generate(...)` in a fresh process (no explicit warmup, every compile on the clock)
and of a second call once warm, against transformers' static batches with left padding, same
random Llama weights, same run.

Workload: --requests prompts with log-normal prompt and output lengths (common.
lognormal_workload), greedy, eos ignored. Useful output tokens: each request's own output
length; transformers generates a batch until its longest output (the rest is padding work).

Rows:
- transformers: `generate` on static batches of --hf-batch-size requests in arrival order,
  prompts left-padded to the batch's longest, max_new_tokens = the batch's longest output;
- engine, first call: in a fresh process, `LLM(dir)` then one `generate` over every request,
  compiling as shapes appear, with the persistent compilation cache off (a first start ever)
  and warm (a later session: a process before this one filled the cache);
- engine, first call incl. load: the same tokens over `LLM(dir)` + generate seconds;
- engine, warm (second call): a second `generate` over other prompts of the same lengths in
  the cache-off process, every program compiled by then.

Each engine row names its step programs (EngineConfig.step_programs): split (a decode family
beside the ragged one, the default) or ragged (every step on the ragged family);
programs: how many the process compiled by the end.

ratio_vs_transformers divides each tokens/s by transformers' measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from common import add_llama_args, lognormal_workload, random_hf_llama, write_results


def run_transformers(hf, prompts, outputs, batch_size: int) -> float:
    import torch
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch, lengths = prompts[i:i + batch_size], outputs[i:i + batch_size]
            width = max(map(len, batch))
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(batch):  # left padding
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            hf.generate(ids, attention_mask=mask, do_sample=False,
                        max_new_tokens=max(lengths), min_new_tokens=max(lengths),
                        pad_token_id=0)
    return time.perf_counter() - start


def workload(args):
    """(prompts of the first call, prompts of the warm call, output lengths), seeded."""
    pairs = lognormal_workload(args.requests, seed=args.seed, max_model_len=args.max_model_len)
    rng = np.random.default_rng(args.seed)
    first, warm = ([rng.integers(0, args.vocab, n).tolist() for n, _ in pairs]
                   for _ in range(2))
    return first, warm, [out for _, out in pairs]


def engine_side(hf_dir: str, args) -> dict:
    """In a fresh process (the child): LLM(dir), the first generate, the warm one."""
    from pagedjax import LLM, SamplingParams
    first_prompts, warm_prompts, outputs = workload(args)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    llm = LLM(hf_dir, max_model_len=args.max_model_len, step_programs=args.step_programs)
    times = {"load": time.perf_counter() - start}
    for name, prompts in (("first", first_prompts), ("warm", warm_prompts)):
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        times[name] = time.perf_counter() - start
        assert [len(r.outputs[0].token_ids) for r in results] == outputs
    times["programs"] = llm.engine.num_compiled_programs
    return times


def run_engine(hf_dir: str, cache: str, step_programs: str) -> dict:
    env = {**os.environ, "PAGEDJAX_COMPILATION_CACHE": cache}
    result = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--engine-child", hf_dir,
                             "--step-programs", step_programs],
                            capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(parser, hidden=256, intermediate=704, layers=4, heads=8, kv_heads=2,
                   vocab=1024)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--engine-child", help=argparse.SUPPRESS)
    parser.add_argument("--step-programs", default="split", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        print(json.dumps(engine_side(args.engine_child, args)))
        return

    import torch
    import transformers

    hf = random_hf_llama(args, max_position_embeddings=2 * args.max_model_len)
    first_prompts, _, outputs = workload(args)
    useful = sum(outputs)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(os.path.join(tmp, "model"))
        cache = os.path.join(tmp, "jax-cache")
        model = os.path.join(tmp, "model")
        runs = {"cache off, split programs": run_engine(model, "off", "split"),
                "cache off, ragged programs": run_engine(model, "off", "ragged")}
        run_engine(model, cache, "split")  # fills the cache
        runs["warm compilation cache, split programs"] = run_engine(model, cache, "split")
    hf_seconds = run_transformers(hf, first_prompts, outputs, args.hf_batch_size)
    rows = [{"system": "transformers static batches", "seconds": hf_seconds}]
    for name, times in runs.items():
        rows += [{"system": f"engine, first call ({name})", "seconds": times["first"],
                  "programs": times["programs"]},
                 {"system": f"engine, first call incl. load ({name})",
                  "seconds": times["load"] + times["first"]}]
    for family in ("split", "ragged"):
        times = runs[f"cache off, {family} programs"]
        rows.append({"system": f"engine, warm (second call, {family} programs)",
                     "seconds": times["warm"], "programs": times["programs"]})
    for row in rows:
        row["output_tokens_per_s"] = round(useful / row["seconds"], 1)
        row["ratio_vs_transformers"] = round(hf_seconds / row["seconds"], 2)
        row["seconds"] = round(row["seconds"], 2)
    write_results("mixed_vs_transformers", "Mixed workload, compiles counted: engine vs "
                  "transformers static batches (same weights, greedy)", rows,
                  dict({k: v for k, v in vars(args).items()
                        if k not in ("engine_child", "step_programs")},
                       useful_output_tokens=useful, prompt_tokens=sum(map(len, first_prompts)),

                       torch=torch.__version__, transformers=transformers.__version__,
                       torch_threads=torch.get_num_threads()),
                  notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
