"""The engine against transformers' generate on the same weights and workload (greedy).

One random Llama checkpoint (saved by transformers) is served two ways in the same run:

- pagedjax: `LLM(dir)`: the paged engine, jit-compiled steps, continuous batching;
- transformers: `model.generate(batch, do_sample=False)` on torch CPU with its KV cache, one
  static batch of all prompts at a time (every prompt the same length, so no padding).

Workload: `--batches` static batches of `--batch-size` random prompts of `--prompt-len` tokens,
`--max-tokens` new tokens each, eos ignored on both sides. Each side first runs an untimed pass
over other prompts of the same shapes (compilation, allocator warm-up), then the timed pass.
Prefix caching is off: transformers has no cross-request cache, and the timed prompts share
nothing anyway. Output tokens/s = batch * max_tokens *
batches / wall seconds. The greedy tokens of both sides are compared and the share of requests
whose tokens agree exactly is reported (f32 on both sides: near-ties may flip late tokens).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from common import add_llama_args, random_hf_llama, write_results


def timed_runs(runs: dict, warmup_batches, timed_batches, num_output: int):
    """(rows, outputs): each run warmed up untimed (compiles), then timed on other prompts;
    ratios against the last run (transformers)."""
    rows, results = [], {}
    for name, run in runs.items():
        run(warmup_batches)
        start = time.perf_counter()
        results[name] = run(timed_batches)
        seconds = time.perf_counter() - start
        rows.append({"system": name, "seconds": seconds,
                     "output_tokens_per_s": num_output / seconds})
    base = rows[-1]["output_tokens_per_s"]
    for row in rows:
        row["ratio_vs_transformers"] = row["output_tokens_per_s"] / base
    return rows, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_args(parser, hidden=512, intermediate=1408, layers=6, heads=8, kv_heads=2,
                   vocab=4096)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    import torch
    import transformers

    from pagedjax import LLM, SamplingParams

    hf = random_hf_llama(args, max_position_embeddings=1024)
    rng = np.random.default_rng(args.seed)
    # The untimed warm-up pass runs other prompts than the timed one.
    warmup_batches = [rng.integers(0, args.vocab, (args.batch_size, args.prompt_len))
                      for _ in range(args.batches)]
    timed_batches = [rng.integers(0, args.vocab, (args.batch_size, args.prompt_len))
                     for _ in range(args.batches)]
    num_output = args.batch_size * args.batches * args.max_tokens

    def run_hf(batches):
        outs = []
        with torch.no_grad():
            for batch in batches:
                ids = torch.tensor(batch)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.max_tokens,
                                  min_new_tokens=args.max_tokens, pad_token_id=0)
                outs += out[:, args.prompt_len:].tolist()
        return outs

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        llm = LLM(tmp, max_model_len=args.prompt_len + args.max_tokens,
                  max_num_seqs=args.batch_size,
                  max_num_batched_tokens=max(args.batch_size * args.prompt_len // 2, 256),
                  min_seq_bucket=args.batch_size, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def run_engine(batches):
        outs = []
        for batch in batches:
            outs += [o.output_token_ids for o in llm.generate(batch.tolist(), params,
                                                               use_tqdm=False)]
        return outs

    rows, results = timed_runs({"pagedjax engine": run_engine, "transformers generate": run_hf},
                               warmup_batches, timed_batches, num_output)
    same = np.mean([a == b for a, b in zip(*results.values())])
    write_results("vs_transformers", "Engine vs transformers generate (same weights, greedy)",
                  rows, dict(vars(args), output_tokens=num_output,
                             torch=torch.__version__, transformers=transformers.__version__,
                             torch_threads=torch.get_num_threads(),
                             requests_with_identical_tokens=float(same)),
                  notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
