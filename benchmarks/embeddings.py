"""Embedding throughput: `LLM(dir, runner="pooling").embed` against sentence-transformers'
`SentenceTransformer.encode` (torch, CPU here) on the same random Qwen3-Embedding-0.6B-shaped
checkpoint (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocabulary 151,669; --layers
of its 28), last-token pooling then normalization, f32, same run, same texts.

Rows (sequences/s and tokens/s; the time of one whole call from texts to vectors, the median
of --repeats calls (at least 32 / batch) on fresh texts after two warm-up calls of the same
shape, so compiles are off the clock; the implementations' calls interleaved, round-robin in a
shuffled order each round, so the machine's drift spreads evenly):
- batch 1, 32, 256 prompts of --prompt-len tokens (distinct prompts, no prefix shared), and
  any BxL of --batches (B prompts of L tokens: 4x288 is 1152 tokens, which a step pads to
  2048 with the default power-of-two token buckets, to 1280 with --gap-rows 256's engine,
  token_padding_gap=256);
- a --prefix-len-token instruction shared by --prefix-batch queries of --query-len tokens
  (Qwen3-Embedding's "Instruct: ...\\nQuery:" form): sentence-transformers computes it for
  every query; pagedjax with the prefix cache cold (caching off) and warm (its blocks cached
  by an earlier call: each query computes its own tokens only).

pagedjax runs with its defaults: on the CPU, layers this size (60 MiB) unrolled
(paged_forward.scan_by_default). With --scanned-rows, a second engine with scan_layers=True
(`--scan-layers`: the decoder layers under one jax.lax.scan over stacked weights, which on the
CPU copies each layer's weights out of the stack every step; it compiles about 3x faster).

ratio_vs_st divides a pagedjax row's sequences/s by sentence-transformers' of the same batch.
max_abs_cosine_gap: the largest 1 - cosine between the two implementations' vectors of a row.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time

import numpy as np
from common import write_results

QWEN3_EMBEDDING_06B = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                           tie_word_embeddings=True)
WORDS = 32000  # the word-level tokenizer's vocabulary: "w0" .. "w31999", one token each


def build_checkpoint(directory: str, layers: int, seed: int) -> None:
    """A random Qwen3-Embedding-shaped checkpoint with its sentence-transformers pipeline
    (last token, normalized) and a word-level tokenizer both sides read."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**QWEN3_EMBEDDING_06B, "num_hidden_layers": layers})
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(WORDS)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(f"{directory}/tokenizer.json")
    files = {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                       "pad_token": "w0", "model_max_length": 4096},
             "modules.json": [
                 {"idx": 0, "name": "0", "path": "", "type":
                  "sentence_transformers.models.Transformer"},
                 {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                  "sentence_transformers.models.Pooling"},
                 {"idx": 2, "name": "2", "path": "2_Normalize", "type":
                  "sentence_transformers.models.Normalize"}],
             "1_Pooling/config.json": {"word_embedding_dimension": 1024,
                                       "pooling_mode": "lasttoken"}}
    for name, content in files.items():
        path = f"{directory}/{name}"
        if "/" in name:
            import os
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(content, f)


def texts(rng, count: int, length: int, prefix: str = "") -> list[str]:
    return [prefix + " ".join(f"w{t}" for t in rng.integers(2, WORDS, length))
            for _ in range(count)]


def interleaved(fns: dict, inputs: list) -> dict:
    """name -> (median seconds of fns[name] over inputs[2:], every timed call's result), the
    calls round-robin in a shuffled order each round (so the machine's drift spreads evenly)
    after two warm-up rounds on inputs[0] and [1]: fresh texts each round, so no call is
    served by an earlier round's cache; two warm-ups, so the shapes a cache hit gives are
    compiled too."""
    for texts_ in inputs[:2]:
        for fn in fns.values():
            fn(texts_)
    times = {name: [] for name in fns}
    results = {name: [] for name in fns}
    order = np.random.default_rng(0)
    for texts_ in inputs[2:]:
        for name in order.permutation(list(fns)):
            start = time.perf_counter()
            results[name].append(fns[name](texts_))
            times[name].append(time.perf_counter() - start)
    return {name: (float(np.median(times[name])), results[name]) for name in fns}


def row(name: str, batch: int, tokens: int, seconds: float, **extra) -> dict:
    return {"implementation": name, "batch": batch, "tokens_per_seq": tokens,
            "seconds": round(seconds, 4), "seqs_per_s": round(batch / seconds, 2),
            "tokens_per_s": round(batch * tokens / seconds, 1), **extra}


def gap(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return float(np.max(1 - cos))


def embedded(llm, texts_: list[str]) -> list:
    return [o.outputs.embedding for o in llm.embed(texts_, use_tqdm=False)]


def compare(rows: list, batch: int, tokens: int, inputs: list, st, ours: dict) -> None:
    """One batch shape over inputs (lists of texts): sentence-transformers' row, then each of
    ours (name -> LLM) against it, timed interleaved."""
    fns = {"sentence-transformers": lambda t: st.encode(t, batch_size=batch,
                                                         convert_to_numpy=True)}
    fns.update({name: functools.partial(embedded, llm) for name, llm in ours.items()})
    timings = interleaved(fns, inputs)
    st_seconds, st_vectors = timings.pop("sentence-transformers")
    rows.append(row("sentence-transformers", batch, tokens, st_seconds))
    for name, (seconds, vectors) in timings.items():
        rows.append(row(name, batch, tokens, seconds,
                        ratio_vs_st=round(st_seconds / seconds, 3),
                        max_abs_cosine_gap=float(f"{gap(vectors, st_vectors):.2e}")))
        print(rows[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--batches", default="1,32,256",
                        help="batch sizes, each of --prompt-len tokens or BxL (L tokens)")
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--prefix-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="embeddings")
    parser.add_argument("--scanned-rows", action="store_true",
                        help="also time an engine with its layers scanned (scan_layers=True)")
    parser.add_argument("--gap-rows", type=int, default=0, metavar="N",
                        help="also time an engine with token_padding_gap=N")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from pagedjax import LLM

    directory = tempfile.mkdtemp(prefix="qwen3-embedding-")
    build_checkpoint(directory, args.layers, args.seed)
    st = SentenceTransformer(directory, device="cpu")
    shapes = [(int(b.split("x")[0]), int(b.split("x")[1]) if "x" in b else args.prompt_len)
              for b in args.batches.split(",")]
    batches = [b for b, _ in shapes]
    longest = max([args.prefix_len + args.query_len] + [length for _, length in shapes])
    engine = dict(runner="pooling", max_model_len=longest + 64,
                  max_num_seqs=max(batches + [args.prefix_batch]),
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=16)
    llm = LLM(directory, **engine)
    ours = {"pagedjax": llm}
    if args.scanned_rows:
        ours["pagedjax, layers scanned"] = LLM(directory, **engine, scan_layers=True)
    if args.gap_rows:
        ours[f"pagedjax, token_padding_gap {args.gap_rows}"] = LLM(
            directory, **engine, token_padding_gap=args.gap_rows)
    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    for batch, length in shapes:  # small batches timed over more calls (they vary more)
        calls = max(args.repeats, 32 // batch)
        inputs = [texts(rng, batch, length) for _ in range(calls + 2)]
        compare(rows, batch, length, inputs, st, ours)
    instruction = " ".join(f"w{t}" for t in rng.integers(2, WORDS, args.prefix_len)) + " "
    inputs = [texts(rng, args.prefix_batch, args.query_len, instruction)
              for _ in range(args.repeats + 2)]
    cold = LLM(directory, **engine, enable_prefix_caching=False)
    # the cached engine's warm-up call leaves the instruction's blocks in its cache
    compare(rows, args.prefix_batch, args.prefix_len + args.query_len, inputs, st,
            {"pagedjax, prefix cache off": cold, "pagedjax, prefix cached": llm})
    write_results(args.out, "Embedding throughput: pagedjax vs sentence-transformers (CPU)",
                  rows, {**vars(args), "torch_threads": torch.get_num_threads()},
                  notes=__doc__, reproduce=f".venv/bin/python benchmarks/embeddings.py "
                  f"--layers {args.layers} --batches {args.batches}"
                  + (" --scanned-rows" if args.scanned_rows else "")
                  + (f" --gap-rows {args.gap_rows}" if args.gap_rows else ""))


if __name__ == "__main__":
    main()
