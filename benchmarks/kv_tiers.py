"""The tiered prefix cache: device only vs + host tier vs + a small host tier and a disk tier, on
a multi-turn workload with more sessions than the device pool holds (every session returns
after the others' turns) and a RAG workload over a document set larger than the pool; then the
restart case (a new engine over the disk tier the last one wrote, vs over an empty one).

Each configuration is a fresh engine, warmed up (step programs and block copies compiled, or
loaded from the persistent compilation cache) before its timed run. Requests go in closed loop:
at most --concurrency in flight, the next one sent when one finishes, sessions and documents in
a fixed seeded order. TTFT is from a request's send to its first token (queueing included).
Prompt tokens computed: by the engine's steps (hits excluded, recomputation after preemption
included). Hit ratios, of the prompt tokens looked up at first admission: `device` found in the
device pool, `host` loaded from host memory, `disk` read from disk (blocks read x block size: a
block read up to the host and then loaded).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from common import percentiles, write_results

from pagedjax import EngineConfig, LLMEngine, SamplingParams, load_model
from pagedjax.parallel.sharding import kv_bytes_per_block_per_device


def multi_turn(rng, args, vocab) -> list[list[int]]:
    """Every session's turns in send order: turn t of every session before turn t + 1 of
    any; a turn's prompt is the session's whole history (its outputs appended at run time)."""
    firsts = [rng.integers(0, vocab, args.first_turn).tolist() for _ in range(args.sessions)]
    return [(s, t, firsts[s] if t == 0 else rng.integers(0, vocab, args.next_turn).tolist())
            for t in range(args.turns) for s in range(args.sessions)]


def rag(rng, args, vocab) -> list[list[int]]:
    """Each document asked --asks times, documents in a shuffled order every round."""
    docs = [rng.integers(0, vocab, args.doc_len).tolist() for _ in range(args.docs)]
    prompts = []
    for _ in range(args.asks):
        for d in rng.permutation(args.docs):
            prompts.append(docs[d] + rng.integers(0, vocab, args.question).tolist())
    return prompts


def drive(engine: LLMEngine, prompts, concurrency: int, max_tokens: int,
          sessions: bool = False) -> dict:
    """Closed loop over prompts (or multi-turn pieces, sessions: (session, turn, new tokens),
    a turn sent once the session's previous turn has finished)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    history: dict[int, list[int]] = {}
    busy: set[int] = set()
    queue = list(prompts)
    owner: dict[str, int] = {}
    ttfts, num_output, start = [], 0, time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and len(owner) < concurrency:
            item = queue[0]
            if sessions:
                session, _, tokens = item
                if session in busy:  # its previous turn is still running: wait for it
                    break
                history[session] = history.get(session, []) + tokens
                prompt, key = history[session], session
                busy.add(session)
            else:
                prompt, key = item, -1
            queue.pop(0)
            owner[engine.add_request(prompt, params)] = key
        for out in engine.step():
            if out.finished:
                ttfts.append(out.metrics.ttft)
                num_output += len(out.output_token_ids)
                key = owner.pop(out.request_id)
                if key >= 0:
                    history[key] = history[key] + out.output_token_ids
                    busy.discard(key)
    elapsed = time.perf_counter() - start
    stats = engine.stats
    queried = max(1, stats.num_prefix_query_tokens)
    disk_tokens = stats.kv_tiers.get("disk", {}).get("hits", 0) * engine.config.block_size
    return {**percentiles(ttfts, "ttft", scale=1.0, unit="s", digits=4),
            "prompt_tokens_computed": stats.num_prompt_tokens_computed,
            "hit_device": round(stats.num_device_hit_tokens / queried, 3),
            "hit_host": round(max(0, stats.num_prefix_host_hit_tokens - disk_tokens) / queried, 3),
            "hit_disk": round(disk_tokens / queried, 3),
            "output_tok_s": round(num_output / elapsed, 1), "seconds": round(elapsed, 2),
            "preemptions": stats.num_preemptions}


def engine_for(model, args, tiers: dict) -> LLMEngine:
    engine = LLMEngine(model, EngineConfig(
        block_size=args.block_size, num_blocks=args.num_blocks,
        max_model_len=min(2048, model.config.max_position_embeddings),
        max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
        **tiers))
    engine.warmup(variants=False)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=129, help="the device pool")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--host-gib", type=float, default=0.5, help="+ host: its size")
    parser.add_argument("--small-host-blocks", type=int, default=32,
                        help="+ host + disk: the host tier's blocks")
    parser.add_argument("--disk-gib", type=float, default=2.0)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-turn", type=int, default=320)
    parser.add_argument("--next-turn", type=int, default=32)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=384)
    parser.add_argument("--question", type=int, default=24)
    parser.add_argument("--asks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="kv_tiers")
    args = parser.parse_args()

    model = load_model(args.model, seed=args.seed)
    vocab = model.config.vocab_size
    block_bytes = kv_bytes_per_block_per_device(model.config, args.block_size, 1, np.float32)
    rows = []
    last_disk = None
    for workload, make, sessions in (("multi-turn", multi_turn, True), ("rag", rag, False)):
        for name in ("device only", "+ host", "+ host + disk"):
            tiers = {}
            if name == "+ host":
                tiers = dict(kv_offload_bytes=int(args.host_gib * 2**30))
            elif name == "+ host + disk":
                last_disk = tempfile.mkdtemp(prefix="kv-tiers-")
                tiers = dict(kv_offload_bytes=args.small_host_blocks * block_bytes,
                             kv_disk_dir=last_disk, kv_disk_bytes=int(args.disk_gib * 2**30))
            engine = engine_for(model, args, tiers)
            prompts = make(np.random.default_rng(args.seed), args, vocab)
            row = {"workload": workload, "tiers": name}
            row.update(drive(engine, prompts, args.concurrency, args.max_tokens, sessions))
            engine.close()
            rows.append(row)
            print(row, flush=True)
        base = rows[-3]["ttft_p50_s"]
        for row in rows[-3:]:
            row["ttft_p50_speedup"] = round(base / row["ttft_p50_s"], 2)
    # restart: the first round of the RAG workload on a new engine over the disk tier the last
    # one wrote (its close() wrote down what it held), against a new engine over an empty one
    first_round = rag(np.random.default_rng(args.seed), args, vocab)[:args.docs]
    for name, directory in (("restart, cold disk", tempfile.mkdtemp(prefix="kv-tiers-")),
                            ("restart, warm disk", last_disk)):
        engine = engine_for(model, args, dict(
            kv_offload_bytes=args.small_host_blocks * block_bytes, kv_disk_dir=directory,
            kv_disk_bytes=int(args.disk_gib * 2**30)))
        row = {"workload": "rag, first round", "tiers": name}
        row.update(drive(engine, first_round, args.concurrency, args.max_tokens))
        engine.close()
        rows.append(row)
        print(row, flush=True)
    rows[-1]["ttft_p50_speedup"] = round(rows[-2]["ttft_p50_s"] / rows[-1]["ttft_p50_s"], 2)
    rows[-2]["ttft_p50_speedup"] = 1.0
    write_results(args.name, "Tiered prefix cache: device only vs + host vs + host + disk",
                  rows, vars(args), notes=__doc__.split("\n\n", 1)[1],
                  reproduce=f".venv/bin/python benchmarks/kv_tiers.py --name {args.name}")


if __name__ == "__main__":
    main()
