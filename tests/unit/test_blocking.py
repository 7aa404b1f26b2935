"""The blocking facade (jaild/blocking.py): one loop thread (``Portal``), and blocking
methods declared once from the asyncio class's -- their signatures, docstrings and
behaviour -- for Client, Job, Session, Fleet, FleetJob and FleetSession alike."""

from __future__ import annotations

import inspect
import pydoc
import threading
import typing
from typing import Any

import pytest

from jaild.blocking import Portal, blocking, wrapping
from jaild.client import AsyncClient, AsyncJob, AsyncSession, Client, Job, Session
from jaild.fleet import (
    AsyncFleet,
    AsyncFleetJob,
    AsyncFleetSession,
    Fleet,
    FleetJob,
    FleetSession,
)

FACADES = [(Client, AsyncClient), (Job, AsyncJob), (Session, AsyncSession),
           (Fleet, AsyncFleet), (FleetJob, AsyncFleetJob), (FleetSession, AsyncFleetSession)]


@pytest.mark.parametrize(("facade", "asynchronous"), FACADES, ids=lambda c: c.__name__)
def test_every_public_coroutine_method_has_its_blocking_twin(
    facade: type, asynchronous: type
) -> None:
    """What the asyncio class offers, the blocking one does, with the same parameters
    (``connect`` excepted: the blocking classes connect in their constructors)."""
    for name, method in vars(asynchronous).items():
        if name.startswith("_") or name == "connect" or not inspect.iscoroutinefunction(method):
            continue
        twin = getattr(facade, name, None)
        assert twin is not None and not inspect.iscoroutinefunction(twin), f"{facade}.{name}"
        theirs = list(inspect.signature(method, eval_str=True).parameters.values())[1:]
        ours = list(inspect.signature(twin, eval_str=True).parameters.values())[1:]
        if name == "result":  # a blocking wait takes a timeout besides
            ours = [p for p in ours if p.name != "timeout"]
        assert ours == theirs, f"{facade.__name__}.{name}"


class _AsyncThing:
    async def add(self, a: int, b: int = 1) -> int:
        """Add ``b`` to ``a``; see :class:`_AsyncThing`, ``await thing.add(1)``."""
        assert threading.current_thread().name == "probe-loop"
        return a + b

    def make(self, n: int) -> list[int]:
        """Make ``n`` things."""
        return list(range(n))


class _Thing:
    def __init__(self) -> None:
        self._async = _AsyncThing()
        self._portal = Portal("asyncio", "probe-loop")

    add = blocking(_AsyncThing.add, renames={"_AsyncThing": "_Thing", "await ": ""})
    doubled = blocking(_AsyncThing.add, wrap=lambda t, n: 2 * n, returns="int")
    make = wrapping(_AsyncThing.make, lambda t, xs: tuple(xs), returns="tuple[int, ...]")


def test_a_declared_method_runs_on_the_portal_and_reads_as_its_own() -> None:
    thing = _Thing()
    try:
        assert thing.add(2) == 3 and thing.add(2, b=5) == 7
        assert thing.doubled(1, 1) == 4  # wrapped on the way out
        assert thing.make(2) == (0, 1)  # no portal: made on the caller's thread
        assert str(inspect.signature(_Thing.add)) == "(self, a: int, b: int = 1) -> int"
        assert inspect.signature(_Thing.make).return_annotation == "tuple[int, ...]"
        assert typing.get_type_hints(_Thing.doubled)["return"] is int
        assert _Thing.add.__qualname__ == "_Thing.add"
        assert _Thing.add.__doc__ == "Add ``b`` to ``a``; see :class:`_Thing`, ``thing.add(1)``."
        assert "_AsyncThing.add" not in pydoc.render_doc(_Thing.add)
        assert _AsyncThing.add.__doc__ is not None and "await" in _AsyncThing.add.__doc__
        with pytest.raises(TypeError):
            thing.add()  # the asyncio method's own TypeError: no argument for a
    finally:
        thing._portal.close()
    assert thing._portal.closed
    thing._portal.close()  # idempotent


def test_the_portal_runs_in_the_callers_trace_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Portal.call hands the caller's tracing context on (a job sent from a traced thread
    joins its trace); Portal.wait (a job's result, with a timeout) needs none."""
    from jaild import tracing

    seen: list[Any] = []

    def within(context: Any, coro: Any) -> Any:
        seen.append(context)
        return coro

    monkeypatch.setattr(tracing, "caller_context", lambda: "the caller's")
    monkeypatch.setattr(tracing, "within", within)
    portal = Portal("asyncio")
    try:
        async def one() -> int:
            return 1

        assert portal.call(one()) == 1 and seen == ["the caller's"]
        assert portal.wait(one(), 5) == 1 and seen == ["the caller's"]
    finally:
        portal.close()


def test_blocking_docstrings_name_the_blocking_classes() -> None:
    assert "AsyncJob" not in (Client.submit.__doc__ or "")
    assert ":class:`Job`" in (Client.submit.__doc__ or "")
    assert "FleetJob" in (Fleet.submit.__doc__ or "") and "AsyncFleet" not in (Fleet.submit.__doc__ or "")
    assert typing.get_type_hints(Session.fork)["return"] == list[Session]
    assert typing.get_type_hints(Fleet.session)["return"] is FleetSession
    assert typing.get_type_hints(Client.submit)["return"] is Job
