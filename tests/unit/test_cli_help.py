"""Every option and argument of every ``jaild`` command says what it is in ``--help``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from jaild.cli import build_parser


def _unexplained(parser: argparse.ArgumentParser, path: str) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _unexplained(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}"


def test_every_option_of_every_command_has_help() -> None:
    assert list(_unexplained(build_parser(), "jaild")) == []


def test_an_option_without_help_is_found() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers().add_parser("ps")
    sub.add_argument("--json", action="store_true")
    sub.add_argument("--all", action="store_true", help="every uid's")
    assert list(_unexplained(parser, "jaild")) == ["jaild ps --json"]
