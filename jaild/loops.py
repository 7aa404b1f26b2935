"""Which asyncio event loop jaild's own processes run on.

The daemon (``daemon.event_loop``), the CLI and the blocking :class:`jaild.client.Client` run
their event loop here: the standard library's by default; uvloop (libuv, ``pip install
'jaild[uvloop]'``) when asked for, or with ``auto`` where it is installed. On the bench's
2-vCPU machine uvloop made a tool call's round trip faster in 8 of 10 runs and left a warm
job level; it is not the default because it has had fewer full runs of the suite than the
standard loop (docs/using/client.md, "Event loops"; docs/performance.md). ``AsyncClient``
runs on whatever loop its caller runs.

The jail's runtime never imports this module: inside a jail the standard loop runs the
code's ``await tools.x()`` (libuv would need system calls the jail's filter does not open).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from jaild.errors import MissingExtra
from jaild.extras import installed

CHOICES = ("asyncio", "uvloop", "auto")
"""``auto``: uvloop if it can be imported, else the standard loop."""
DEFAULT = "asyncio"

T = TypeVar("T")


def factory(choice: str = DEFAULT) -> Callable[[], asyncio.AbstractEventLoop]:
    """The constructor of the loop ``choice`` names (``uvloop``: :class:`MissingExtra`, an
    ``ImportError``, without ``jaild[uvloop]``)."""
    if choice not in CHOICES:
        raise ValueError(f"event loop must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    if not installed("uvloop"):
        if choice == "uvloop":
            raise MissingExtra("the event loop 'uvloop'", "uvloop")
        return asyncio.new_event_loop
    import uvloop

    return uvloop.new_event_loop


def new_event_loop(choice: str = DEFAULT) -> asyncio.AbstractEventLoop:
    """A new loop of the kind ``choice`` names."""
    return factory(choice)()


def run(main: Coroutine[Any, Any, T], choice: str = DEFAULT) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names."""
    with asyncio.Runner(loop_factory=factory(choice)) as runner:
        return runner.run(main)


def name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which kind ``loop`` is."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


__all__ = ["CHOICES", "DEFAULT", "factory", "name", "new_event_loop", "run"]
