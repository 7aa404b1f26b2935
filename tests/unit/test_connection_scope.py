"""A connection's work runs in its scope (ServedConnection.serve), even work started before the
task running serve() has taken its first step: uvloop may deliver a client's first bytes --
Hello and a RunJob in one write -- in the same loop iteration as connection_made, before
that task runs. Such a job was placed (its jail taken from the pool) and then refused a
scope, and its jail and cgroups outlived it (found by the hostile suite's teardown)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import uvloop  # the test extra's: jaild's other loop

from jaild.daemon.config import DaemonConfig
from jaild.daemon.server import ServedConnection


class _Registry:
    def disconnect(self, session: object) -> None:
        pass

    def jobs(self, owner: object) -> list[object]:
        return []

    def sessions(self, owner: object) -> list[object]:
        return []


def _session() -> ServedConnection:
    daemon = SimpleNamespace(
        config=DaemonConfig(), registry=_Registry(), frame_bytes={}, connected=lambda _: None,
        approvals=SimpleNamespace(park_held=lambda _: None, detach=lambda _: None),
    )
    return ServedConnection(daemon)  # type: ignore[arg-type]


def test_work_started_before_serve_begins_runs_in_its_scope_and_is_waited_for() -> None:
    async def main() -> list[str]:
        session, ran = _session(), []
        release = asyncio.Event()

        async def work(name: str) -> None:
            await release.wait()
            ran.append(name)

        session.start(work("early"))  # before serve() has begun
        served = asyncio.create_task(session.serve())
        await asyncio.sleep(0)
        session.start(work("later"))
        session.close()  # the conversation is over; serve() still waits for its work
        await asyncio.sleep(0.01)
        assert not served.done() and ran == []
        release.set()
        await asyncio.wait_for(served, 5)
        with pytest.raises(RuntimeError, match="not serving"):
            session.start(work("after"))
        return ran

    assert sorted(asyncio.run(main())) == ["early", "later"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_which_comes_first_a_waiting_first_write_or_a_task_made_in_connection_made(
    loop: str, tmp_path: Path
) -> None:
    """The module's premise, on a listening socket as the daemon's: under uvloop (a daemon's
    choice: daemon.event_loop) the bytes come first; under asyncio's own loop, the task (a control)."""
    run = asyncio.run if loop == "asyncio" else uvloop.run

    async def main() -> list[str]:
        order: list[str] = []
        arrived = asyncio.Event()

        class Session(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                asyncio.get_running_loop().create_task(self.first_step())

            async def first_step(self) -> None:
                order.append("task")

            def data_received(self, data: bytes) -> None:
                order.append("data")
                arrived.set()

        path = str(tmp_path / "sock")
        server = await asyncio.get_running_loop().create_unix_server(Session, path)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)
            client.sendall(b"Hello and RunJob")  # waiting before the daemon accepts
            await asyncio.wait_for(arrived.wait(), 5)
            await asyncio.sleep(0)
        server.close()
        return order

    expected = ["task", "data"] if loop == "asyncio" else ["data", "task"]
    assert run(main()) == expected
