"""Admission control: whether the server takes a request now or answers 429, and why.

Each rule is off unless configured (`pagedjax serve` flags in brackets); a refused request
changes nothing, is counted by reason (`pagedjax:requests_rejected{reason}`) and gets
`Retry-After`. The token budget and KV pressure let an idle server admit anything that fits the
pool, so they never starve it; the caps hold always.

- token_budget [--max-outstanding-tokens N]: the work outstanding (tokens still to compute,
  prompt not yet prefilled + outputs not yet generated up to max_tokens, over every live
  sample) plus the request's may not exceed N.
- kv_pressure [--kv-overcommit F]: the KV blocks in use now, plus the blocks the live requests
  may still take (their outstanding tokens), plus the request's (prompt + max_tokens, every
  sample), may not exceed F x the usable blocks. F > 1 bets that requests stop before
  max_tokens (and share prefixes); under load the free blocks run out first, so a request
  whose blocks cannot come waits at the door instead of preempting others.
- long_context_cap [--long-context-threshold T --max-long-context-requests N]: at most N live
  requests whose prompt exceeds T tokens (0 sheds them all: what degradation does).
- non_streamed_cap [--max-non-streamed-requests N]: at most N live non-streamed requests (a
  client without a stream holds its connection with nothing to show until the end; streamed
  requests are not capped by it).
- concurrency_cap [--max-concurrent-requests N]: at most N live requests (degradation lowers
  it in steps).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from pagedjax.scheduler.errors import check_float, check_int
from pagedjax.scheduler.request import INT32_MAX

REASONS = ("token_budget", "kv_pressure", "long_context_cap", "non_streamed_cap",
           "concurrency_cap")


class OverloadedError(RuntimeError):
    """Admission control refused a request (HTTP 429); reason is one of REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # crosses the engine core's process boundary whole
        return type(self), (self.reason, str(self))


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    """The rules' settings (None: the rule is off); see the module's docstring."""

    max_outstanding_tokens: int | None = None
    kv_overcommit: float | None = None
    long_context_threshold: int | None = None  # prompt tokens
    max_long_context_requests: int | None = None
    max_non_streamed_requests: int | None = None
    max_concurrent_requests: int | None = None

    def __post_init__(self):
        for name, low in (("max_outstanding_tokens", 1), ("long_context_threshold", 1),
                          ("max_concurrent_requests", 1), ("max_long_context_requests", 0),
                          ("max_non_streamed_requests", 0)):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low, INT32_MAX)
        if self.kv_overcommit is not None:
            check_float("kv_overcommit", self.kv_overcommit, 0.0, 1e6, low_open=True)
        if (self.max_long_context_requests is None) != (self.long_context_threshold is None):
            raise ValueError("give long_context_threshold and max_long_context_requests "
                             "together")


@dataclasses.dataclass
class Live:
    """What admission knows of a live request beside its samples."""

    samples: list
    streamed: bool
    long_context: bool


def check(limits: AdmissionLimits, live: Sequence[Live], new: Sequence, streamed: bool,
          load, blocks_for: Callable[[int], int], outstanding_tokens: int,
          outstanding_blocks: int) -> None:
    """Raises OverloadedError when the admissions `new` (engine Admissions, one request's
    prompts) break a rule; live: the requests admitted and unfinished; load: the engine's
    ReplicaLoads now; blocks_for: the KV blocks a sequence of n tokens holds at most (over a
    hybrid model's KV cache groups, LLMEngine.blocks_for); outstanding_blocks: what the live
    requests may still take."""
    _check_caps(limits, live, new, streamed)
    if not live:
        return  # idle: anything that fits the pool
    needed = sum(a.num_tokens for a in new)
    budget = limits.max_outstanding_tokens
    if budget is not None and outstanding_tokens + needed > budget:
        raise OverloadedError("token_budget", (
            f"the engine has {outstanding_tokens} tokens of work outstanding and this request "
            f"adds {needed} (prompt + max_tokens per sample; a pooling request: its prompt), "
            f"over max_outstanding_tokens "
            f"({budget}): retry later"))
    if limits.kv_overcommit is not None:
        usable = sum(r.usable_blocks for r in load)
        used = sum(r.used_blocks for r in load)
        projected = used + outstanding_blocks + sum(
            a.spec.params.num_samples * blocks_for(len(a.prompt_token_ids) + (
                a.spec.params.max_tokens if a.spec.pooling_params is None else 0)) for a in new)
        if projected > limits.kv_overcommit * usable:
            raise OverloadedError("kv_pressure", (
                f"KV pressure: {used} blocks in use, the live requests may take "
                f"{outstanding_blocks} more and this one "
                f"{projected - used - outstanding_blocks}, over kv_overcommit "
                f"({limits.kv_overcommit:g}) x {usable} usable blocks: retry later"))


def _check_caps(limits: AdmissionLimits, live: Sequence[Live], new: Sequence,
                streamed: bool) -> None:
    cap = limits.max_concurrent_requests
    if cap is not None and len(live) + len(new) > cap:
        raise OverloadedError("concurrency_cap", f"{len(live)} requests are live, at "
                              f"max_concurrent_requests ({cap}): retry later")
    if limits.long_context_threshold is not None:
        long = sum(len(a.prompt_token_ids) > limits.long_context_threshold for a in new)
        cap = limits.max_long_context_requests
        held = sum(r.long_context for r in live)
        if long and cap is not None and held + long > cap:
            raise OverloadedError("long_context_cap", (
                f"prompts over {limits.long_context_threshold} tokens are limited to {cap} "
                f"live requests ({held} now): retry later"))
    cap = limits.max_non_streamed_requests
    if cap is not None and not streamed:
        held = sum(not r.streamed for r in live)
        if held + len(new) > cap:
            raise OverloadedError("non_streamed_cap", (
                f"non-streamed requests are limited to {cap} live ones ({held} now): stream, or "
                f"retry later"))

