"""A start that fails once the socket is claimed answers the connections waiting in its
backlog with the reason (jaild.daemon.startup.answer_waiting). The activated daemon's case,
end to end: tests/integration/test_systemd_integration.py."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from jaild.daemon.startup import answer_waiting
from jaild.errors import DaemonUnavailable
from jaild.protocol import FrameDecoder
from jaild.protocol.connection import HANDSHAKE_FRAME_BYTES
from jaild.protocol.messages import Error, decode


def _waiting(tmp_path: Path, count: int) -> tuple[socket.socket, list[socket.socket]]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s.sock"))
    listener.listen(8)
    clients = []
    for _ in range(count):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(tmp_path / "s.sock"))
        c.sendall(b"\x00\x00\x00\x05hello")  # what a client sends at once: its Hello
        clients.append(c)
    return listener, clients


def _answer(client: socket.socket) -> Error:
    client.settimeout(10)
    decoder = FrameDecoder(HANDSHAKE_FRAME_BYTES)
    while (frame := decoder.next_frame()) is None:
        data = client.recv(65536)
        assert data, "closed without an answer"
        decoder.feed(data)
    msg = decode(frame, "daemon->client")
    assert isinstance(msg, Error)
    return msg


def test_every_waiting_client_reads_why(tmp_path: Path) -> None:
    listener, clients = _waiting(tmp_path, 3)
    with listener:
        assert answer_waiting(listener, "/run/x.sock", "cgroup v2: no bus") == 3
        assert answer_waiting(listener, "/run/x.sock", "again") == 0  # none left
    for c in clients:
        with c:
            msg = _answer(c)
            assert (msg.code, msg.message) == (
                DaemonUnavailable.code, "the jaild daemon at /run/x.sock cannot start: cgroup "
                "v2: no bus")
            assert c.recv(1) == b""  # then closed


def test_another_uid_is_told_where_the_reason_is_not_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason describes the host (paths, ports, the cgroup tree): a client of another
    uid than the daemon's is told where to read it."""
    listener, clients = _waiting(tmp_path, 1)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)  # we are "another uid"
    with listener, clients[0]:
        answer_waiting(listener, "/run/x.sock", "/sys/fs/cgroup/secret: no bus")
        msg = _answer(clients[0])
    assert "secret" not in msg.message
    assert msg.message == ("the jaild daemon at /run/x.sock cannot start; its log says why "
                           "(journalctl -u jaild, or its stderr)")
