"""Step-time models for the simulator: StepCostModel (per step kind, seconds linear in the step's
padded shape and attended keys, fitted to an engine's measured steps) and RooflineCost (a chip's
datasheet peaks, scheduler.chips, for hardware not at hand)."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Sequence

import numpy as np

from pagedjax.scheduler.buckets import ShapeBuckets
from pagedjax.scheduler.chips import Chip
from pagedjax.scheduler.state import DECODE, PREFILL, SchedulerOutput

FEATURES = ("1", "T", "B", "kv_tokens", "attn_pairs")


def step_features(output: SchedulerOutput, buckets: ShapeBuckets,
                  layer_windows: Sequence[int | None] = (None,)) -> tuple[str, np.ndarray]:
    """(kind, [1, T, B, kv_tokens, attn_pairs]) of a step, padded as build_plan pads it:
    kv_tokens are the keys the step's sequences attend, attn_pairs the (query, key) pairs
    (a chunk of n tokens from position s: n * s + n * (n + 1) / 2, causal), both averaged over
    the model's layers (layer_windows: each layer's attention window, None for full: a
    sliding layer attends at most its window's keys a query)."""
    num_seqs = len(output.scheduled) + len(output.forks)
    if output.kind == DECODE:
        padded_seqs = padded_tokens = buckets.padded_num_seqs(num_seqs)
    else:
        padded_tokens = buckets.padded_num_tokens(output.num_scheduled_tokens)
        padded_seqs = buckets.padded_prefill_seqs(num_seqs, padded_tokens)
    kv_tokens = pairs = 0.0
    for window, count in collections.Counter(layer_windows).items():
        share = count / len(layer_windows)
        for seq in output.scheduled:
            keys, seq_pairs = attended(seq.start, seq.num_new_tokens, window)
            kv_tokens += share * keys
            pairs += share * seq_pairs
    return output.kind, np.array([1.0, padded_tokens, padded_seqs, kv_tokens, pairs])


def attended(start: int, num_new: int, window: int | None) -> tuple[int, float]:
    """(keys read, (query, key) pairs) of num_new query tokens from position start under a
    causal attention window (None: the whole context)."""
    n = num_new
    if window is None:
        return start + n, n * start + n * (n + 1) / 2
    keys = min(start + n, window - 1 + n)
    below = min(max(window - start, 0), n)  # queries that see every key before them
    return keys, below * start + below * (below + 1) / 2 + (n - below) * window


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
class RooflineCost:
    """An estimate of a step's time on a chip not at hand (capacity planning before hardware):
    overhead + max(FLOPs / (peak FLOPs x flops_util), bytes / (HBM bandwidth x bw_util)).

    FLOPs: 2 x parameters x padded tokens (every padded token is computed; a mixture of experts'
    parameters a token reads: its k experts) + 4 x layers x query heads x head dim x attention
    pairs. Bytes: the weights once a step (a mixture's experts: those the step's tokens pick, a
    share 1 - (1 - k / E)^T of expert_bytes under a balanced router), the KV read (attended
    tokens x KV bytes per token, the KV-cache formula 2 L K H itemsize) and the new tokens' KV
    written. The utilisations stand for what kernels reach of the peaks; the step overhead for
    host scheduling and launches. A first-order model: calibrate (StepCostModel.fit on
    `pagedjax profile`) once the hardware is there.

    Tensor parallel over tensor_parallel_size chips: weight_bytes and kv_bytes_per_token are a
    device's (pagedjax.parallel.sharding's formulas), the FLOPs split TP ways, and the
    collectives are added unoverlapped, as ring all-reduces (2 (TP - 1) / TP of the bytes) and
    all-gathers ((TP - 1) / TP) over the chip's link: allreduce_bytes_per_token (two all-reduces
    a layer of the hidden state) for every padded token, gather_bytes_per_seq (the vocab-split
    logits) for every sequence."""

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
    expert_bytes: int = 0  # the part of weight_bytes that is experts (a mixture's)
    expert_share: float = 0.0  # k / E: the experts one token picks

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        for name in ("flops_util", "bw_util"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {self.overhead_s!r}")
        if not 0 <= self.expert_share <= 1 or not 0 <= self.expert_bytes <= self.weight_bytes:
            raise ValueError(f"expert_share must be in [0, 1] and expert_bytes in [0, "
                             f"weight_bytes], got {self.expert_share!r}, {self.expert_bytes!r}")

    def weights_read(self, tokens: float) -> float:
        """Weight bytes a step of this many tokens reads: all but the experts, and the experts
        its tokens pick (expected, a balanced router)."""
        picked = 1.0 - (1.0 - self.expert_share) ** tokens
        return self.weight_bytes - self.expert_bytes * (1.0 - picked)

    def predict(self, kind: str, features: np.ndarray) -> float:
        _, tokens, seqs, kv_tokens, pairs = features
        tp = self.tensor_parallel_size
        flops = (2.0 * self.num_params * tokens + self.attn_flops_per_pair * pairs) / tp
        moved = self.weights_read(tokens) + (kv_tokens + tokens) * self.kv_bytes_per_token
        step = self.overhead_s + max(flops / (self.chip.flops_per_s * self.flops_util),
                                     moved / (self.chip.hbm_bytes_per_s * self.bw_util))
        if tp > 1:
            sent = (2 * self.allreduce_bytes_per_token * tokens  # ring all-reduce: 2x
                    + self.gather_bytes_per_seq * seqs)
            step += (tp - 1) / tp * sent / self.chip.link_bytes_per_s
        return step
