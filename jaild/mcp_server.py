"""``jaild mcp``: an MCP server front end (placeholder: being written)."""

from __future__ import annotations

from typing import Any


def add_mcp_commands(sub: Any) -> None:
    """Register ``jaild mcp`` on the CLI's subparsers."""
    p = sub.add_parser("mcp", help="serve run_python over MCP (stdio or streamable HTTP)")
    p.set_defaults(func=lambda args: 2)
