"""Prefix caching on vs off: a shared-system-prompt workload and a multi-turn workload.

Both run online: requests arrive at a fixed rate (system prompt) or as soon as the previous turn
of their conversation has finished (multi-turn), against an engine warmed up beforehand, so TTFT
is queueing + prefill of what the cache did not hold. Same model, pool, arrivals and seeds on
both sides; hit ratio = prompt tokens served from the cache / prompt tokens (first admissions).
"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np
from common import percentiles, write_results

from pagedjax import EngineConfig, LLMEngine, SamplingParams, load_model


def system_prompt_sessions(rng, args, vocab):
    """Single-turn sessions; 90% start with the same system prompt."""
    system = rng.integers(0, vocab, args.system_len).tolist()
    sessions = []
    for _ in range(args.num_requests):
        user = rng.integers(0, vocab, int(rng.integers(16, 96))).tolist()
        head = system if rng.random() < args.share else rng.integers(
            0, vocab, args.system_len).tolist()
        sessions.append([head + user])
    arrivals = [i / args.rate for i in range(args.num_requests)]
    return sessions, arrivals


def multi_turn_sessions(rng, args, vocab):
    """Conversations whose every turn resends the whole history plus a new user message."""
    sessions = []
    for _ in range(args.num_conversations):
        first = rng.integers(0, vocab, args.system_len // 2).tolist()
        turns = [first] + [rng.integers(0, vocab, int(rng.integers(16, 64))).tolist()
                           for _ in range(args.num_turns - 1)]
        sessions.append(turns)
    arrivals = [i / args.rate for i in range(args.num_conversations)]
    return sessions, arrivals


def drive(engine: LLMEngine, sessions, arrivals, max_tokens: int) -> dict:
    """Runs the sessions online; a session's next turn arrives when its last one finishes."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    history = [[] for _ in sessions]
    next_turn = [0] * len(sessions)
    owner: dict[str, int] = {}
    start = time.perf_counter()
    pending = [(t, i) for i, t in enumerate(arrivals)]
    heapq.heapify(pending)
    ttfts, num_output = [], 0
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrival, i = heapq.heappop(pending)
            history[i] = history[i] + sessions[i][next_turn[i]]
            next_turn[i] += 1
            owner[engine.add_request(history[i], params, arrival_time=start + arrival)] = i
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            ttfts.append(out.metrics.ttft)
            num_output += len(out.output_token_ids)
            i = owner.pop(out.request_id)
            history[i] = history[i] + out.output_token_ids
            if next_turn[i] < len(sessions[i]):
                heapq.heappush(pending, (time.perf_counter() - start, i))
    elapsed = time.perf_counter() - start
    stats = engine.stats
    return {**percentiles(ttfts, "ttft", scale=1.0, unit="s", digits=4),
            "output_tokens_per_s": num_output / elapsed, "seconds": elapsed,
            "hit_ratio": stats.prefix_hit_rate, "evictions": stats.num_evictions,
            "prefill_tokens_computed": stats.num_scheduled_tokens - stats.num_generated_tokens
            + len(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--share", type=float, default=0.9)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = load_model(args.model, seed=args.seed)
    vocab = model.config.vocab_size
    config = dict(block_size=16, num_blocks=args.num_blocks, max_model_len=2048,
                  max_num_seqs=16, max_num_batched_tokens=512, min_token_bucket=64,
                  min_seq_bucket=4)
    rows = []
    for workload, make in (("shared system prompt", system_prompt_sessions),
                           ("multi-turn", multi_turn_sessions)):
        for caching in (False, True):
            sessions, arrivals = make(np.random.default_rng(args.seed), args, vocab)
            engine = LLMEngine(model, EngineConfig(enable_prefix_caching=caching, **config))
            engine.warmup()  # compiles outside the timed run (shared by both sides)
            row = {"workload": workload, "prefix_caching": "on" if caching else "off"}
            row.update(drive(engine, sessions, arrivals, args.max_tokens))
            rows.append(row)
            print(row, flush=True)
        off, on = rows[-2], rows[-1]
        on["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
        off["ttft_p50_speedup"] = 1.0
    write_results("prefix_caching", "Prefix caching on vs off", rows, vars(args),
                  notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
