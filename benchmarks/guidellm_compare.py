"""Online serving measured by guidellm (vLLM's benchmark tool, unchanged, in its own process)
beside the project's own client, in one run on one server (`serving.py --guidellm`).

guidellm runs its default request type (streamed chat completions, vLLM's continuous usage in
every chunk, ignore_eos) on synthetic prompts in two profiles: concurrent (closed loop, a fixed
number of streams) and sweep (synchronous, throughput, then constant rates between the two
measured rates). After each guidellm benchmark the project's client (httpx, in its own process)
replays that benchmark's very requests, the bodies guidellm sent, with the same schedule: the
same number of streams for the closed-loop strategies (synchronous, concurrent), the recorded
send times for the open-loop ones (throughput, constant rate).

Both measure the same way from the stream: TTFT = send to the first event that brought a token
(the usage's completion_tokens grew), ITL = (last token - first token) / (tokens - 1) per request.
guidellm's values are its own per-request records; the percentiles of both are computed here the
same way. Prefix caching is off: a replay would otherwise find every prompt cached.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import tempfile
import time

import httpx
import numpy as np
from common import percentiles

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer

CLOSED_LOOP = ("synchronous", "concurrent")


def run_guidellm(exe: str, url: str, tokenizer: str, profile: str, args,
                 overrides: tuple[str, ...] = ()) -> list[dict]:
    """guidellm's benchmarks (its JSON report) for one profile."""
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "benchmarks.json")
        command = [exe, "run", "--backend", f"kind=openai_http,target={url},model=bench",
                   "--profile", profile,
                   "--constraint", f"kind=max_requests,count={args.guidellm_requests}",
                   "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                             f"output_tokens={args.output_tokens}",
                   "--tokenizer", f"kind=hf_auto,model={tokenizer}",
                   "--output", f"kind=json,path={path}", "--disable-console", *overrides]
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if result.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"guidellm failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        with open(path) as f:
            return json.load(f)["benchmarks"]


async def own_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed chat completion, timed by this client: a stamp per event whose usage's
    completion_tokens grew."""
    sent = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            usage = json.loads(line[6:]).get("usage") or {}
            if usage.get("completion_tokens", 0) > tokens:
                tokens = usage["completion_tokens"]
                stamps.append(time.perf_counter())
    return {"status": 200, "sent": sent, "done": time.perf_counter(), "tokens": tokens,
            "ttft": stamps[0] - sent if stamps else None,
            "itl": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None}


async def replay(url: str, bodies: list[dict], streams: int | None,
                 offsets: list[float]) -> tuple[list[dict], float]:
    """The bodies sent by `streams` closed-loop workers, or (streams None) each at its offset
    (seconds from the start)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        if streams is None:
            async def at(offset, body):
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                return await own_request(client, url, body)
            results = await asyncio.gather(*(at(o, b) for o, b in zip(offsets, bodies)))
        else:
            queue = list(reversed(bodies))
            results = []

            async def worker():
                while queue:
                    results.append(await own_request(client, url, queue.pop()))
            await asyncio.gather(*(worker() for _ in range(streams)))
        return list(results), time.perf_counter() - start


def replay_main(url, bodies, streams, offsets):
    """The project's client, in its own process."""
    return asyncio.run(replay(url, bodies, streams, offsets))


def strategy_label(strategy: dict) -> tuple[str, int | None]:
    """(a readable name, the closed-loop stream count or None)."""
    kind = strategy["type_"]
    if kind == "synchronous":
        return "synchronous", 1
    if kind == "concurrent":
        return f"concurrent@{strategy['streams']}", strategy["streams"]
    if "rate" in strategy and strategy["rate"]:
        return f"{kind}@{strategy['rate']:.2f} req/s", None
    return kind, None


def compare(profile: str, benchmark: dict, url: str) -> dict:
    """One row: guidellm's measurement of a benchmark and the project client's of its replay."""
    label, streams = strategy_label(benchmark["config"]["strategy"])
    requests = sorted(benchmark["requests"]["successful"] + benchmark["requests"]["errored"],
                      key=lambda r: r["info"]["timings"]["request_start"])
    first = requests[0]["info"]["timings"]["request_start"]
    bodies = [json.loads(r["request_args"])["body"] if isinstance(r["request_args"], str)
              else r["request_args"]["body"] for r in requests]
    offsets = [r["info"]["timings"]["request_start"] - first for r in requests]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        own, seconds = pool.apply(replay_main, (url, bodies, streams, offsets))
    served = [r for r in own if r["status"] == 200]
    theirs = benchmark["requests"]["successful"]
    row = {"profile": profile, "strategy": label, "requests": len(requests),
           "guidellm_ok": len(theirs), "own_ok": len(served),
           "guidellm_output_tok_s": sum(r["output_tokens"] for r in theirs)
           / benchmark["duration"],
           "own_output_tok_s": sum(r["tokens"] for r in served) / seconds}
    for key, theirs_key in (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms")):
        mine = percentiles([r[key] for r in served], f"own_{key}")
        guide = percentiles([r[theirs_key] for r in theirs], f"guidellm_{key}", scale=1.0)
        row.update(guide)
        row.update(mine)
        row[f"{key}_p50_own_vs_guidellm"] = round(
            mine[f"own_{key}_p50_ms"] / guide[f"guidellm_{key}_p50_ms"], 3)
    return row


def run(args, model: str, engine_kwargs: dict) -> tuple[list[dict], dict]:
    """The rows and parameters of the comparison (serving.py --guidellm)."""
    llm = LLM(model, **{**engine_kwargs, "enable_prefix_caching": False})
    config = llm.engine.config
    if llm.tokenizer is None:
        raise SystemExit(f"--guidellm needs a model with a tokenizer (guidellm sends text); "
                         f"{model} has none")
    llm.engine.warmup()
    rows = []
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        tokenizer = llm.tokenizer.save_pretrained(tokenizer_dir)
        server = OpenAIServer(llm.engine, "bench")
        with BackgroundServer(server.build_app()) as url:
            streams = ",".join(str(s) for s in args.guidellm_streams)
            profiles = [("concurrent", "kind=concurrent,streams=1",
                         ("--override", "profile.streams", streams)),
                        ("sweep", f"kind=sweep,sweep_size={args.sweep_size}", ())]
            for name, profile, overrides in profiles:
                for benchmark in run_guidellm(args.guidellm, url, tokenizer, profile, args,
                                              overrides):
                    rows.append(compare(name, benchmark, url))
                    print(rows[-1], flush=True)
    ratios = [r[f"{k}_p50_own_vs_guidellm"] for r in rows for k in ("ttft", "itl")]
    params = {"model": os.path.basename(model), "guidellm_requests": args.guidellm_requests,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "guidellm_streams": args.guidellm_streams, "sweep_size": args.sweep_size,
              "max_num_seqs": config.max_num_seqs,
              "max_num_batched_tokens": config.max_num_batched_tokens,
              "enable_prefix_caching": config.enable_prefix_caching,
              "p50_ratio_range": [float(np.min(ratios)), float(np.max(ratios))]}
    return rows, params
