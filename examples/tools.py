"""Example host tools for `jaild run --tools examples/tools.py`.

Every public function defined here becomes a tool: its name, its docstring as the
description, its signature and type hints as the argument schema.
"""

from __future__ import annotations

import asyncio

CATALOGUE = ["jail basics", "jail escapes", "seccomp in depth", "namespaces", "cgroups v2"]


def search(query: str, limit: int = 3) -> list[str]:
    """Search the catalogue for titles containing the query."""
    return [title for title in CATALOGUE if query.lower() in title][:limit]


async def word_count(text: str) -> int:
    """Count the words of a text (an async tool)."""
    await asyncio.sleep(0)
    return len(text.split())
