"""`pagedjax` command line: argparse subcommands, one per job, each with its own --help.

    pagedjax demo | serve [MODEL] | router --backend URL ... | capacity | inspect MODEL |
             profile | simulate | profile-workload TRACE
"""

from __future__ import annotations

import argparse
import sys

from pagedjax.tools import capacity_commands, demo, plan_commands, serve_commands, workload_commands

COMMANDS = {  # name -> (its flags, what runs it, what it does)
    "demo": (demo.demo_args, demo.run,
             "the engine on a real chat model: prefix hits, samples, preemption"),
    "serve": (serve_commands.serve_args, serve_commands.serve,
              "an OpenAI-compatible server for a model"),
    "router": (serve_commands.router_args, serve_commands.router,
               "a KV-aware proxy over several `pagedjax serve`"),
    "capacity": (capacity_commands.capacity_args, capacity_commands.capacity,
                 "KV-cache capacity from the formula"),
    "inspect": (capacity_commands.inspect_args, capacity_commands.inspect,
                "what the engine makes of a model directory or GGUF"),
    "profile": (plan_commands.profile_args, plan_commands.profile,
                "fit the simulator's step-time model to an engine"),
    "simulate": (plan_commands.simulate_args, plan_commands.simulate,
                 "a trace through the real scheduler, no device"),
    "profile-workload": (workload_commands.profile_workload_args,
                         workload_commands.profile_workload,
                         "a trace's token percentiles, request shares and arrival rate"),
}


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, when it has one and the text does not give it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or "default" in text
                or action.option_strings == [] and action.nargs in ("?", "*") and not default):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedjax", formatter_class=HelpFormatter,
        description="An LLM inference engine in JAX built on PagedAttention.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command",
                                     required=True,
                                     description="`pagedjax COMMAND --help` for each one's flags")
    for name, (add_args, run, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=run.__doc__,
                                  formatter_class=HelpFormatter)
        add_args(sub)
        sub.set_defaults(run=run, parser=sub)
    return parser


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})")
    args = parser.parse_args(argv)
    args.run(args, args.parser)


if __name__ == "__main__":
    main()
