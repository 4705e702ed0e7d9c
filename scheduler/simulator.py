"""Replays a workload through the real scheduler against a step-time cost model (no jax, no
device): what TTFT, TPOT, throughput, preemptions and KV usage a configuration would give, in
milliseconds of host time instead of the run itself. Capacity planning sweeps it over pool sizes
and batch limits.

The scheduler is the engine's own (`schedule` / `update` are pure functions of their
arguments), fed requests of the trace's lengths (scheduler.trace) whose outputs are forced to
their recorded length (ignore_eos). Only the step's duration is modelled (scheduler.cost_model):
StepCostModel predicts it from the step's kind and its shape, the padded token count T and
sequence count B the jit program runs, and the KV tokens the step attends;
`pagedjax.tools.profiling.calibrate` fits it to an engine's measured steps. Given the same
arrivals relative to the steps (e.g. all at once), the simulated schedule is the engine's, step
for step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from pagedjax.scheduler.buckets import ShapeBuckets
from pagedjax.scheduler.cost_model import RooflineCost, StepCostModel, step_features
from pagedjax.scheduler.request import Request, SamplingParams, make_samples
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.state import PREFILL, SchedulerConfig
from pagedjax.scheduler.trace import TraceRequest

Placement = Callable[[Sequence[int], list[int]], int]


@dataclasses.dataclass(frozen=True)
class SimResult:
    ttft_s: np.ndarray  # per request, in trace order
    tpot_s: np.ndarray  # per request with > 1 output token (nan otherwise)
    e2e_s: np.ndarray
    makespan_s: float
    num_steps: int
    num_prefill_steps: int
    num_preemptions: int
    output_tokens: int
    peak_used_blocks: int
    prefix_hit_rate: float

    @classmethod
    def from_timings(cls, arrival, first, finish, longest, *, num_steps: int,
                     num_prefill_steps: int, num_preemptions: int, output_tokens: int,
                     peak_used_blocks: int, prefix_queried: int,
                     prefix_hits: int) -> "SimResult":
        """From per-request arrival, first-token and finish times and longest output."""
        arrival, first, finish, longest = map(np.asarray, (arrival, first, finish, longest))
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(longest > 1, (finish - first) / (longest - 1), np.nan)
        return cls(first - arrival, tpot, finish - arrival, float(finish.max() - arrival.min()),
                   num_steps, num_prefill_steps, num_preemptions, output_tokens,
                   peak_used_blocks, prefix_hits / prefix_queried if prefix_queried else 0.0)

    def summary(self) -> dict:
        def pct(values, q):
            values = values[~np.isnan(values)]
            return float(np.percentile(values, q)) if values.size else float("nan")

        return {"steps": self.num_steps, "prefill_steps": self.num_prefill_steps,
                "preemptions": self.num_preemptions, "makespan_s": self.makespan_s,
                "output_tokens_per_s": self.output_tokens / self.makespan_s,
                **{f"{name}_p{q}_s": pct(values, q)
                   for name, values in (("ttft", self.ttft_s), ("tpot", self.tpot_s),
                                        ("e2e", self.e2e_s)) for q in (50, 95, 99)},
                "peak_used_blocks": self.peak_used_blocks,
                "prefix_hit_rate": self.prefix_hit_rate}


def _admit(trace: Sequence[TraceRequest], i: int, schedulers: list[Scheduler],
           place: Placement | None, vocab_size: int) -> list[Request]:
    """Trace request i into its replica's scheduler; returns its samples."""
    r = trace[i]
    params = SamplingParams(max_tokens=r.output_len, n=r.n, temperature=0.0, ignore_eos=True)
    ids = r.prompt_token_ids(i, vocab_size)
    request = make_samples(str(i), ids, params, seed=i, arrival_time=r.arrival_s)
    target = 0
    if len(schedulers) > 1:
        assert place is not None, "several replicas need a placement"
        target = place(ids, [len(s.state.requests) for s in schedulers])
    try:
        schedulers[target].add_request(request)
    except ValueError as e:
        raise ValueError(f"trace request {i}: {e}") from None
    return [request, *request.followers]


def simulate(trace: Sequence[TraceRequest], config: SchedulerConfig, *, num_blocks: int,
             block_size: int, buckets: ShapeBuckets, cost: StepCostModel | RooflineCost,
             vocab_size: int = 32000, num_host_blocks: int = 0, replicas: int = 1,
             place: Placement | None = None, group_windows: Sequence[int | None] = (None,),
             layer_windows: Sequence[int | None] = (None,)) -> SimResult:
    """Runs the trace to completion on simulated time; raises ValueError for a request the
    configuration can never serve (as the engine would reject it).

    A hybrid model (pagedjax.models.layers.kv_groups): group_windows, its KV cache groups' windows (the
    scheduler's blocks per request, a sliding group's bounded), and layer_windows, each
    layer's (the keys a step's layers attend, step_features).

    replicas > 1 simulates data parallelism as pagedjax.frontend.data_parallel runs it: a
    scheduler and a pool of num_blocks each, stepped in lockstep (every replica with work runs a
    step; the step takes the slowest one's time), each arrival placed by place(prompt token ids,
    each replica's unfinished requests) -> replica index."""
    if replicas > 1 and place is None:
        raise ValueError("replicas > 1 needs a placement rule (place)")
    schedulers = [Scheduler(config, num_blocks, block_size, num_host_blocks=num_host_blocks,
                            group_windows=tuple(group_windows)) for _ in range(replicas)]
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    groups: list[list[Request]] = [[] for _ in trace]  # each request's samples
    now, next_arrival, steps, prefill_steps, peak, tokens = 0.0, 0, 0, 0, 0, 0
    while next_arrival < len(order) or any(s.has_unfinished() for s in schedulers):
        while next_arrival < len(order) and trace[order[next_arrival]].arrival_s <= now:
            i = order[next_arrival]
            groups[i] = _admit(trace, i, schedulers, place, vocab_size)
            next_arrival += 1
        busy = [s for s in schedulers if s.has_unfinished()]
        if not busy:
            now = max(now, trace[order[next_arrival]].arrival_s)
            continue
        outputs = [(s, s.schedule(now)) for s in busy]
        costs = []
        for _, output in outputs:
            if not output.scheduled:
                raise RuntimeError("the scheduler made no progress with requests pending")
            kind, features = step_features(output, buckets)
            costs.append(cost.predict(kind, features))
            prefill_steps += kind == PREFILL
        now += max(costs)
        for scheduler, output in outputs:
            advanced = scheduler.update(
                output, np.ones(len(output.scheduled) + len(output.forks), np.int64), now)
            tokens += len(advanced)
            peak = max(peak, scheduler.kv_manager.num_used_blocks)
        steps += 1
    states = [s.state for s in schedulers]
    return SimResult.from_timings(
        [g[0].arrival_time for g in groups],
        [min(_when(s.first_token_time) for s in g) for g in groups],
        [max(_when(s.finish_time) for s in g) for g in groups],
        [max(len(s.output_token_ids) for s in g) for g in groups], num_steps=steps,
        num_prefill_steps=prefill_steps,
        num_preemptions=sum(st.num_preemptions for st in states),
        output_tokens=tokens, peak_used_blocks=peak,
        prefix_queried=sum(st.num_prefix_query_tokens for st in states),
        prefix_hits=sum(st.num_prefix_hit_tokens for st in states))


def _when(time: float | None) -> float:
    """A simulated request's time, which it has once it finished (every one does)."""
    assert time is not None, "a simulated request did not finish"
    return time
