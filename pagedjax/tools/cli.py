"""`pagedjax` command line: one subcommand per job, each with its own --help.

    pagedjax demo | serve [MODEL] | router --backend URL ... | capacity | inspect MODEL |
             profile | simulate
"""

from __future__ import annotations

import sys

from pagedjax.tools import plan_commands, serve_commands


def _demo(argv) -> None:
    """The engine on a real chat model (or the embedded tiny one): prefix hits, parallel
    samples, preemption, and the engine's table."""
    from pagedjax.tools.demo import main as demo_main
    demo_main(argv)


COMMANDS = {  # name -> (what runs it, what it does)
    "demo": (_demo, "the engine on a real chat model: prefix hits, samples, preemption"),
    "serve": (serve_commands.serve, "an OpenAI-compatible server for a model"),
    "router": (serve_commands.router, "a KV-aware proxy over several `pagedjax serve`"),
    "capacity": (plan_commands.capacity, "KV-cache capacity from the formula"),
    "inspect": (plan_commands.inspect, "what the engine makes of a model directory or GGUF"),
    "profile": (plan_commands.profile, "fit the simulator's step-time model to an engine"),
    "simulate": (plan_commands.simulate, "a trace through the real scheduler, no device"),
}


def usage() -> str:
    lines = [f"usage: pagedjax {{{','.join(COMMANDS)}}} [options]", "",
             "commands (pagedjax COMMAND --help for each one's options):"]
    lines += [f"  {name:<9} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        if argv:
            print(f"\npagedjax: error: unknown command {argv[0]!r} (choose from "
                  f"{', '.join(COMMANDS)})", file=sys.stderr)
        raise SystemExit(2)
    COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    main()
