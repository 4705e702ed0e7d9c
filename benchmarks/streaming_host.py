"""One streamed request of --tokens output tokens: the host time each token costs, early in the
output against late in it (issue 72's target: a streamed request of L tokens does O(L) host work
in all, so the last 256 tokens cost what the first 256 do, within 10%).

Per decode step (one token of the one request), timed around the engine's own calls:
- engine_host: LLMEngine.step's wall time less its device time (block_until_ready on the
  forward's and the sampler's outputs, as benchmarks/host_path.py instruments them): scheduling,
  the plan, the step's outputs (RequestOutput.from_samples);
- server: the server's streaming rule over that output (serving.streaming.DeltaTracker: what is
  news for the client);
- core_channel: what the engine core process adds when the engine runs in a process of its own
  (frontend.output_deltas: DeltaEncoder on the core's side, pickling as its channel does, the
  unpickling and DeltaDecoder on the server's side), timed in one process.

Rows: each part's p50 / p95 / p99 in microseconds over the first --window tokens and over the
last --window, and late / early of the p50s (1.0: flat; above it, host work that grows with the
output's length).
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import time

import numpy as np
from common import write_results
from host_path import instrument

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.frontend.output_deltas import DeltaDecoder, DeltaEncoder
from pagedjax.models import get_config, init_model
from pagedjax.serving.streaming import DeltaTracker
from pagedjax.text.tokenizer import ByteTokenizer

PARTS = ("engine_host", "server", "core_channel")


def stream(tokens: int, prompt_len: int, logprobs: int | None) -> dict[str, list[float]]:
    """Seconds each part took at each decode step of one request's output."""
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257,
                                 max_position_embeddings=prompt_len + tokens + 64)
    engine = LLMEngine(init_model(config, seed=0), EngineConfig(
        max_model_len=prompt_len + tokens + 64, max_num_seqs=1, max_num_batched_tokens=256,
        block_size=16, max_logprobs=5), tokenizer=ByteTokenizer())
    times: dict[str, list[float]] = {p: [] for p in ("schedule", "build_plan", "dispatch",
                                                    "device", "fetch", "forward", "sample")}
    engine.warmup()  # every program compiled first: no token waits on a compile
    instrument(engine, times)
    engine.add_request(list(range(3, 3 + prompt_len)), SamplingParams(
        max_tokens=tokens, temperature=0.8, seed=1, ignore_eos=True, logprobs=logprobs))
    tracker, encoder, decoder = DeltaTracker(logprobs is not None), DeltaEncoder(), DeltaDecoder()
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    for _ in range(10 * tokens):
        if not engine.has_unfinished():
            break
        for phase in times:
            times[phase].append(0.0)
        start = time.perf_counter()
        outputs = engine.step()
        total = time.perf_counter() - start
        if engine.last_schedule.kind != "decode":
            continue  # the prompt
        (out,) = outputs
        start = time.perf_counter()
        tracker.advance(0, out.outputs[0])
        server = time.perf_counter() - start
        start = time.perf_counter()
        decoder.decode(pickle.loads(pickle.dumps(encoder.encode(out))))
        parts["core_channel"].append(time.perf_counter() - start)
        parts["engine_host"].append(total - times["device"][-1])
        parts["server"].append(server)
    return parts


def rows_of(parts: dict[str, list[float]], window: int, label: str) -> list[dict]:
    rows = []
    for part, values in parts.items():
        us = 1e6 * np.asarray(values)
        row: dict = {"outputs": label, "part": part}
        for name, chunk in (("early", us[:window]), ("late", us[-window:])):
            for q in (50, 95, 99):
                row[f"{name}_us_p{q}"] = round(float(np.percentile(chunk, q)), 1)
        row["late_vs_early_p50"] = round(row["late_us_p50"] / row["early_us_p50"], 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    rows = []
    for logprobs, label in ((None, "text"), (5, "text + 5 logprobs")):
        rows += rows_of(stream(args.tokens, args.prompt_len, logprobs), args.window, label)
        print(rows[-3:], flush=True)
    write_results("streaming_host", f"Host time per streamed token: the first {args.window} "
                  f"vs the last {args.window} of {args.tokens}", rows, vars(args),
                  __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
