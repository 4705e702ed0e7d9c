"""The sampled path's top-k / top-p filter: the most likely TOP_CANDIDATES tokens of each row
(lax.top_k) against sorting the whole row (the sampler before), in the same run.

Each row times the jitted `pagedjax.engine.sampler.sample` on f32[B, V] logits SmolLM2-135M-
Instruct gave (its 49,152-token vocabulary; the next-token logits at 32 positions of its greedy
continuations of pagedjax.models.training.quantization_quality.PROMPTS: real distributions, whose nuclei are what
decides the path), every row sampled at temperature 0.7 with the filters named: vLLM-style chat defaults (top_k 50, top_p 0.95), top_p 0.9 alone, and top_k 1000 (past
the candidates: this path sorts too). "sort" is the same sampler with TOP_CANDIDATES set to the
vocabulary (every step sorts). p50/p95/p99 over the timed calls after a compile and warm-up;
speedup: the sort's p50 over the candidates' p50.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import write_results

import pagedjax.engine.sampler as sampler

FILTERS = {"top_k 50, top_p 0.95": (50, 0.95), "top_p 0.9": (-1, 0.9),
           "top_k 1000 (sorts)": (1000, 1.0)}


def real_logits(count: int) -> np.ndarray:
    """f32[count, V]: SmolLM2's next-token logits along its greedy continuations."""
    from pagedjax.models.loading.gguf import load_gguf_model, metadata, open_gguf
    from pagedjax.models.training.generate import _dense_logits, dense_greedy_generate
    from pagedjax.models.training.quantization_quality import PROMPTS
    from pagedjax.text.gguf_tokenizer import tokenizer_from_gguf
    from pagedjax.tools.chat_demo import smollm2_path

    path = smollm2_path()
    model = load_gguf_model(path)
    tokenizer = tokenizer_from_gguf(metadata(open_gguf(path)), path)
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    per_prompt = -(-count // len(prompts))
    rows = []
    for prompt, tail in zip(prompts, dense_greedy_generate(model, prompts, per_prompt)):
        sequence = prompt + tail
        logits = np.asarray(_dense_logits(model, jnp.asarray([sequence])))[0]
        rows.extend(logits[len(prompt) - 1:len(prompt) - 1 + per_prompt])
    return np.stack(rows[:count]).astype(np.float32)


def timed(logits: np.ndarray, top_k: int, top_p: float, calls: int) -> np.ndarray:
    batch = logits.shape[0]
    logits = jnp.asarray(logits)
    args = (logits, jnp.full(batch, 0.7), jnp.full(batch, top_k, jnp.int32),
            jnp.full(batch, top_p, jnp.float32), jnp.arange(batch, dtype=jnp.uint32),
            jnp.zeros(batch, jnp.int32))
    jax.clear_caches()  # traced afresh under this TOP_CANDIDATES
    fn = jax.jit(sampler.sample)
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return np.asarray(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    rows, candidates = [], sampler.TOP_CANDIDATES
    logits = real_logits(max(args.batches))
    for batch in args.batches:
        for name, (top_k, top_p) in FILTERS.items():
            result = {}
            for label, cap in (("candidates", candidates), ("sort", logits.shape[1])):
                sampler.TOP_CANDIDATES = cap
                result[label] = timed(logits[:batch], top_k, top_p, args.calls)
            sampler.TOP_CANDIDATES = candidates
            for label, ms in result.items():
                rows.append({"batch": batch, "filters": name, "filter": label,
                             **{f"p{q}_ms": round(float(np.percentile(ms, q)), 2)
                                for q in (50, 95, 99)},
                             "speedup": round(float(np.percentile(result["sort"], 50)
                                                    / np.percentile(ms, 50)), 2)})
                print(rows[-1], flush=True)
    write_results("sampler_topk", "The sampler's top-k / top-p over the top candidates vs a "
                  "sorted row (SmolLM2's vocabulary, CPU)", rows,
                  {**vars(args), "top_candidates": candidates}, __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
