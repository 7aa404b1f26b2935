"""The command-line reference, in Markdown, generated from the CLI's own parser.

``docs/using/cli.md`` holds the output of :func:`reference_markdown` and a unit test keeps the
two equal (``tests/unit/test_cli_reference.py``). To regenerate it::

    python scripts/update_doc_references.py      # rewrites every generated table in docs/
    python -m jaild.cli_reference                 # or print this one alone

Every subcommand is listed, nested ones too (``jaild policy check``), with a usage line and
each argument with its help text, as ``--help`` shows it (a default is there when the help
text says it); an argument without help text says so. The output is built
from the parser's declarations alone, not from argparse's help formatter, so it does not
depend on the terminal's width or on the Python version's help layout.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from jaild.cli import build_parser

USAGE_WIDTH = 96
"""Usage lines are wrapped to this many characters, continuation lines indented."""

NO_HELP = "*(no help text)*"


def reference_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The CLI reference: one section per command, in the order the parser declares them.

    Args:
        parser: the parser to document; default: :func:`jaild.cli.build_parser`'s.

    Returns:
        Markdown, ending with a newline; the same for the same parser.
    """
    root = parser if parser is not None else build_parser()
    sections = [
        _section(prog, summary, p) for prog, summary, p in _commands(root.prog, None, root)
    ]
    return "\n".join(sections)


def _commands(
    prog: str, summary: str | None, parser: argparse.ArgumentParser
) -> Iterator[tuple[str, str | None, argparse.ArgumentParser]]:
    """(full command name, its one-line help, its parser) for this parser and every
    subcommand below it, depth first in declaration order."""
    yield prog, summary, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from _commands(f"{prog} {name}", helps.get(name), sub)


def _section(prog: str, summary: str | None, parser: argparse.ArgumentParser) -> str:
    lines = [f"### `{prog}`", ""]
    if summary:
        lines += [_text(summary), ""]
    if parser.description and parser.description != summary:
        lines += [_text(parser.description), ""]
    lines += ["```text", *_usage(prog, parser), "```", ""]
    arguments = [a for a in parser._actions if not _hidden(a)]
    for action in arguments:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name in action.choices:
                help_text = helps.get(name)
                lines.append(f"* `{name}`: {_text(help_text) if help_text else NO_HELP}")
        else:
            lines.append(f"* `{_invocation(action)}`: {_describe(action)}")
    if arguments:
        lines.append("")
    return "\n".join(lines)


def _hidden(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS


def _metavar(action: argparse.Action) -> str:
    if isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(action.choices) + "}"
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _args(action: argparse.Action) -> str:
    """The argument part of an invocation: ``M``, ``[M]``, ``M [M ...]``, or nothing."""
    m = _metavar(action)
    nargs = action.nargs
    if isinstance(action, argparse._SubParsersAction):
        return f"{m} ..."
    if nargs == 0:
        return ""
    if nargs is None:
        return m
    if nargs == argparse.OPTIONAL:
        return f"[{m}]"
    if nargs == argparse.ZERO_OR_MORE:
        return f"[{m} ...]"
    if nargs == argparse.ONE_OR_MORE:
        return f"{m} [{m} ...]"
    if isinstance(nargs, int):
        return " ".join([m] * nargs)
    return f"{m} ..."


def _invocation(action: argparse.Action) -> str:
    """How the argument is written: ``-r FILE, --requirements FILE``, ``--json``, ``NAME``."""
    args = _args(action)
    if not action.option_strings:
        return args
    return ", ".join(f"{o} {args}" if args else o for o in action.option_strings)


def _usage_token(action: argparse.Action) -> str:
    """One argument as the usage line shows it: the first option string only."""
    if not action.option_strings:
        return _args(action)
    args = _args(action)
    word = f"{action.option_strings[0]} {args}" if args else action.option_strings[0]
    return word if action.required else f"[{word}]"


def _usage(prog: str, parser: argparse.ArgumentParser) -> list[str]:
    """The usage line: options first (a mutually exclusive group as ``[A | B]``), then the
    positional arguments, wrapped to :data:`USAGE_WIDTH`."""
    grouped: dict[int, argparse._MutuallyExclusiveGroup] = {}
    for exclusive in parser._mutually_exclusive_groups:
        for action in exclusive._group_actions:
            grouped[id(action)] = exclusive
    tokens: list[str] = []
    done: set[int] = set()
    actions = [a for a in parser._actions if not _hidden(a)]
    for action in [a for a in actions if a.option_strings]:
        group = grouped.get(id(action))
        if group is None:
            tokens.append(_usage_token(action))
        elif id(group) not in done:
            done.add(id(group))
            inner = " | ".join(_usage_token(a).strip("[]") for a in group._group_actions)
            tokens.append(f"({inner})" if group.required else f"[{inner}]")
    tokens += [_usage_token(a) for a in actions if not a.option_strings]
    lines: list[str] = []
    line = f"usage: {prog}"
    indent = " " * len(line)
    for token in tokens:
        if len(line) + 1 + len(token) > USAGE_WIDTH and line.strip() != f"usage: {prog}":
            lines.append(line)
            line = indent
        line += " " + token
    lines.append(line)
    return lines


def _describe(action: argparse.Action) -> str:
    parts = [_text(action.help) if action.help else NO_HELP]
    if action.required and action.option_strings:
        parts.append("required")
    return "; ".join(parts)


def _text(text: str) -> str:
    """Help text as Markdown that renders as written: the characters Markdown would take as
    emphasis, code, links, HTML or a table cell are escaped."""
    out = []
    for ch in " ".join(text.split()):
        if ch in "\\`*_[]|":
            out.append("\\" + ch)
        elif ch == "<":
            out.append("&lt;")
        else:
            out.append(ch)
    return "".join(out)


def main() -> None:
    """``python -m jaild.cli_reference``: print the reference."""
    print(reference_markdown(), end="")


if __name__ == "__main__":
    main()
