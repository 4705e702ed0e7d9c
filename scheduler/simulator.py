"""Replays a workload through the real scheduler against a step-time cost model (no jax, no
device): what TTFT, TPOT, throughput, preemptions and KV usage a configuration would give, in
milliseconds of host time instead of the run itself. Capacity planning sweeps it over pool sizes
and batch limits.

The scheduler is the engine's own (`schedule` / `update` are pure functions of their
arguments), fed requests of the trace's lengths whose outputs are forced to their recorded length
(ignore_eos). Only the step's duration is modelled: StepCostModel predicts it from the step's
kind and its shape, the padded token count T and sequence count B the jit program runs, and the
KV tokens the step attends; `pagedjax.tools.profiling.calibrate` fits it to an engine's measured
steps. Given the same arrivals relative to the steps (e.g. all at once), the simulated schedule
is the engine's, step for step.

A trace is JSON lines, one request each: {"arrival_s", "prompt_len", "output_len"} and
optionally "n" (parallel samples), and either "prefix_group" and "prefix_len" (requests of one
group share their first prefix_len prompt tokens) or "prefix_hashes" (chained hashes of the
prompt's 16-token pieces, as `pagedjax serve --trace-out` records them), so that the prefix
cache sees the requests as it would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable, Iterable, Sequence

import numpy as np

from scheduler.block_hash import chained_hashes
from scheduler.buckets import ShapeBuckets
from scheduler.plan import DECODE, PREFILL
from scheduler.request import Request, SamplingParams, make_samples
from scheduler.lifecycle import Scheduler
from scheduler.scheduler import SchedulerConfig, SchedulerOutput

FEATURES = ("1", "T", "B", "kv_tokens", "attn_pairs")
CHUNK = 16  # tokens a prefix hash covers


def prefix_hashes(prompt_token_ids: Sequence[int], key: bytes = b"") -> tuple[str, ...]:
    """Chained hashes of a prompt's whole CHUNK-token pieces, for a trace: equal lists mean
    equal prefixes, and the tokens cannot be read back from them. With a secret key (at most 64
    bytes; a served trace's is random per file) nobody can confirm a guessed piece either."""
    def combine(parent: bytes, piece) -> bytes:
        data = parent + np.asarray(piece, np.int64).tobytes()
        return hashlib.blake2b(data, digest_size=8, key=key).digest()

    return tuple(h.hex() for h in chained_hashes(prompt_token_ids, CHUNK, combine, b""))


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    n: int = 1
    prefix_group: int | None = None
    prefix_len: int = 0
    # Chained hashes of the prompt's leading CHUNK-token pieces (hex; what a served trace
    # records): prompts whose lists start alike share those tokens.
    prefix_hashes: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("prompt_len", "output_len", "n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.arrival_s, (int, float)) or not np.isfinite(self.arrival_s) \
                or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if not isinstance(self.prefix_len, int) or not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be an integer in [0, prompt_len="
                             f"{self.prompt_len}], got {self.prefix_len!r}")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError("prefix_len needs a prefix_group")
        object.__setattr__(self, "prefix_hashes", tuple(self.prefix_hashes))
        if self.prefix_hashes and self.prefix_len:
            raise ValueError("give prefix_hashes or prefix_group/prefix_len, not both")
        if len(self.prefix_hashes) * CHUNK > self.prompt_len:
            raise ValueError(f"prefix_hashes cover {len(self.prefix_hashes)} x {CHUNK} tokens, "
                             f"more than prompt_len={self.prompt_len}")

    def prompt_token_ids(self, index: int, vocab_size: int) -> list[int]:
        """Synthetic ids: the group's shared prefix (the same for every member), then tokens
        of this request's own."""
        shared = []
        if self.prefix_len:
            rng = np.random.default_rng([1, self.prefix_group])
            shared = rng.integers(0, vocab_size, self.prefix_len).tolist()
        for h in self.prefix_hashes:
            shared += np.random.default_rng([3, int(h, 16)]).integers(0, vocab_size,
                                                                      CHUNK).tolist()
        own = np.random.default_rng([2, index]).integers(0, vocab_size,
                                                         self.prompt_len - len(shared))
        return shared + own.tolist()


def load_trace(path: str | os.PathLike) -> list[TraceRequest]:
    """Reads a JSON-lines trace; errors name the line and the field."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("a line must be a JSON object")
                requests.append(TraceRequest(**record))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


def save_trace(path: str | os.PathLike, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            record = {k: list(v) if isinstance(v, tuple) else v
                      for k, v in dataclasses.asdict(r).items()
                      if v != TraceRequest.__dataclass_fields__[k].default}
            f.write(json.dumps({"arrival_s": r.arrival_s, **record}) + "\n")


def step_features(output: SchedulerOutput, buckets: ShapeBuckets) -> tuple[str, np.ndarray]:
    """(kind, [1, T, B, kv_tokens, attn_pairs]) of a step, padded as build_plan pads it:
    kv_tokens are the keys the step's sequences attend, attn_pairs the (query, key) pairs
    (a chunk of n tokens from position s: n * s + n * (n + 1) / 2, causal)."""
    num_seqs = len(output.scheduled) + len(output.forks)
    if output.kind == DECODE:
        padded_seqs = padded_tokens = buckets.padded_num_seqs(num_seqs)
    else:
        padded_tokens = buckets.padded_num_tokens(output.num_scheduled_tokens)
        padded_seqs = buckets.padded_prefill_seqs(num_seqs, padded_tokens)
    kv_tokens = sum(seq.start + seq.num_new_tokens for seq in output.scheduled)
    pairs = sum(seq.num_new_tokens * seq.start + seq.num_new_tokens * (seq.num_new_tokens + 1) / 2
                for seq in output.scheduled)
    return output.kind, np.array([1.0, padded_tokens, padded_seqs, kv_tokens, pairs])


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """seconds(step) = coef[kind] . [1, T, B, kv_tokens, attn_pairs] + shape[(kind, T, B)]
    (fit leaves attn_pairs' coefficient 0).

    The linear part extrapolates to any shape; `shape` holds, for each compiled program (kind,
    T, B) seen often enough when fitting, the mean of its steps' residuals (what the program
    costs beyond the line: each shape is its own XLA program)."""

    coef: dict[str, tuple[float, ...]]
    shape: dict[tuple[str, int, int], float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for kind in (PREFILL, DECODE):
            values = self.coef.get(kind)
            if values is None or len(values) != len(FEATURES):
                raise ValueError(f"coef[{kind!r}] must hold {len(FEATURES)} numbers "
                                 f"({', '.join(FEATURES)}), got {values!r}")

    def predict(self, kind: str, features: np.ndarray) -> float:
        key = (kind, int(features[1]), int(features[2]))
        return max(float(np.dot(self.coef[kind], features)) + self.shape.get(key, 0.0), 0.0)

    @classmethod
    def fit(cls, samples: Sequence[tuple[str, np.ndarray, float]],
            min_shape_samples: int = 3) -> "StepCostModel":
        """Least squares per kind with non-negative coefficients (a feature that is constant,
        a copy of another (a decode step's T is its B), or whose coefficient comes out
        negative is dropped and the rest refitted); then the per-shape residual means."""
        coef, shape = {}, {}
        for kind in (PREFILL, DECODE):
            rows = [(f, t) for k, f, t in samples if k == kind]
            if len(rows) < 2:
                raise ValueError(f"need at least 2 {kind} steps to fit, got {len(rows)}")
            x = np.array([f for f, _ in rows])
            y = np.array([t for _, t in rows])
            keep = [0]
            # Of equal columns B stays, not T (a decode step's T is its B). attn_pairs is left
            # to the roofline: on the CPU runs measured it made the fit swing between runs.
            for i in (3, 2, 1):
                if np.ptp(x[:, i]) > 0 and not any(np.array_equal(x[:, i], x[:, k])
                                                   for k in keep):
                    keep.append(i)
            keep.sort()
            while True:
                solution, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
                negative = [k for k, c in zip(keep, solution) if c < 0 and k != 0]
                if not negative:
                    break
                keep.remove(negative[0])
            full = np.zeros(x.shape[1])
            full[keep] = solution
            coef[kind] = tuple(float(c) for c in full)
            residuals: dict[tuple[str, int, int], list[float]] = {}
            for f, t in rows:
                residuals.setdefault((kind, int(f[1]), int(f[2])), []).append(
                    t - float(np.dot(full, f)))
            shape.update({key: float(np.mean(r)) for key, r in residuals.items()
                          if len(r) >= min_shape_samples})
        return cls(coef, shape)

    def to_json(self) -> str:
        return json.dumps({"features": FEATURES, "coef": self.coef,
                           "shape": [[k, t, b, v] for (k, t, b), v in self.shape.items()]},
                          indent=2)

    @classmethod
    def from_json(cls, text: str) -> "StepCostModel":
        data = json.loads(text)
        if tuple(data.get("features", ())) != FEATURES:
            raise ValueError(f"cost model features must be {FEATURES}, "
                             f"got {data.get('features')}")
        return cls({k: tuple(v) for k, v in data["coef"].items()},
                   {(k, int(t), int(b)): float(v) for k, t, b, v in data.get("shape", [])})


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes_per_s: float
    flops_per_s: float  # dense bf16
    link_bytes_per_s: float  # a chip's interconnect (NVLink, ICI; PCIe for L4), one direction


# Datasheet peaks (dense bf16; HBM bandwidth; NVLink / ICI per chip, one direction).
CHIPS = {c.name: c for c in (
    Chip("h200", 4.8e12, 989e12, 450e9), Chip("h100", 3.35e12, 989e12, 450e9),
    Chip("a100-80gb", 2.039e12, 312e12, 300e9), Chip("l4", 0.3e12, 121e12, 32e9),
    Chip("tpu-v5e", 0.819e12, 197e12, 200e9), Chip("tpu-v5p", 2.765e12, 459e12, 600e9),
    Chip("tpu-v6e", 1.64e12, 918e12, 448e9))}


@dataclasses.dataclass(frozen=True)
class RooflineCost:
    """An estimate of a step's time on a chip not at hand (capacity planning before hardware):
    overhead + max(FLOPs / (peak FLOPs x flops_util), bytes / (HBM bandwidth x bw_util)).

    FLOPs: 2 x parameters x padded tokens (every padded token is computed) + 4 x layers x query
    heads x head dim x attention pairs. Bytes: the weights once a step, the KV read (attended
    tokens x KV bytes per token, the KV-cache formula 2 L K H itemsize) and the new tokens' KV
    written. The utilisations stand for what kernels reach of the peaks; the step overhead for
    host scheduling and launches. A first-order model: calibrate (StepCostModel.fit on
    `pagedjax profile`) once the hardware is there.

    Tensor parallel over tensor_parallel_size chips: weight_bytes and kv_bytes_per_token are a
    device's (pagedjax.parallel.sharding's formulas), the FLOPs split TP ways, and the collectives are
    added unoverlapped, as ring all-reduces (2 (TP - 1) / TP of the bytes) and all-gathers
    ((TP - 1) / TP) over the chip's link: allreduce_bytes_per_token (two all-reduces a layer of the hidden state) for
    every padded token, gather_bytes_per_seq (the vocab-split logits) for every sequence."""

    chip: Chip
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # 4 x layers x query heads x head dim
    flops_util: float = 0.5
    bw_util: float = 0.7
    overhead_s: float = 0.002
    tensor_parallel_size: int = 1
    allreduce_bytes_per_token: int = 0
    gather_bytes_per_seq: int = 0

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        for name in ("flops_util", "bw_util"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {self.overhead_s!r}")

    def predict(self, kind: str, features: np.ndarray) -> float:
        _, tokens, seqs, kv_tokens, pairs = features
        tp = self.tensor_parallel_size
        flops = (2.0 * self.num_params * tokens + self.attn_flops_per_pair * pairs) / tp
        moved = self.weight_bytes + (kv_tokens + tokens) * self.kv_bytes_per_token
        step = self.overhead_s + max(flops / (self.chip.flops_per_s * self.flops_util),
                                     moved / (self.chip.hbm_bytes_per_s * self.bw_util))
        if tp > 1:
            sent = (2 * self.allreduce_bytes_per_token * tokens  # ring all-reduce: 2x
                    + self.gather_bytes_per_seq * seqs)
            step += (tp - 1) / tp * sent / self.chip.link_bytes_per_s
        return step


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
                "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p99_s": pct(self.ttft_s, 99),
                "tpot_p50_s": pct(self.tpot_s, 50), "tpot_p99_s": pct(self.tpot_s, 99),
                "e2e_p50_s": pct(self.e2e_s, 50), "peak_used_blocks": self.peak_used_blocks,
                "prefix_hit_rate": self.prefix_hit_rate}


def simulate(trace: Sequence[TraceRequest], config: SchedulerConfig, *, num_blocks: int,
             block_size: int, buckets: ShapeBuckets, cost: StepCostModel | RooflineCost,
             vocab_size: int = 32000, num_host_blocks: int = 0, replicas: int = 1,
             place: Callable[[Sequence[int], list[int]], int] | None = None) -> SimResult:
    """Runs the trace to completion on simulated time; raises ValueError for a request the
    configuration can never serve (as the engine would reject it).

    replicas > 1 simulates data parallelism as pagedjax.parallel.data_parallel runs it: a scheduler and a
    pool of num_blocks each, stepped in lockstep (every replica with work runs a step; the
    step takes the slowest one's time), each arrival placed by place(prompt token ids, each
    replica's unfinished requests) -> replica index."""
    if replicas > 1 and place is None:
        raise ValueError("replicas > 1 needs a placement rule (place)")
    schedulers = [Scheduler(config, num_blocks, block_size, num_host_blocks=num_host_blocks)
                  for _ in range(replicas)]
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    groups: list[list[Request]] = [[] for _ in trace]  # each request's samples
    now, next_arrival, steps, prefill_steps, peak, tokens = 0.0, 0, 0, 0, 0, 0
    while next_arrival < len(order) or any(s.has_unfinished() for s in schedulers):
        while next_arrival < len(order) and trace[order[next_arrival]].arrival_s <= now:
            i = order[next_arrival]
            r = trace[i]
            params = SamplingParams(max_tokens=r.output_len, n=r.n, temperature=0.0,
                                    ignore_eos=True)
            ids = r.prompt_token_ids(i, vocab_size)
            request = make_samples(str(i), ids, params, seed=i, arrival_time=r.arrival_s)
            target = 0 if replicas == 1 else place(
                ids, [len(s.state.requests) for s in schedulers])
            try:
                schedulers[target].add_request(request)
            except ValueError as e:
                raise ValueError(f"trace request {i}: {e}") from None
            groups[i] = [request, *request.followers]
            next_arrival += 1
        busy = [s for s in schedulers if s.has_unfinished()]
        if not busy:
            now = max(now, trace[order[next_arrival]].arrival_s)
            continue
        outputs = [(s, s.schedule(now)) for s in busy]
        costs = []
        for scheduler, output in outputs:
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
        [g[0].arrival_time for g in groups], [min(s.first_token_time for s in g) for g in groups],
        [max(s.finish_time for s in g) for g in groups],
        [max(len(s.output_token_ids) for s in g) for g in groups], num_steps=steps,
        num_prefill_steps=prefill_steps,
        num_preemptions=sum(st.num_preemptions for st in states),
        output_tokens=tokens, peak_used_blocks=peak,
        prefix_queried=sum(st.num_prefix_query_tokens for st in states),
        prefix_hits=sum(st.num_prefix_hit_tokens for st in states))
