"""Safe rollout: a canary group's share of the router's traffic, and the guard that compares its
outcomes with the stable group's and takes the share back by itself (pagedjax.serving.router)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GroupStats:
    requests: int
    errors: int
    p50_latency_s: float | None  # of the successful ones: time to the response's headers

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class RolloutGuard:
    """A canary's share of the traffic, and the rule that takes it back.

    Requests go to the canary group at exactly `weight` of the traffic (deterministically
    interleaved). Each response is an outcome of its group: an error is a 5xx or an instance
    that could not be reached (a 4xx is the client's); latency is the time to the response's
    headers. Over the last `window` outcomes of each group, once the canary has
    `min_requests`, the guard rolls back (weight 0, state `rolled_back`, the reason kept) when
    the canary's error rate exceeds the stable group's by more than `max_error_delta`, or its
    median latency is over `max_latency_ratio` times the stable group's (which then needs
    `min_requests` too)."""

    def __init__(self, weight: float = 0.0, *, window: int = 200, min_requests: int = 20,
                 max_error_delta: float = 0.05, max_latency_ratio: float = 2.0):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if not isinstance(min_requests, int) or not 1 <= min_requests <= window:
            raise ValueError(f"min_requests must be an integer in [1, window={window}], "
                             f"got {min_requests!r}")
        if not 0 <= max_error_delta <= 1:
            raise ValueError(f"max_error_delta must be in [0, 1], got {max_error_delta!r}")
        if not max_latency_ratio >= 1:
            raise ValueError(f"max_latency_ratio must be >= 1, got {max_latency_ratio!r}")
        self.min_requests = min_requests
        self.max_error_delta = max_error_delta
        self.max_latency_ratio = max_latency_ratio
        self.outcomes: dict[str, collections.deque] = {
            g: collections.deque(maxlen=window) for g in ("stable", "canary")}
        self.set_weight(weight)

    def set_weight(self, weight: float) -> None:
        """Sets the canary's share (0 turns it off) and re-arms a rolled-back guard."""
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not 0 <= weight <= 1:
            raise ValueError(f"weight must be a number in [0, 1], got {weight!r}")
        self.weight = float(weight)
        self.state = "canary" if weight > 0 else "off"
        self.reason: str | None = None
        self._seen = self._to_canary = 0
        self.outcomes["canary"].clear()

    def to_canary(self) -> bool:
        """Whether the next request goes to the canary (exactly `weight` of them)."""
        if self.state != "canary":
            return False
        self._seen += 1
        if self._to_canary + 1 <= self.weight * self._seen + 1e-9:
            self._to_canary += 1
            return True
        return False

    def stats(self, group: str) -> GroupStats:
        outcomes = self.outcomes[group]
        latencies = [latency for ok, latency in outcomes if ok and latency is not None]
        return GroupStats(len(outcomes), sum(not ok for ok, _ in outcomes),
                          float(np.median(latencies)) if latencies else None)

    def record(self, group: str, ok: bool, latency_s: float | None) -> None:
        self.outcomes[group].append((ok, latency_s))
        if self.state == "canary":
            self._check()

    def _check(self) -> None:
        canary, stable = self.stats("canary"), self.stats("stable")
        if canary.requests < self.min_requests:
            return
        if canary.error_rate > stable.error_rate + self.max_error_delta:
            self.rollback(f"canary error rate {canary.error_rate:.1%} over the stable group's "
                          f"{stable.error_rate:.1%} + {self.max_error_delta:.1%} "
                          f"(last {canary.requests} canary requests)")
        elif (stable.requests >= self.min_requests and canary.p50_latency_s is not None
              and stable.p50_latency_s
              and canary.p50_latency_s > self.max_latency_ratio * stable.p50_latency_s):
            self.rollback(f"canary median latency {canary.p50_latency_s * 1e3:.0f} ms over "
                          f"{self.max_latency_ratio:g}x the stable group's "
                          f"{stable.p50_latency_s * 1e3:.0f} ms")

    def rollback(self, reason: str) -> None:
        self.weight, self.state, self.reason = 0.0, "rolled_back", reason

    def status(self) -> dict:
        return {"state": self.state, "weight": self.weight, "reason": self.reason,
                **{g: {**dataclasses.asdict(self.stats(g)),
                       "error_rate": self.stats(g).error_rate} for g in self.outcomes}}
