"""Automatic degradation of a serving instance, in steps, with recovery and hysteresis.

The instance watches its own signals over a sliding window: p99 time to first token, p99
inter-token latency (as /metrics observes them) and device OOMs. When a signal crosses its
threshold it steps one level down, and again after every `hold_s` the signal stays bad:

    level 0  normal
    level 1  max_tokens cut to max_tokens_factor x the instance's cap (or max_model_len)
    level 2  + long-context requests shed (prompts over long_context_threshold refused, 429)
    level 3  + concurrency lowered to concurrency_factor x the requests live at that moment

It steps back up one level once every signal has stayed below recover_ratio x its threshold
(an OOM-free window) for `hold_s`; between the two bounds it holds (hysteresis: a latency just
under the threshold does not flap the level). Every change is logged and counted
(`pagedjax:degradation_level`, `pagedjax:degradation_changes_total{direction}`); requests
already admitted keep their settings.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading

import numpy as np

from pagedjax.scheduler.errors import check_float, check_int
from pagedjax.scheduler.request import INT32_MAX

logger = logging.getLogger("pagedjax.degradation")

LEVELS = ("normal", "max_tokens", "shed_long_context", "lower_concurrency")


@dataclasses.dataclass(frozen=True)
class DegradationPolicy:
    """When and how far an instance degrades (None thresholds: that signal is not watched;
    with none watched the instance never degrades)."""

    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    oom_burst: int | None = None  # this many device OOMs within the window
    window_s: float = 60.0
    min_samples: int = 20  # latency observations in the window before p99 is judged
    recover_ratio: float = 0.7
    hold_s: float = 30.0
    max_tokens_factor: float = 0.5
    long_context_threshold: int | None = None  # prompt tokens; default: max_model_len // 2
    concurrency_factor: float = 0.5

    def __post_init__(self):
        for name in ("ttft_p99_s", "itl_p99_s", "window_s", "hold_s"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name), 0.0, 1e6, low_open=True)
        for name in ("recover_ratio", "max_tokens_factor", "concurrency_factor"):
            value = check_float(name, getattr(self, name), 0.0, 1.0, low_open=True)
            if value == 1.0:
                raise ValueError(f"{name} must be below 1, got 1.0")
        for name in ("oom_burst", "min_samples", "long_context_threshold"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, INT32_MAX)

    @property
    def watching(self) -> bool:
        return any(v is not None for v in (self.ttft_p99_s, self.itl_p99_s, self.oom_burst))


class DegradationController:
    """One instance's level: fed by the metrics (ttft, itl, oom), evaluated after every step
    and on every admission; `apply` sets the instance's knobs for a level (the server's)."""

    def __init__(self, policy: DegradationPolicy | None = None, apply=None, clock=None,
                 on_change=None):
        import time

        self.policy = policy or DegradationPolicy()
        self.apply = apply or (lambda level: None)
        self.on_change = on_change or (lambda level, direction, why: None)
        self.clock = clock or time.monotonic
        self.level = 0
        self.max_tokens_cap: int | None = None  # level >= 1 (read by the server)
        self._samples: dict[str, collections.deque] = {"ttft": collections.deque(),
                                                       "itl": collections.deque()}
        self._ooms: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._last_change: float | None = None  # when the level last moved
        self._healthy_since: float | None = None

    # ---- signals (the engine thread) ---------------------------------------------------------

    def observe(self, kind: str, value: float, now: float | None = None) -> None:
        if self.policy.watching:
            with self._lock:
                self._samples[kind].append((self.clock() if now is None else now, value))

    def oom(self, count: int = 1) -> None:
        if self.policy.oom_burst is not None:
            with self._lock:
                self._ooms.extend([self.clock()] * count)

    # ---- the rule ------------------------------------------------------------------------------

    def _window(self, now: float) -> dict:
        """The window's p99s (None: too few samples) and OOM count, old samples dropped."""
        start = now - self.policy.window_s
        out = {}
        for kind, samples in self._samples.items():
            while samples and samples[0][0] < start:
                samples.popleft()
            values = [v for _, v in samples]
            out[kind] = (float(np.percentile(values, 99))
                         if len(values) >= self.policy.min_samples else None)
        while self._ooms and self._ooms[0] < start:
            self._ooms.popleft()
        out["oom"] = len(self._ooms)
        return out

    def _judge(self, window: dict) -> tuple[str, str]:
        """("bad" | "healthy" | "hold", why)."""
        p = self.policy
        bad, healthy = [], True
        for kind, threshold in (("ttft", p.ttft_p99_s), ("itl", p.itl_p99_s)):
            value = window[kind]
            if threshold is None or value is None:
                continue
            if value > threshold:
                bad.append(f"p99 {kind} {value:.3f}s > {threshold:g}s")
            if value >= p.recover_ratio * threshold:
                healthy = False
        if p.oom_burst is not None and window["oom"] >= p.oom_burst:
            bad.append(f"{window['oom']} device OOMs in {p.window_s:g}s")
        if window["oom"]:
            healthy = False
        if bad:
            return "bad", "; ".join(bad)
        return ("healthy" if healthy else "hold"), ""

    def evaluate(self) -> int:
        """Moves the level by at most one step; returns it."""
        if not self.policy.watching:
            return self.level
        with self._lock:
            now = self.clock()
            verdict, why = self._judge(self._window(now))
            held = self._last_change is None or now - self._last_change >= self.policy.hold_s
            if verdict != "healthy":
                self._healthy_since = None
            elif self._healthy_since is None:
                self._healthy_since = now
            if verdict == "bad" and self.level < len(LEVELS) - 1 and held:
                self._move(+1, now, why)
            elif (verdict == "healthy" and self.level > 0 and held
                  and self._healthy_since is not None
                  and now - self._healthy_since >= self.policy.hold_s):
                self._move(-1, now, "signals below recover_ratio x their thresholds for "
                           f"{self.policy.hold_s:g}s")
                self._healthy_since = now
            return self.level

    def _move(self, step: int, now: float, why: str) -> None:
        self.level += step
        self._last_change = now
        direction = "degrade" if step > 0 else "recover"
        self.apply(self.level)
        logger.warning("%s to level %d (%s): %s", direction, self.level, LEVELS[self.level], why)
        self.on_change(self.level, direction, why)


def settings_for(level: int, policy: DegradationPolicy, base, max_tokens_base: int,
                 max_model_len: int, live: int):
    """(admission limits, max_tokens cap or None) at a level, from the configured limits base
    (an AdmissionLimits); live: the requests live now (level 3 lowers concurrency below it)."""
    limits, cap = base, None
    if level >= 1:
        cap = max(1, int(max_tokens_base * policy.max_tokens_factor))
    if level >= 2:
        threshold = (base.long_context_threshold or policy.long_context_threshold
                     or max(1, max_model_len // 2))
        limits = dataclasses.replace(limits, long_context_threshold=threshold,
                                     max_long_context_requests=0)
    if level >= 3:
        lowered = max(1, int(live * policy.concurrency_factor))
        limits = dataclasses.replace(limits, max_concurrent_requests=min(
            lowered, base.max_concurrent_requests or lowered))
    return limits, cap
