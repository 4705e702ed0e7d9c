"""`make demo`: the project's own trained model, served by the engine, graded against the truth.

The embedded default (models/checkpoints/pagedjax-tiny, trained by `python -m models.train`) is a
byte-level Llama that does key-value recall from a context and copying/reversing a string.
Every answer needs the whole prompt, so getting them right exercises the KV cache end to end.
The demo serves one mixed batch through the public API:

- recall and copy/reverse prompts, parallel samples (n=4, temperature 0.7) of a few,
- then a second wave (later traffic): more questions about a context the first wave already
  computed (served from the prefix cache) and new prompts,

in a KV pool smaller than the first wave needs at once (preemption), with a token budget that
chunks prompts, then prints answers next to the expected ones and the engine's table.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from models.tasks import Example, make_examples, recall_queries
from pagedjax.llm import DEFAULT_MODEL, LLM
from scheduler import SamplingParams


def shared_context_queries(seed: int, num_queries: int) -> list[Example]:
    """num_queries recall questions about one long context (the longest the task draws)."""
    longest = max(make_examples("recall", 64, seed), key=lambda e: len(e.prompt))
    every = recall_queries(longest)  # one question per key
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(every), size=min(num_queries, len(every)), replace=False)
    return [every[i] for i in picks]


def workload(seed: int) -> list[tuple[list[Example], list[SamplingParams]]]:
    """Two waves of requests. The first: recall and copy prompts, one question about a shared
    context, parallel samples; the second, sent when the first is done (later traffic): more
    questions about that context, whose blocks are still in the prefix cache, and new prompts."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    queries = shared_context_queries(seed, 8)
    first = make_examples("recall", 16, seed + 1) + make_examples("copy", 16, seed + 1)
    sampled = make_examples("copy", 4, seed + 2)  # parallel samples: 4 answers per prompt
    first_params = [greedy] * len(first) + [
        SamplingParams(max_tokens=24, temperature=0.7, n=4, seed=seed + i)
        for i in range(len(sampled))]
    first += sampled
    order = np.random.default_rng(seed).permutation(len(first))  # arrive interleaved
    # the shared context's first question comes last, so its blocks are the most recently
    # freed (the last to be evicted) when the second wave arrives
    first = [first[i] for i in order] + queries[:1]
    first_params = [first_params[i] for i in order] + [greedy]
    second = queries[1:] + make_examples("recall", 8, seed + 3) + make_examples("copy", 8, seed + 3)
    return [(first, first_params), (second, [greedy] * len(second))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-blocks", type=int, default=40)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--policy", default="mixed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    llm = LLM(args.model, block_size=args.block_size, num_blocks=args.num_blocks,
              max_model_len=128, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, policy=args.policy,
              min_token_bucket=16, min_seq_bucket=4, seed=args.seed)
    engine = llm.engine
    config = engine.model_config
    print(f"\nmodel {args.model}: {config.num_params / 1e6:.2f} M parameters, "
          f"{config.num_layers} layers, {config.num_heads} query / {config.num_kv_heads} KV heads; "
          f"attention backend {engine.runner.backend.name}")
    start = time.perf_counter()
    num_programs = engine.warmup(progress=True)
    print(f"{num_programs} step programs (every bucket) ready in "
          f"{time.perf_counter() - start:.1f} s (compiled, or loaded from the compilation cache "
          f"{engine.compilation_cache_dir or 'off'})")
    examples, outputs = [], []
    start = time.perf_counter()
    for wave_examples, wave_params in workload(args.seed):
        examples += wave_examples
        outputs += llm.generate([e.prompt for e in wave_examples], wave_params)
    elapsed = time.perf_counter() - start
    print_answers(examples, outputs)
    print_table(engine, outputs, elapsed)


def _clip(text: str, width: int, tail: bool = True) -> str:
    text = "".join(c if c.isprintable() else "?" for c in text)
    if len(text) <= width:
        return text
    return "..." + text[-(width - 3):] if tail else text[:width - 3] + "..."


def print_answers(examples, outputs) -> None:
    hits: dict[str, list[bool]] = collections.defaultdict(list)
    shown: collections.Counter = collections.Counter()
    print(f"\n{'task':<7} {'prompt (tail)':<34} {'expected':>10}  {'answer':<10}")
    for example, out in zip(examples, outputs):
        answers = [c.text for c in out.outputs]
        label = example.task if len(answers) == 1 else f"{example.task} n={len(answers)}"
        for answer in answers:
            hits[label].append(answer == example.answer)
        if shown[label] < 3:
            shown[label] += 1
            marks = " ".join(f"{_clip(a, 12, tail=False)}{'' if a == example.answer else ' (x)'}"
                             for a in answers)
            print(f"{label:<7} {_clip(example.prompt, 34):<34} {example.answer:>10}  {marks}")
    print("\naccuracy (exact match):  " + "   ".join(
        f"{label} {sum(h)}/{len(h)}" for label, h in sorted(hits.items())))


def print_table(engine, outputs, elapsed: float) -> None:
    stats = engine.stats
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = np.array([o.metrics.ttft for o in outputs])
    finished = [o for o in outputs if o.metrics.first_token_time and o.metrics.finish_time]
    tpots = np.array([(o.metrics.finish_time - o.metrics.first_token_time)
                      / max(len(o.outputs[0].token_ids) - 1, 1) for o in finished])
    block_size = engine.config.block_size
    contiguous = stats.max_running * engine.config.max_blocks_per_seq
    rows = [
        ("requests (samples)", f"{len(outputs)} ({sum(len(o.outputs) for o in outputs)})"),
        ("prompt / output tokens", f"{num_prompt} / {num_out}"),
        ("wall time (after warm-up)", f"{elapsed:.1f} s"),
        ("output tokens/s", f"{num_out / elapsed:.1f}"),
        ("TTFT p50 / p99", f"{np.percentile(ttfts, 50):.2f} / {np.percentile(ttfts, 99):.2f} s"),
        ("TPOT p50", f"{1000 * np.percentile(tpots, 50):.1f} ms"),
        ("steps (prefill / decode)", f"{stats.num_prefill_steps} / {stats.num_decode_steps}"),
        ("KV pool", f"{stats.num_blocks} blocks x {block_size} tokens "
                    f"({stats.num_blocks * engine.bytes_per_block / 2**20:.2f} MiB)"),
        ("KV blocks used at peak", f"{stats.peak_used_blocks} "
                                   f"({stats.peak_used_tokens} tokens held, "
                                   f"{100 * stats.peak_waste:.1f}% of slots empty)"),
        ("max concurrent sequences", f"{stats.max_running}; a contiguous cache reserving "
                                     f"max_model_len={engine.config.max_model_len} for each "
                                     f"would need {contiguous} blocks"),
        ("prefix cache hits", f"{stats.num_prefix_hit_tokens} of "
                              f"{stats.num_prefix_query_tokens} prompt tokens "
                              f"({100 * stats.prefix_hit_rate:.1f}%)"),
        ("preemptions", f"{stats.num_preemptions} ({stats.num_recomputed_tokens} tokens "
                        f"recomputed)"),
        ("compiled programs", f"{engine.num_compiled_programs} "
                              f"(bound {engine.buckets.num_programs})"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    main()
