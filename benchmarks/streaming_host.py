"""One streamed request of --tokens output tokens: the host time each token costs, early in the
output against late in it (issue 72's target: a streamed request of L tokens does O(L) host work
in all, so the last 256 tokens cost what the first 256 do, within 10%), with the request's
outputs CUMULATIVE (every token so far in each: the baseline) and DELTA (what is new since the
last: SamplingParams.output_kind, what the server asks), in the same run.

Per decode step (one token of the one request), timed around the engine's own calls:
- engine_outputs: the step's outputs (StepOutputs.process: the scheduler advanced by the token,
  its detokenization and stop strings, the request's output built);
- engine_host: LLMEngine.step's wall time less its device time (block_until_ready on the
  forward's and the sampler's outputs, as benchmarks/host_path.py instruments them): scheduling,
  the plan, the outputs; it includes waits the instrumentation does not see, so it drifts with
  the context's length on the device too;
- server: the server's streaming rule over that output (serving.streaming.DeltaTracker, which
  reads DELTA outputs: what is news for the client; DELTA rows only);
- core_channel: what the engine core process adds when the engine runs in a process of its own
  (frontend.output_deltas: DeltaEncoder on the core's side, pickling as its channel does, the
  unpickling and DeltaDecoder on the server's side), timed in one process.

Rows: each part's p50 / p95 / p99 in microseconds over the first --window tokens and over the
last --window, and late / early of the p50s (1.0: flat; above it, host work that grows with the
output's length). The early and the late tokens are two engines' streams whose steps alternate,
so that the machine's drift over a run weighs on both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import time

import numpy as np
from common import write_results
from host_path import instrument

from pagedjax import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from pagedjax.frontend.output_deltas import DeltaDecoder, DeltaEncoder
from pagedjax.models import get_config, init_model
from pagedjax.serving.streaming import DeltaTracker
from pagedjax.text.tokenizer import ByteTokenizer

PARTS = ("engine_outputs", "engine_host", "server", "core_channel")


class Stream:
    """One engine streaming one request, each decode step timed by part (PARTS)."""

    def __init__(self, tokens: int, prompt_len: int, logprobs: int | None,
                 kind: RequestOutputKind):
        config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264,
                                     eos_token_id=257,
                                     max_position_embeddings=prompt_len + tokens + 64)
        self.engine = engine = LLMEngine(init_model(config, seed=0), EngineConfig(
            max_model_len=prompt_len + tokens + 64, max_num_seqs=1, max_num_batched_tokens=256,
            block_size=16, max_logprobs=5), tokenizer=ByteTokenizer())
        self.times: dict[str, list[float]] = {p: [0.0] for p in (
            "schedule", "build_plan", "dispatch", "device", "fetch", "forward", "sample")}
        engine.warmup()  # every program compiled first: no token waits on a compile
        instrument(engine, self.times)
        process, self.spent = engine.outputs.process, 0.0

        def timed_process(*args, **kwargs):
            start = time.perf_counter()
            try:
                return process(*args, **kwargs)
            finally:
                self.spent = time.perf_counter() - start

        engine.outputs.process = timed_process  # type: ignore[method-assign]
        request_id = engine.add_request(list(range(3, 3 + prompt_len)), SamplingParams(
            max_tokens=tokens, temperature=0.8, seed=1, ignore_eos=True, logprobs=logprobs,
            output_kind=kind))
        self.delta = kind == RequestOutputKind.DELTA
        self.tracker = DeltaTracker(logprobs is not None)
        self.encoder, self.decoder = DeltaEncoder(), DeltaDecoder()
        if self.delta:
            self.encoder.expect_deltas(request_id)
        while engine.last_schedule is None or engine.last_schedule.kind != "decode":
            engine.step()  # the prompt, then its first decode step

    def step(self) -> dict[str, float]:
        """One step; each part's seconds."""
        for phase in self.times.values():
            phase[-1] = 0.0
        start = time.perf_counter()
        (out,) = self.engine.step()
        total = time.perf_counter() - start
        start = time.perf_counter()
        if self.delta:  # the server's rule reads DELTA outputs
            self.tracker.advance(0, out.outputs[0])
        server = time.perf_counter() - start
        start = time.perf_counter()
        self.decoder.decode(pickle.loads(pickle.dumps(self.encoder.encode(out))))
        parts = {"engine_outputs": self.spent, "engine_host": total - self.times["device"][-1],
                 "server": server, "core_channel": time.perf_counter() - start}
        if not self.delta:
            del parts["server"]
        return parts


def early_and_late(tokens: int, window: int, prompt_len: int, logprobs: int | None,
                   kind: RequestOutputKind) -> tuple[dict, dict]:
    """Each part's seconds over a request's first `window` tokens and over its last `window`
    of `tokens`, the two streams' steps interleaved (early, late, early, ...) so that whatever
    else the machine does weighs on both alike."""
    late = Stream(tokens, prompt_len, logprobs, kind)
    for _ in range(tokens - window - 2):  # two tokens came in Stream(): the last window left
        late.step()
    early = Stream(tokens, prompt_len, logprobs, kind)
    times: tuple[dict, dict] = ({}, {})
    for _ in range(window):
        for stream, into in zip((early, late), times):
            for part, seconds in stream.step().items():
                into.setdefault(part, []).append(seconds)
    return times


def rows_of(early: dict, late: dict, label: str) -> list[dict]:
    rows = []
    for part in early:
        row: dict = {"outputs": label, "part": part}
        for name, values in (("early", early[part]), ("late", late[part])):
            us = 1e6 * np.asarray(values)
            for q in (50, 95, 99):
                row[f"{name}_us_p{q}"] = round(float(np.percentile(us, q)), 1)
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
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        for logprobs, label in ((None, "text"), (5, "text + 5 logprobs")):
            early, late = early_and_late(args.tokens, args.window, args.prompt_len, logprobs,
                                         kind)
            rows += rows_of(early, late, f"{kind.name.lower()}: {label}")
            print(rows[-len(early):], flush=True)
    write_results("streaming_host", f"Host time per streamed token: the first {args.window} "
                  f"vs the last {args.window} of {args.tokens}", rows, vars(args),
                  __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
