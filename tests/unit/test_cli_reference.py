"""The CLI reference in docs/using/cli.md is the parser's own (jaild/cli_reference.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from jaild.cli import build_parser
from jaild.cli_reference import NO_HELP, reference_markdown

REPO = Path(__file__).resolve().parents[2]


def test_the_docs_cli_reference_is_generated_from_the_parser() -> None:
    page = (REPO / "docs/using/cli.md").read_text(encoding="utf-8")
    assert reference_markdown() in page, (
        "docs/using/cli.md's CLI reference differs from the parser: run "
        "python scripts/update_doc_references.py (python -m jaild.cli_reference prints it)"
    )


def _commands(prog: str, parser: argparse.ArgumentParser) -> list[str]:
    found = [prog]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(f"{prog} {name}", sub)
    return found


def test_every_command_and_option_is_in_the_reference() -> None:
    parser = build_parser()
    text = reference_markdown(parser)
    commands = _commands("jaild", parser)
    assert "jaild policy check" in commands and "jaild env build" in commands  # nested ones
    for command in commands:
        assert f"### `{command}`\n" in text, command
        assert f"usage: {command}" in text, command
    for option in ["--download-dir DIR", "-r FILE, --requirements FILE", "--http HOST:PORT",
                   "--allow-user USER", "--max-retries N", "--version"]:
        assert f"`{option}`" in text, option


def test_an_option_without_help_text_says_so() -> None:
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("go", help="go somewhere")
    p.add_argument("--fast", action="store_true", help="go fast")
    p.add_argument("--to", default="home")  # no help text
    p.add_argument("--via", choices=["a", "b"], required=True)
    text = reference_markdown(parser)
    assert "* `--fast`: go fast\n" in text
    assert f"* `--to TO`: {NO_HELP}\n" in text
    assert f"* `--via {{a,b}}`: {NO_HELP}; required\n" in text
    assert "usage: tool go [--fast] [--to TO] --via {a,b}\n" in text
    assert "* `go`: go somewhere\n" in text


def test_the_reference_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    narrow = reference_markdown()
    monkeypatch.setenv("COLUMNS", "300")
    assert reference_markdown() == narrow


def test_help_text_is_escaped_for_markdown() -> None:
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--x", help="a *b* `c` [d] e|f <g> $H_I")
    assert "* `--x X`: a \\*b\\* \\`c\\` \\[d\\] e\\|f &lt;g> $H\\_I\n" in reference_markdown(parser)


def test_python_dash_m_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "jaild.cli_reference"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert out == reference_markdown()
