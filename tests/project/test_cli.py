"""`pagedjax`: argparse subcommands, each with its own --help; every flag says what it does and
its default; an unknown command is named."""

from __future__ import annotations

import argparse

import pytest

from pagedjax.tools.cli import COMMANDS, build_parser, main


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action, = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # wrapped help, whitespace folded
    for name, (_, _, summary) in COMMANDS.items():
        assert f"{name} {summary}" in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_and_its_default(command, capsys):
    sub = _subparsers(build_parser())[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"pagedjax {command} {name} has no help text"
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for action in sub._actions:
        default = action.default
        if action.option_strings and default not in (None, False, argparse.SUPPRESS):
            shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
            assert f"(default: {shown})" in text or "default" in action.help, \
                f"pagedjax {command} {action.option_strings[0]}: its default is not shown"


def test_unknown_command_and_missing_command_are_named(capsys):
    for argv, message in ((["bogus"], "unknown command 'bogus'"),
                          ([], "required: COMMAND")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--responses-store-ttl", "0"], "--responses-store-ttl > 0"),
    (["--responses-store-size", "-1"], "--responses-store-size must be >= 0"),
    (["--responses-store-max-bytes", "0"], "--responses-store-max-bytes >= 1"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1, got 0"),
])
def test_serve_flags_out_of_range_are_named_before_an_engine_is_built(flags, message, capsys):
    from pagedjax.tools.serve_commands import _check_server_flags

    parser = _subparsers(build_parser())["serve"]
    lowest = parser.parse_args(["--responses-store-size", "0", "--responses-store-ttl", "0.5",
                                "--responses-store-max-bytes", "1", "--max-request-bytes", "1"])
    _check_server_flags(lowest, parser)  # the smallest values each flag takes
    with pytest.raises(SystemExit) as exit_info:
        _check_server_flags(parser.parse_args(flags), parser)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
