"""Which asyncio event loop jaild's own processes run on.

The daemon, the CLI and the blocking :class:`jaild.client.Client` run their event loop here:
uvloop (libuv) where it is installed -- it is a dependency on Linux -- and the standard
library's loop otherwise, or when asked for by name. Every hop of a job and of a tool call
is a socket read and write on one of these loops, and uvloop's cost less (README,
"Performance"). ``AsyncClient`` runs on whatever loop its caller runs; ``uvloop.run(main())``
gives a caller the same.

The jail's runtime never imports this module: inside a jail the standard loop runs the
code's ``await tools.x()`` (libuv would need system calls the jail's filter does not open).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

CHOICES = ("auto", "uvloop", "asyncio")
"""``auto``: uvloop if it can be imported, else the standard loop."""

T = TypeVar("T")


def factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """The constructor of the loop ``choice`` names (``uvloop``: ImportError if missing)."""
    if choice not in CHOICES:
        raise ValueError(f"event loop must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def new_event_loop(choice: str = "auto") -> asyncio.AbstractEventLoop:
    """A new loop of the kind ``choice`` names."""
    return factory(choice)()


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names."""
    with asyncio.Runner(loop_factory=factory(choice)) as runner:
        return runner.run(main)


def name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which kind ``loop`` is."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


__all__ = ["CHOICES", "factory", "name", "new_event_loop", "run"]
