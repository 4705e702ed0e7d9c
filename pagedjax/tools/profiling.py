"""Workload profiling and capacity planning: run a trace on the real engine, fit the
simulator's step-time model to it, and predict other configurations with scheduler.simulator.

    engine.warmup()
    measured, samples = run_trace(engine, trace)        # the real thing, step by step
    cost = StepCostModel.fit(samples)                    # seconds(step kind, T, B, kv tokens)
    predicted = simulate(trace, config..., cost=cost)    # milliseconds, no device
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import RequestOutput
from pagedjax.scheduler import SamplingParams
from pagedjax.scheduler.cost_model import step_features
from pagedjax.scheduler.simulator import SimResult
from pagedjax.scheduler.trace import TraceRequest


def generating_engine(engine) -> LLMEngine:
    """engine, which run_trace profiles: one generating engine (not a data-parallel group or a
    BERT-like encoder); ValueError otherwise."""
    if not isinstance(engine, LLMEngine):
        raise ValueError(f"profiling runs one generating engine (data_parallel_size 1), got "
                         f"{type(engine).__name__}")
    return engine


def run_trace(engine: LLMEngine, trace: Sequence[TraceRequest]
              ) -> tuple[SimResult, list[tuple[str, np.ndarray, float]]]:
    """Serves the trace on the engine in real time (each request added once its arrival_s has
    passed), outputs forced to their recorded length. Returns what happened, in the simulator's
    terms, and every step's (kind, features, seconds of LLMEngine.step)."""
    if engine.has_unfinished():
        raise ValueError("run_trace needs an idle engine")
    vocab = engine.model_config.vocab_size
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    stats = engine.stats
    before = (stats.num_steps, stats.num_prefill_steps, stats.num_preemptions,
              stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens)
    ids: dict[str, int] = {}
    finals: dict[int, RequestOutput] = {}
    samples, peak, tokens = [], 0, 0
    start = time.perf_counter()
    next_arrival = 0
    while next_arrival < len(order) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_arrival < len(order) and trace[order[next_arrival]].arrival_s <= now:
            i = order[next_arrival]
            r = trace[i]
            params = SamplingParams(max_tokens=r.output_len, n=r.n, temperature=0.0,
                                    ignore_eos=True, seed=i)
            rid = engine.add_request(r.prompt_token_ids(i, vocab), params,
                                     arrival_time=start + r.arrival_s)
            ids[rid] = i
            next_arrival += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, trace[order[next_arrival]].arrival_s
                           - (time.perf_counter() - start)))
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t0
        schedule = engine.last_schedule
        if schedule is None:
            raise RuntimeError("a step ran without a schedule")
        kind, features = step_features(schedule, engine.buckets, engine.layer_windows)
        samples.append((kind, features, seconds))
        peak = max(peak, engine.scheduler.kv_manager.num_used_blocks)
        for out in outputs:
            if isinstance(out, RequestOutput) and out.finished:
                finals[ids[out.request_id]] = out
    tokens = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    outs = [finals[i] for i in range(len(trace))]
    after = (stats.num_steps, stats.num_prefill_steps, stats.num_preemptions,
             stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens)
    steps, prefill_steps, preemptions, queried, hits = (a - b for a, b in zip(after, before))
    result = SimResult.from_timings(
        [o.metrics.arrival_time for o in outs], [o.metrics.first_token_time for o in outs],
        [o.metrics.finish_time for o in outs],
        [max(len(c.token_ids) for c in o.outputs) for o in outs], num_steps=steps,
        num_prefill_steps=prefill_steps, num_preemptions=preemptions, output_tokens=tokens,
        peak_used_blocks=peak, prefix_queried=queried, prefix_hits=hits)
    return result, samples
