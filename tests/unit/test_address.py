"""Where clients look for the daemon (jaild/address.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from jaild.address import DEFAULT_SOCKET, nobody_listening, socket_from_env


def test_socket_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAILD_SOCKET", raising=False)
    assert socket_from_env() == (DEFAULT_SOCKET, False)
    assert socket_from_env("/x.sock") == ("/x.sock", True)
    monkeypatch.setenv("JAILD_SOCKET", "/env.sock")
    assert socket_from_env() == ("/env.sock", True)
    assert socket_from_env("/x.sock") == ("/x.sock", True)


def test_nobody_listening(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sock")
    assert nobody_listening(path)  # no file
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        assert nobody_listening(path)  # a socket file, but nothing accepts: refused
        s.listen()
        assert not nobody_listening(path)  # control: a listener is seen
