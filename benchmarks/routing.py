"""KV-aware routing across two server instances vs round robin and least loaded.

Two `pagedjax serve` instances of the embedded model (each its own engine and KV pool, sized to
hold about half of the workload's shared contexts) behind `pagedjax router`, one run per policy.
The workload: C shared contexts (documents of a few hundred tokens) with Q questions each, in a
seeded shuffled order, sent at a steady Poisson rate, streamed, greedy. Each policy gets fresh
contexts of the same lengths (so no run inherits another's cache) and the same arrival times.

Measured: the prompt tokens the instances found in their prefix caches (from their /metrics),
prompt tokens computed, TTFT percentiles and the run's output tokens/s, with ratios against round
robin in the same run. Client, router, both servers and both engines share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import numpy as np
from common import percentiles, stream_completion, write_results
from prometheus_client.parser import text_string_to_metric_families

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer
from pagedjax.serving.router import POLICIES, Router


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.endswith("_total")}


async def one_request(client, url, prompt, max_tokens, at, start) -> dict:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    r = await stream_completion(client, url, {"prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})
    assert r["status"] == 200, r
    return {"ttft": r["stamps"][0] - r["sent"], "tokens": r["tokens"]}


async def run_load(url, prompts, max_tokens, arrivals):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, p, max_tokens, at, start)
                                         for p, at in zip(prompts, arrivals)))
        return results, time.perf_counter() - start


def workload(rng, contexts: int, questions: int, context_chars: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    docs = ["".join(rng.choice(letters, context_chars)) for _ in range(contexts)]
    prompts = [f"{doc}\nq{j}: copy:{j:02d}=" for doc in docs for j in range(questions)]
    return [prompts[i] for i in rng.permutation(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, default=12)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--context-chars", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=161,
                        help="per instance: ~6 of the 12 contexts (25 blocks each)")
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    engine_config = dict(max_model_len=512, block_size=16, num_blocks=args.num_blocks,
                         max_num_seqs=16, max_num_batched_tokens=512, seed=args.seed)
    llms = [LLM(**engine_config) for _ in range(2)]
    for llm in llms:
        llm.engine.warmup()
    servers = [OpenAIServer(llm.engine, "tiny") for llm in llms]
    num_requests = args.contexts * args.questions
    arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1 / args.rate,
                                                                      num_requests))
    rows = []
    with BackgroundServer(servers[0].build_app()) as a, \
            BackgroundServer(servers[1].build_app()) as b:
        for i, policy in enumerate(["round_robin", "least_loaded", "kv_aware"]):
            assert policy in POLICIES
            prompts = workload(np.random.default_rng(args.seed + 1 + i), args.contexts,
                               args.questions, args.context_chars)
            before = [counters(u) for u in (a, b)]
            with BackgroundServer(Router([a, b], policy).build_app()) as url:
                results, seconds = asyncio.run(run_load(url, prompts, args.max_tokens,
                                                        arrivals))
            after = [counters(u) for u in (a, b)]

            def delta(name, after=after, before=before):
                return sum(x[name] - y.get(name, 0) for x, y in zip(after, before))

            prompt_tokens = delta("pagedjax:prefix_cache_queries_total")
            hits = delta("pagedjax:prefix_cache_hits_total")
            ttft = [r["ttft"] * 1e3 for r in results]
            rows.append({
                "policy": policy, "requests": len(results), "seconds": seconds,
                "prompt_tokens": int(prompt_tokens), "prefix_hit_tokens": int(hits),
                "hit_rate": hits / prompt_tokens,
                "computed_prompt_tokens": int(prompt_tokens - hits),
                "preemptions": int(delta("pagedjax:num_preemptions_total")),
                **percentiles(ttft, "ttft", scale=1.0),
                "output_tokens_per_s": sum(r["tokens"] for r in results) / seconds})
    base = rows[0]
    for row in rows:
        row["computed_vs_round_robin"] = (row["computed_prompt_tokens"]
                                          / base["computed_prompt_tokens"])
        row["ttft_p50_vs_round_robin"] = row["ttft_p50_ms"] / base["ttft_p50_ms"]
    write_results("routing", "KV-aware routing across two instances", rows,
                  {**vars(args), "instances": 2, "requests": num_requests,
                   "engine": engine_config}, __doc__.split("\n", 2)[2])


if __name__ == "__main__":
    main()
