"""Where a decode step's wall time goes, at batch 32 and 256: the engine's own step, timed phase
by phase on a small model (so that the host path is visible beside the device time).

Phases of LLMEngine.step (each timed around the engine's own call):
- schedule: Scheduler.schedule;
- build_plan: the padded BatchPlan (NumPy);
- dispatch: the forward's and the sampler's compiled calls until they return (argument
  transfer, launch; async);
- device: block_until_ready on each one's outputs (the step's compute; on the CPU the XLA
  programs);
- fetch: the sampled arrays to NumPy;
- update: Scheduler.update and the request outputs (the rest of LLMEngine.step): an output
  for every request each step (outputs "every step", what streaming reads), or only for those
  that finished (`step(final_only=True)`, what LLM.generate asks for);
- total: LLMEngine.step end to end; host = total - device.

p50 / p95 / p99 over --steps decode steps with every sequence running.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from common import write_results

import pagedjax.engine.llm_engine as engine_module
from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.engine.runner import PendingStep
from models import get_config, init_model

PHASES = ("schedule", "build_plan", "dispatch", "device", "fetch", "update", "total")


def instrument(engine: LLMEngine, times: dict) -> None:
    """Wraps the engine's phases (this engine's objects, and build_plan in its module) so each
    call adds its seconds to times[phase][-1]."""
    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[phase][-1] += time.perf_counter() - start
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine_module.build_plan = timed("build_plan", engine_module.build_plan)
    runner = engine.runner

    forward, sampler = runner.dispatch_forward, runner.dispatch_sample

    def dispatch_forward(plan):
        start = time.perf_counter()
        logits = forward(plan)
        dispatched = time.perf_counter()
        jax.block_until_ready(logits)
        times["dispatch"][-1] += dispatched - start
        times["device"][-1] += time.perf_counter() - dispatched
        return logits

    def dispatch_sample(plan, logits, token_mask=None):
        start = time.perf_counter()
        pending = sampler(plan, logits, token_mask)
        dispatched = time.perf_counter()
        jax.block_until_ready(pending.sampled)
        ready = time.perf_counter()
        out = tuple(np.asarray(x)[:pending.num_seqs] for x in pending.sampled)
        times["dispatch"][-1] += dispatched - start
        times["device"][-1] += ready - dispatched
        times["fetch"][-1] += time.perf_counter() - ready
        return PendingStep(out, pending.num_seqs)  # fetch() has nothing left to wait for

    runner.dispatch_forward, runner.dispatch_sample = dispatch_forward, dispatch_sample


def measure(num_seqs: int, final_only: bool, *, steps: int, prompt_len: int, model) -> dict:
    max_model_len = prompt_len + steps + 64
    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(num_seqs, 512), min_seq_bucket=num_seqs,
                          max_logprobs=0)
    engine = LLMEngine(model, config)
    rng = np.random.default_rng(0)
    for _ in range(num_seqs):
        engine.add_request(rng.integers(0, model.config.vocab_size, prompt_len).tolist(),
                           SamplingParams(max_tokens=steps + 48, temperature=0.7, top_k=50,
                                          ignore_eos=True))
    full = 0
    for _ in range(10_000):  # prefills, until three steps decode every sequence
        engine.step()
        schedule = engine.last_schedule
        full = full + 1 if schedule.kind == "decode" and len(schedule.scheduled) == num_seqs \
            else 0
        if full == 3:
            break
    times = {phase: [] for phase in PHASES}
    instrument(engine, times)
    for _ in range(steps):
        for phase in PHASES:
            times[phase].append(0.0)
        start = time.perf_counter()
        engine.step(final_only=final_only)
        times["total"][-1] = time.perf_counter() - start
        schedule = engine.last_schedule
        assert schedule.kind == "decode" and len(schedule.scheduled) == num_seqs, (
            schedule.kind, len(schedule.scheduled))
    phase_sum = sum(np.array(times[p]) for p in PHASES[:-1])
    times["update"] = list(np.array(times["total"]) - phase_sum)  # the rest of the step
    host = np.array(times["total"]) - np.array(times["device"])
    row = {"batch": num_seqs, "outputs": "final only" if final_only else "every step"}
    for phase, values in [*times.items(), ("host", host)]:
        ms = 1000 * np.asarray(values)
        row[f"{phase}_ms_p50"] = round(float(np.percentile(ms, 50)), 3)
        if phase in ("total", "host"):
            row[f"{phase}_ms_p95"] = round(float(np.percentile(ms, 95)), 3)
            row[f"{phase}_ms_p99"] = round(float(np.percentile(ms, 99)), 3)
    row["host_share"] = round(float(np.median(host / np.array(times["total"]))), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="debug-tiny", help="a models.CONFIGS name")
    parser.add_argument("--batches", default="32,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--name", default="host_path",
                        help="the results' file name under benchmarks/results/")
    args = parser.parse_args()
    model = init_model(get_config(args.model))
    rows = []
    for batch in map(int, args.batches.split(",")):
        for final_only in (False, True):
            rows.append(measure(batch, final_only, steps=args.steps, prompt_len=args.prompt_len,
                                model=model))
            print(rows[-1], flush=True)
    write_results(args.name, "Decode step, phase by phase (host path vs device)", rows,
                  vars(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
