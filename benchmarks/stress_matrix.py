"""Stress-test matrix: the OpenAI server under closed-loop load, concurrency x prompt length x
output length, with the engine's invariants checked after every cell.

One engine (demo-small, warmed up, a KV pool that cannot hold every cell's peak at once) behind
the server; each cell runs C concurrent clients, each sending its next streamed request as soon
as the last one finished, until the cell's requests are done. Every 7th request of a cell's
clients is abandoned after its first token (a client that disconnects), so aborts happen under
load too. After each cell the engine must be idle with every KV block free, and no step program
may have been compiled since warmup; a cell that breaks either, or has a request fail, is
marked FAIL. Reported per cell: requests served and aborted, errors, output tokens/s, TTFT and
TPOT percentiles, preemptions and the KV peak.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import httpx
import numpy as np
from common import add_engine_flags, engine_config, recorded_args, stream_completion, write_results

from pagedjax import LLMEngine, load_model
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer


async def client_loop(client, url, rng, prompt_len, output_len, count, first_index, vocab):
    results = []
    for k in range(count):
        abandon = (first_index + k) % 7 == 6  # the client goes away after the first token
        body = {"prompt": rng.integers(0, vocab, prompt_len).tolist(), "max_tokens": output_len,
                "temperature": 0, "ignore_eos": True}
        result = await stream_completion(client, url, body, abandon_after_first=abandon)
        results.append({**result, "abandoned": abandon})
    return results


async def run_cell(url, concurrency, prompt_len, output_len, requests, seed, vocab):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    per_client = -(-requests // concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        parts = await asyncio.gather(*(
            client_loop(client, url, np.random.default_rng([seed, c]), prompt_len, output_len,
                        per_client, c * per_client, vocab) for c in range(concurrency)))
        return [r for part in parts for r in part], time.perf_counter() - start


def client_main(*args):
    return asyncio.run(run_cell(*args))


def cell_row(engine, programs: int, before: tuple[int, int], results: list[dict],
             seconds: float, cell: dict) -> dict:
    """One cell's figures (p50/p99 over its served requests) and its check: the engine idle,
    every block back, nothing compiled after warmup, no error and no short output."""
    served = [r for r in results if r["status"] == 200 and not r["abandoned"]]
    errors = sum(r["status"] != 200 for r in results)
    ttft = [(r["stamps"][0] - r["sent"]) * 1e3 for r in served if r["stamps"]]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) * 1e3
            for r in served if len(r["stamps"]) > 1]
    tokens = sum(r["tokens"] for r in results)
    problems = []
    if engine.has_unfinished():
        problems.append("engine not idle")
    if engine.scheduler.kv_manager.num_used_blocks:
        problems.append(f"{engine.scheduler.kv_manager.num_used_blocks} blocks held")
    if engine.num_compiled_programs != programs:
        problems.append("compiled after warmup")
    short = sum(r["tokens"] != cell["output_len"] for r in served)
    if errors or short:
        problems.append(f"{errors} errors, {short} short outputs")
    return {**cell, "served": len(served), "aborted": engine.stats.num_aborted - before[1],
            "errors": errors, "output_tokens_per_s": tokens / seconds,
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)),
            "tpot_p99_ms": float(np.percentile(tpot, 99)),
            "preemptions": engine.stats.num_preemptions - before[0],
            "peak_kv_blocks": engine.stats.peak_used_blocks,
            "check": "PASS" if not problems else "FAIL: " + ", ".join(problems)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--prompt-lens", default="32,384")
    parser.add_argument("--output-lens", default="16,128")
    parser.add_argument("--requests", type=int, default=64, help="per cell")
    add_engine_flags(parser, num_blocks=513, block_size=16, max_model_len=512, max_num_seqs=32,
                     max_num_batched_tokens=512, seed=0)
    args = parser.parse_args()

    config = engine_config(args)
    engine = LLMEngine(load_model(args.model, seed=args.seed), config)
    engine.warmup()
    programs = engine.num_compiled_programs
    vocab = engine.model_config.vocab_size
    server = OpenAIServer(engine, "stress")
    rows = []
    with BackgroundServer(server.build_app()) as url, \
            multiprocessing.get_context("spawn").Pool(1) as pool:
        for concurrency in map(int, args.concurrency.split(",")):
            for prompt_len in map(int, args.prompt_lens.split(",")):
                for output_len in map(int, args.output_lens.split(",")):
                    before = (engine.stats.num_preemptions, engine.stats.num_aborted)
                    engine.stats.peak_used_blocks = 0
                    results, seconds = pool.apply(client_main, (
                        url, concurrency, prompt_len, output_len, args.requests, args.seed,
                        vocab))
                    deadline = time.time() + 30  # aborts land before the engine's next step
                    while engine.has_unfinished() and time.time() < deadline:
                        time.sleep(0.05)
                    rows.append(cell_row(engine, programs, before, results, seconds, {
                        "concurrency": concurrency, "prompt_len": prompt_len,
                        "output_len": output_len}))
                    print(rows[-1], flush=True)
    write_results("stress_matrix", "Stress-test matrix: the server under closed-loop load",
                  rows, {**recorded_args(args), "kv_pool_blocks": args.num_blocks - 1,
                         "step_programs": programs}, __doc__.split("\n", 2)[2])
    failed = [r for r in rows if r["check"] != "PASS"]
    if failed:
        raise SystemExit(f"{len(failed)} cells failed")


if __name__ == "__main__":
    main()
