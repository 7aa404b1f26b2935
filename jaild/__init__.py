"""jaild: run untrusted, LLM-written Python in fresh nsjail jails.

The public API is imported lazily so that the in-jail runtime, which only
imports ``jaild.runtime`` and ``jaild.protocol``, never loads the client or
daemon code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from jaild.client import AsyncClient, Client, JobResult
    from jaild.errors import JaildError
    from jaild.fleet import AsyncFleet, Fleet
    from jaild.toolspec import Labeled, tool

__all__ = ["AsyncClient", "AsyncFleet", "Client", "Fleet", "JaildError", "JobResult",
           "Labeled", "__version__", "tool"]


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client", "JobResult"):
        from jaild import client

        return getattr(client, name)
    if name in ("AsyncFleet", "Fleet"):
        from jaild import fleet

        return getattr(fleet, name)
    if name in ("tool", "Labeled"):
        from jaild import toolspec

        return getattr(toolspec, name)
    if name == "JaildError":
        from jaild.errors import JaildError

        return JaildError
    raise AttributeError(f"module 'jaild' has no attribute {name!r}")
