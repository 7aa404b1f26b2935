"""jaild: run untrusted, LLM-written Python in fresh nsjail jails.

The public API is imported lazily so that the in-jail runtime, which only
imports ``jaild.runtime`` and ``jaild.protocol``, never loads the client or
daemon code. ``__version__`` is :mod:`jaild.version`'s, lazily too: no module of the
package imports from ``jaild`` itself, since that arrow back up to this file, which
imports them, would be a circle (tests/unit/test_layering.py, rule "package").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaild.client import AsyncClient, Client, JobResult
    from jaild.errors import JaildError
    from jaild.fleet import AsyncFleet, Fleet
    from jaild.toolspec import Labeled, tool
    from jaild.version import __version__

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
    if name == "__version__":
        from jaild.version import __version__

        return __version__
    if name == "JaildError":
        from jaild.errors import JaildError

        return JaildError
    raise AttributeError(f"module 'jaild' has no attribute {name!r}")
