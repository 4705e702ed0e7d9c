"""`pagedjax profile-workload`: the workload profile of a trace (scheduler.workload)."""

from __future__ import annotations

import argparse
import json


def profile_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="a JSON-lines trace (`pagedjax serve --trace-out`, or "
                        "written by hand: see scheduler/trace.py)")
    parser.add_argument("--json", metavar="FILE", help="also write the profile as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw it: token histograms, shares, arrivals over time")
    parser.add_argument("--bin-s", type=float,
                        help="arrival-rate bins in seconds (default: about 20 bins of at "
                        "least 1 s)")


def profile_workload(args, parser: argparse.ArgumentParser) -> None:
    """The pre-launch checklist's workload table of a trace: prompt and output tokens at
    p50/p95/p99, the shares of multi-turn, RAG, shared-system-prompt and streamed requests, and
    arrivals per second over time (as text, and as JSON and a picture when asked)."""
    from pagedjax.scheduler.trace import load_trace
    from pagedjax.scheduler.workload import format_profile, workload_profile

    try:
        trace = load_trace(args.trace)
        profile = workload_profile(trace, args.bin_s)
    except (ValueError, OSError) as e:
        parser.exit(1, f"pagedjax profile-workload: {e}\n")
    print(format_profile(profile))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(profile, f, indent=1)
        print(f"profile -> {args.json}")
    if args.plot:
        from pagedjax.tools.plotting import plot_workload
        plot_workload(trace, profile, args.plot)
        print(f"picture -> {args.plot}")
