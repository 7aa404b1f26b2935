"""``jaild env``: the jail Python environments (placeholder; being written)."""

from __future__ import annotations

import argparse
from typing import Any


def add_env_commands(sub: Any) -> None:
    """Register ``jaild env ...`` on the CLI's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser("env", help="build and list jail Python environments")
    p.set_defaults(func=lambda args: 2)
