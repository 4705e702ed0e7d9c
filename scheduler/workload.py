"""The workload profile of a trace: what a PagedAttention service's pre-launch checklist asks of
its traffic before sizing anything.

    profile = workload_profile(load_trace("served.jsonl"))

- prompt and output tokens at p50 / p95 / p99 (and mean, max);
- the share of requests that continue a multi-turn conversation: a chat prompt holding earlier
  assistant turns ("turns" > 0), or a request whose session appeared earlier in the trace;
- the share of RAG requests: tagged "rag" ("workload": metadata.workload, or a chat request
  with vLLM's `documents`);
- the share of requests sharing a system prompt: their first prefix piece (16 tokens) is also
  the first piece of a request of another session (or of any other request, without sessions),
  or they belong to a synthetic trace's prefix_group;
- the share of streamed requests;
- arrivals per second over time (bins of bin_s).

A marker a trace did not record (a synthetic trace has no sessions or stream flags) gives None
for its share, not 0: "recorded" counts the requests that carry it. NumPy only.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from pagedjax.scheduler.trace import TraceRequest

PERCENTILES = (50, 95, 99)


def _distribution(values: Sequence[int]) -> dict:
    array = np.asarray(values, np.float64)
    out = {f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}
    return {**out, "mean": float(array.mean()), "max": float(array.max())}


def _share(flags: list[bool | None]) -> dict:
    known = [f for f in flags if f is not None]
    return {"share": (sum(known) / len(known)) if known else None, "recorded": len(known)}


def _multi_turn(trace: Sequence[TraceRequest]) -> list[bool | None]:
    seen: set[str] = set()
    flags: list[bool | None] = []
    for r in sorted(trace, key=lambda r: r.arrival_s):
        if r.turns is None and r.session is None and r.stream is None:  # not a served trace
            flags.append(None)
            continue
        flags.append(bool(r.turns) or r.session in seen)
        if r.session is not None:
            seen.add(r.session)
    return flags


def _shared_prefix(trace: Sequence[TraceRequest]) -> list[bool | None]:
    """Whether each request's first prefix piece is another session's first piece too."""
    sessions_of: dict[str, set] = collections.defaultdict(set)
    counts: collections.Counter = collections.Counter()
    for i, r in enumerate(trace):
        if r.prefix_hashes:
            sessions_of[r.prefix_hashes[0]].add(r.session if r.session is not None else i)
            counts[r.prefix_hashes[0]] += 1
    flags: list[bool | None] = []
    for r in trace:
        if r.prefix_group is not None:
            flags.append(True)
        elif r.prefix_hashes:
            flags.append(len(sessions_of[r.prefix_hashes[0]]) > 1)
        else:  # shorter than a piece, or a synthetic trace without groups: nothing shared
            flags.append(False)
    return flags


def _arrivals(trace: Sequence[TraceRequest], bin_s: float | None) -> dict:
    times = np.asarray([r.arrival_s for r in trace], np.float64)
    span = float(times.max() - times.min())
    if bin_s is None:  # about 20 bins, at least a second each
        bin_s = max(1.0, span / 20)
    edges = np.arange(times.min(), times.max() + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.asarray([times.min(), times.min() + bin_s])
    counts, edges = np.histogram(times, bins=edges)
    rates = counts / bin_s
    return {"bin_s": bin_s, "start_s": edges[:-1].round(6).tolist(),
            "requests_per_s": rates.round(6).tolist(),
            "mean_per_s": len(trace) / span if span > 0 else None,
            "peak_per_s": float(rates.max())}


def workload_profile(trace: Sequence[TraceRequest], bin_s: float | None = None) -> dict:
    """The checklist's table of a trace (see the module's docstring), as a JSON-able dict."""
    if not trace:
        raise ValueError("the trace has no requests")
    if bin_s is not None and not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    sessions = collections.Counter(r.session for r in trace if r.session is not None)
    return {
        "requests": len(trace),
        "duration_s": float(max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace)),
        "prompt_tokens": _distribution([r.prompt_len for r in trace]),
        "output_tokens": _distribution([r.output_len for r in trace]),
        "multi_turn": _share(_multi_turn(trace)),
        "rag": _share([None if r.workload is None and r.stream is None  # not a served trace
                       else r.workload == "rag" for r in trace]),
        "shared_system_prompt": _share(_shared_prefix(trace)),
        "streamed": _share([r.stream for r in trace]),
        "conversations": sum(1 for count in sessions.values() if count > 1),
        "arrivals": _arrivals(trace, bin_s),
    }


def format_profile(profile: dict) -> str:
    """The profile as a text table."""
    lines = [f"{profile['requests']} requests over {profile['duration_s']:.1f} s", "",
             f"{'tokens':<18}{'p50':>9}{'p95':>9}{'p99':>9}{'mean':>9}{'max':>9}"]
    for name in ("prompt_tokens", "output_tokens"):
        d = profile[name]
        lines.append(f"{name.replace('_tokens', ''):<18}" + "".join(
            f"{d[k]:>9.0f}" for k in ("p50", "p95", "p99", "mean", "max")))
    lines += ["", f"{'share of requests':<24}{'share':>8}{'recorded':>10}"]
    for name in ("multi_turn", "rag", "shared_system_prompt", "streamed"):
        d = profile[name]
        share = "n/a" if d["share"] is None else f"{100 * d['share']:.1f}%"
        lines.append(f"{name.replace('_', ' '):<24}{share:>8}{d['recorded']:>10}")
    arrivals = profile["arrivals"]
    mean = arrivals["mean_per_s"]
    lines += ["", f"conversations (sessions with several requests): {profile['conversations']}",
              f"arrivals: mean {'n/a' if mean is None else f'{mean:.2f}'}/s, peak "
              f"{arrivals['peak_per_s']:.2f}/s in {arrivals['bin_s']:g} s bins"]
    return "\n".join(lines)
