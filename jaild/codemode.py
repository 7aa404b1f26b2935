"""``jaild.codemode``: the code-mode LLM loop (placeholder: being written)."""

from __future__ import annotations

from typing import Any


def add_codemode_commands(sub: Any) -> None:
    """Register ``jaild codemode`` on the CLI's subparsers."""
    p = sub.add_parser("codemode", help="ask a model to solve a task by writing code run in jaild")
    p.set_defaults(func=lambda args: 2)
