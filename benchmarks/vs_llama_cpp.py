"""`pagedjax serve` against llama.cpp's `llama-server` on this machine, one server at a time.

The same model (SmolLM2-135M-Instruct's Q4_1 GGUF), the same client and the same requests:
streamed /v1/completions, greedy, `ignore_eos`, unique text prompts (no prefix shared between
requests, so neither server's prompt cache helps), seeded output lengths (log-normal, mean ~110
tokens, 16..256). A closed loop of C clients keeps C requests in flight, at C = 1, 8 and 32.

Servers, in rounds (A B C ... A B C ...: drift on a shared machine hits each alike):

- llama-server: built by `make llama-server` from the llama.cpp that llama-cpp-python 0.3.36
  vendors, `-np 8 -cb -t 2 -c 8192` (8 slots of 1,024 tokens, continuous batching, 2 threads);
  it runs the GGUF's own Q4_1 kernels.
- pagedjax gguf Q4_1 (process): `pagedjax serve GGUF`: the file's own blocks (Q4_1 layers as
  int4 with offsets, the Q8_0 embedding as int8), the engine core in its own process (the
  default).
- pagedjax f32 (process): the GGUF dequantized to f32 once (an orbax checkpoint under build/,
  its tokenizer saved beside it), served as f32.
- pagedjax f32 (thread): the same with `--engine-core thread` (the engine on a thread of the
  server's process: what the engine core's process changes).
- pagedjax int8 (process): that f32 checkpoint with `-q int8` (weight-only int8, per-channel
  scales).

pagedjax runs with `--warmup` and a compilation cache under build/ (its first start compiles
every step program; later ones load them), `--max-model-len 1024 --max-num-seqs 32`. Before each
measured concurrency, an unmeasured pass of short requests at that concurrency warms both
servers. Reported per server and concurrency: output tok/s over the run's span (all requests'
tokens / first send to last end), per-request output tok/s at C = 1, TTFT and TPOT p50/p95/p99
(from each stream's event times), the resident memory of the server's processes after the run,
and seconds from start to /health ready; ratio = pagedjax's tok/s / llama-server's of the same
round.

    make llama-server   # once: builds build/llama.cpp/build/bin/llama-server
    .venv/bin/python benchmarks/vs_llama_cpp.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from common import ROOT, percentiles, write_results

LLAMA_SERVER = ROOT.parent / "build/llama.cpp/build/bin/llama-server"
CACHE = ROOT.parent / "build/vs_llama_cpp_compile_cache"
LOGS = ROOT.parent / "build/vs_llama_cpp_logs"
TOPICS = ("the history of paper", "how bridges carry weight", "why the sea is salty",
          "what makes bread rise", "how a compass works", "the life of bees",
          "how rain forms", "why leaves change colour")


def servers(gguf: str, f32: str, tokenizer: str) -> dict[str, list[str]]:
    """name -> the command serving on port {port}: gguf's blocks, or its f32 copy (orbax, with
    the GGUF's tokenizer saved beside it)."""
    def ours(model: str, *flags: str) -> list[str]:
        return [sys.executable, "-m", "pagedjax.tools.cli", "serve", model, "--port", "{port}",
                "--served-model-name", "m", "--max-model-len", "1024", "--max-num-seqs", "32",
                "--warmup", "--compilation-cache", str(CACHE), "--log-level", "warning",
                *flags]

    return {
        "llama-server": [str(LLAMA_SERVER), "-m", gguf, "--port", "{port}", "--host",
                         "127.0.0.1", "-np", "8", "-cb", "-t", "2", "-c", "8192"],
        "pagedjax gguf Q4_1 (process)": ours(gguf),
        "pagedjax f32 (process)": ours(f32, "--tokenizer", tokenizer),
        "pagedjax f32 (thread)": ours(f32, "--tokenizer", tokenizer, "--engine-core", "thread"),
        "pagedjax int8 (process)": ours(f32, "--tokenizer", tokenizer, "-q", "int8"),
    }


def f32_copy(gguf: str) -> tuple[str, str]:
    """The GGUF dequantized to f32 as an orbax checkpoint, and its tokenizer as a directory,
    under build/ (written once)."""
    from pagedjax.models.loading.checkpoint import is_checkpoint, save_checkpoint
    from pagedjax.models.loading.gguf import load_gguf_model, metadata, open_gguf
    from pagedjax.text.gguf_tokenizer import tokenizer_from_gguf

    stem = pathlib.Path(gguf).stem
    model_dir = ROOT.parent / "build" / f"{stem}-f32"
    tokenizer_dir = ROOT.parent / "build" / f"{stem}-tokenizer"
    if not is_checkpoint(str(model_dir)):
        save_checkpoint(load_gguf_model(gguf), str(model_dir), {"from": os.path.basename(gguf)})
    if not (tokenizer_dir / "tokenizer.json").exists():
        tokenizer_from_gguf(metadata(open_gguf(gguf)), gguf).save_pretrained(tokenizer_dir)
    return str(model_dir), str(tokenizer_dir)


def workload(count: int, seed: int) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(100), 0.5, count), 16, 256).astype(int)
    return [(f"Request {seed}-{i}. Write a short essay about {TOPICS[i % len(TOPICS)]}.",
             int(n)) for i, n in enumerate(lengths)]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, stamps, usage = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            if any(choice.get("text") for choice in data.get("choices") or ()):
                stamps.append(time.perf_counter())
    tokens = (usage or {}).get("completion_tokens") or len(stamps)
    return {"sent": sent, "done": time.perf_counter(), "stamps": stamps, "tokens": tokens}


async def closed_loop(url: str, requests: list[tuple[str, int]], concurrency: int) -> list:
    queue = list(reversed(requests))
    results = []

    async def worker(client):
        while queue:
            prompt, max_tokens = queue.pop()
            results.append(await one_request(client, url, prompt, max_tokens))

    # A connection a request: a kept-alive one that the server closes as the next request
    # goes out fails it ("disconnected without sending a response"; llama-server at 32 did).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


def summarize(results: list[dict], concurrency: int) -> dict:
    span = max(r["done"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["stamps"][0] - r["sent"] for r in results if r["stamps"]]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in results
            if len(r["stamps"]) > 1 and r["tokens"] > 1]
    row = {"concurrency": concurrency, "requests": len(results), "output_tokens": tokens,
           "output_tok_s": round(tokens / span, 2)}
    if concurrency == 1:
        row["per_request_tok_s"] = round(float(np.median(
            [r["tokens"] / (r["done"] - r["sent"]) for r in results])), 2)
    row.update(percentiles(ttft, "ttft"))
    row.update(percentiles(tpot, "tpot"))
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], timeout_s: float, log: pathlib.Path
          ) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    began = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:  # the server's own output, for a run that fails
        proc = subprocess.Popen([c.replace("{port}", str(port)) for c in command],
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - began
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{command[0]} not ready within {timeout_s:g} s")


def resident_mb(proc: subprocess.Popen) -> float:
    import psutil

    root = psutil.Process(proc.pid)
    return round(sum(p.memory_info().rss for p in [root] + root.children(recursive=True))
                 / 2**20, 1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def measure(name: str, command: list[str], plan: dict[int, int], seed: int,
            round_index: int) -> list[dict]:
    log = LOGS / f"{name.replace(' ', '_').replace('(', '').replace(')', '')}-{round_index}.log"
    try:
        proc, url, ready_s = start(command, 1800, log)
    except RuntimeError as e:  # recorded, and the other servers measured
        print(f"{name}: {e} (its output: {log})", flush=True)
        return [{"server": name, "round": round_index, "error": str(e)}]
    rows = []
    try:
        for concurrency, count in plan.items():
            warm = [(f"warm {i}", 8) for i in range(concurrency)]
            try:
                asyncio.run(closed_loop(url, warm, concurrency))
                results = asyncio.run(closed_loop(url, workload(count, seed + concurrency),
                                                  concurrency))
            except (httpx.HTTPError, RuntimeError) as e:
                print(f"{name} at {concurrency}: {e!r} (its output: {log})", flush=True)
                rows.append({"server": name, "round": round_index,
                             "concurrency": concurrency, "error": repr(e)})
                break
            row = {"server": name, "round": round_index, "ready_s": round(ready_s, 1),
                   **summarize(results, concurrency), "rss_mb": resident_mb(proc)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        stop(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plan", default="1:4,8:32,32:64",
                        help="concurrency:requests pairs, measured in this order")
    parser.add_argument("--servers", default=None,
                        help="comma-separated names (default: all of them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="vs_llama_cpp")
    args = parser.parse_args()
    from pagedjax.tools.chat_demo import smollm2_path

    gguf = args.gguf or smollm2_path()
    if gguf is None:
        sys.exit("no GGUF: give --gguf (make demo installs SmolLM2's)")
    plan = {int(c): int(n) for c, n in (pair.split(":") for pair in args.plan.split(","))}
    commands = servers(gguf, *f32_copy(gguf))
    names = args.servers.split(",") if args.servers else list(commands)
    if "llama-server" in names and not LLAMA_SERVER.exists():
        sys.exit(f"{LLAMA_SERVER} is missing: run `make llama-server` first")
    rows = []
    for round_index in range(args.rounds):
        for name in names:
            rows += measure(name, commands[name], plan, args.seed, round_index)
    for row in rows:
        base = [r for r in rows if r["server"] == "llama-server" and "error" not in r
                and r["round"] == row["round"] and r.get("concurrency") == row.get("concurrency")]
        if base and "error" not in row:
            row["ratio_vs_llama_server"] = round(row["output_tok_s"] / base[0]["output_tok_s"], 3)
    write_results(args.name, "pagedjax serve vs llama.cpp's llama-server (SmolLM2-135M Q4_1 "
                  "GGUF, this machine)", rows, {**vars(args), "gguf": os.path.basename(gguf)},
                  notes=NOTES, reproduce="make llama-server && .venv/bin/python "
                  "benchmarks/vs_llama_cpp.py")


NOTES = """
One machine (2 cores) runs the client and one server at a time. llama-server computes with its
Q4_1 kernels on 2 threads; pagedjax's "f32" dequantizes the GGUF to f32 (XLA's CPU matmuls),
"int8" quantizes it to int8 with per-channel scales. TPOT is per request, (last token - first
token) / (tokens - 1); TTFT from the send to the first token's event. ready_s includes
pagedjax's --warmup (its first start compiles every program into build/'s cache; later starts
load them).
"""

if __name__ == "__main__":
    main()
