"""A job's ``JobAccepted`` waits (briefly) for the job's next message: one write, one
wake-up of the client per warm job. Never after anything about the job, never for long."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

from jaild.daemon.config import DaemonConfig
from jaild.daemon.server import ACCEPT_HOLD_S, ServedConnection
from jaild.protocol.connection import State
from jaild.protocol.framing import FrameDecoder
from jaild.protocol.messages import JobAccepted, JobOutput, Message, decode

J1, J2 = "job-" + "1" * 20, "job-" + "2" * 20


def _messages(chunks: list[bytes]) -> list[list[Message]]:
    """Each write's messages, in order."""
    out = []
    for chunk in chunks:
        frames = FrameDecoder(1 << 20)
        frames.feed(chunk)
        msgs = []
        while (payload := frames.next_frame()) is not None:
            msgs.append(decode(payload, "daemon->client"))
        out.append(msgs)
    return out


class _Registry:
    """A daemon with no jobs and no sessions, as far as a closing connection asks."""

    def disconnect(self, session: object) -> None:
        pass

    def jobs(self, owner: object) -> list[Any]:
        return []

    def sessions(self, owner: object) -> list[Any]:
        return []


async def _session() -> tuple[ServedConnection, list[bytes], socket.socket]:
    ours, theirs = socket.socketpair()
    daemon = SimpleNamespace(
        config=DaemonConfig(), registry=_Registry(), frame_bytes={}, connected=lambda _: None,
        approvals=SimpleNamespace(park_held=lambda _: None, detach=lambda _: None),
    )
    session = ServedConnection(daemon)  # type: ignore[arg-type]
    transport, _ = await asyncio.get_running_loop().create_unix_connection(
        lambda: session, sock=ours
    )
    session.conn.state = State.READY  # past the handshake, as on a served connection
    writes: list[bytes] = []
    real = transport.write

    def write(data: Any) -> None:
        writes.append(bytes(data))
        real(data)

    transport.write = write  # type: ignore[method-assign]
    return session, writes, theirs


def test_the_accept_goes_out_with_the_jobs_next_message_and_no_other_jobs() -> None:
    async def main() -> list[bytes]:
        session, writes, theirs = await _session()
        session.accept(7, J1)
        session.send(JobOutput(job_id=J2, stream="stdout", data=b"other"))
        session.send(JobOutput(job_id=J1, stream="stdout", data=b"mine"))
        await asyncio.sleep(2 * ACCEPT_HOLD_S)  # its timer was cancelled: nothing more
        session.close()
        theirs.close()
        await asyncio.sleep(0)
        return writes

    writes = asyncio.run(main())
    first, second = _messages(writes)
    assert [type(m).__name__ for m in first] == ["JobOutput"] and first[0].job_id == J2
    assert [type(m).__name__ for m in second] == ["JobAccepted", "JobOutput"]
    assert second[0] == JobAccepted(ref=7, job_id=J1) and second[1].job_id == J1


def test_a_job_still_running_is_announced_on_its_own() -> None:
    async def main() -> list[bytes]:
        session, writes, theirs = await _session()
        session.accept(7, J1)
        assert writes == []  # held
        theirs.setblocking(False)
        reader, their_writer = await asyncio.open_connection(sock=theirs)
        data = await asyncio.wait_for(reader.read(1 << 16), 30)  # written by its timer
        session.close()
        their_writer.close()
        await asyncio.sleep(0)
        return [data]

    (alone,) = _messages(asyncio.run(main()))
    assert alone == [JobAccepted(ref=7, job_id=J1)]


def test_a_closed_connection_drops_what_it_held() -> None:
    async def main() -> tuple[list[bytes], ServedConnection]:
        session, writes, theirs = await _session()
        session.accept(7, J1)
        session.close()
        await asyncio.sleep(2 * ACCEPT_HOLD_S)
        theirs.close()
        await asyncio.sleep(0)
        return writes, session

    writes, session = asyncio.run(main())
    assert writes == [] and session._held == {}
