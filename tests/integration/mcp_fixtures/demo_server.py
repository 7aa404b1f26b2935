"""A small real MCP server (the SDK's MCPServer, stdio) for the jaild mcp tests.

Tools: ``add``, ``search_repositories``, ``whoami`` (uses a secret from its own environment
and returns only a fingerprint of it), ``slow``, ``fail`` (always an error).
"""

from __future__ import annotations

import hashlib
import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("demo")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def search_repositories(query: str, limit: int = 3) -> list[dict[str, object]]:
    """Search code repositories by keyword.

    Returns name and stars for each hit."""
    return [{"name": f"{query}-{i}", "stars": 10 * i} for i in range(limit)]


@server.tool()
def whoami() -> str:
    """Who the server is authenticated as (it uses DEMO_SECRET from its environment)."""
    secret = os.environ.get("DEMO_SECRET", "")
    if not secret:
        raise ValueError("DEMO_SECRET is not set")
    return "user-" + hashlib.sha256(secret.encode()).hexdigest()[:8]


@server.tool()
async def slow(seconds: float) -> str:
    """Answers after a while."""
    await anyio.sleep(seconds)
    return "done"


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ToolError(f"failed on purpose: {reason}")


if __name__ == "__main__":
    server.run()
