"""Where a decode step's wall time goes, at batch 32 and 256: the engine's own step, timed phase
by phase on a small model (so that the host path is visible beside the device time).

Phases of LLMEngine.step (each timed around the engine's own call):
- schedule: Scheduler.schedule;
- build_plan: the padded BatchPlan (NumPy);
- dispatch: the forward's and the sampler's compiled calls until they return (argument
  transfer, launch; async);
- device: block_until_ready on each one's outputs (the step's compute; on the CPU the XLA
  programs): forward (the model's program) and sample (the sampler's);
- fetch: the sampled arrays to NumPy;
- update: Scheduler.update and the request outputs (the rest of LLMEngine.step): an output
  for every request each step (outputs "every step", what streaming reads), or only for those
  that finished (`step(final_only=True)`, what LLM.generate asks for);
- total: LLMEngine.step end to end; host = total - device.

p50 / p95 / p99 over --steps decode steps with every sequence running. matmul_ms_p50 is the
roofline the forward is held to: the same batch through the decode step's matmuls alone (each
layer's q, k, v, o, gate, up and down projections, scanned over the layers, then the LM head;
f32, the model's shapes, no attention, norms or sampling), one jitted program, timed in the same
run.
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
from pagedjax.models import get_config, init_model

PHASES = ("schedule", "build_plan", "dispatch", "device", "fetch", "update", "total")
DEVICE_PARTS = ("forward", "sample")  # the device time's two programs


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
        times["forward"][-1] += time.perf_counter() - dispatched
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
        times["sample"][-1] += ready - dispatched
        times["fetch"][-1] += time.perf_counter() - ready
        return PendingStep(out, pending.num_seqs)  # fetch() has nothing left to wait for

    runner.dispatch_forward, runner.dispatch_sample = dispatch_forward, dispatch_sample


def matmul_roofline(config, batch: int, steps: int) -> float:
    """p50 seconds of one decode step's matmuls alone at this batch (see the docstring)."""
    import jax.numpy as jnp

    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    key = jax.random.key(0)
    layers = [jax.random.normal(key, (config.num_layers, *s), jnp.float32) * 0.02
              for s in shapes]
    head = jax.random.normal(key, (h, config.vocab_size), jnp.float32) * 0.02

    @jax.jit
    def step(x, layers, head):
        def layer(x, w):
            wq, wk, wv, wo, wg, wu, wd = w
            a = x @ wq + (x @ wk).sum() + (x @ wv).sum()
            x = x + (a @ wo)
            return x + ((x @ wg) * (x @ wu)) @ wd, None
        x, _ = jax.lax.scan(layer, x, layers)
        return x @ head

    x = jnp.ones((batch, h), jnp.float32)
    jax.block_until_ready(step(x, layers, head))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(x, layers, head))
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 50))


def decoding_engine(model, batch: int, *, steps: int, prompt_len: int,
                    **config) -> LLMEngine:
    """An engine decoding `batch` sequences (random prompts of prompt_len tokens, top-k
    sampling, ignore_eos, room for `steps` more steps), stepped through their prefills until
    three steps in a row decode every sequence. config: more EngineConfig fields."""
    config = EngineConfig(max_model_len=prompt_len + steps + 64, max_num_seqs=batch,
                          max_num_batched_tokens=max(batch, 512), min_seq_bucket=batch,
                          max_logprobs=0, **config)
    engine = LLMEngine(model, config)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.add_request(rng.integers(0, model.config.vocab_size, prompt_len).tolist(),
                           SamplingParams(max_tokens=steps + 48, temperature=0.7, top_k=50,
                                          ignore_eos=True))
    full = 0
    for _ in range(10_000):  # prefills, until three steps decode every sequence
        engine.step()
        schedule = engine.last_schedule
        full = full + 1 if schedule.kind == "decode" and len(schedule.scheduled) == batch else 0
        if full == 3:
            break
    return engine


def measure(num_seqs: int, final_only: bool, *, steps: int, prompt_len: int, model,
            roofline_s: float) -> dict:
    engine = decoding_engine(model, num_seqs, steps=steps, prompt_len=prompt_len)
    times = {phase: [] for phase in PHASES + DEVICE_PARTS}
    instrument(engine, times)
    for _ in range(steps):
        for phase in PHASES + DEVICE_PARTS:
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
    row["matmul_ms_p50"] = round(1000 * roofline_s, 3)
    row["forward_vs_matmul"] = round(row["forward_ms_p50"] / row["matmul_ms_p50"], 2)
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
        roofline_s = matmul_roofline(model.config, batch, args.steps)
        for final_only in (False, True):
            rows.append(measure(batch, final_only, steps=args.steps, prompt_len=args.prompt_len,
                                model=model, roofline_s=roofline_s))
            print(rows[-1], flush=True)
    write_results(args.name, "Decode step, phase by phase (host path vs device)", rows,
                  vars(args), __doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
