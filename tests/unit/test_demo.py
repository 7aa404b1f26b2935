"""The demo's output: every line the job prints is marked as the jail's."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.conftest import REPO


def test_every_line_of_the_jails_output_is_prefixed(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("jaild_demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = demo.Prefixed("jail| ")
    for chunk in ("one\ntw", "o\n", "\nthree\nfour"):
        out(chunk)
    assert capsys.readouterr().out == "jail| one\njail| two\njail| \njail| three\njail| four"


def _demo() -> object:
    spec = importlib.util.spec_from_file_location("jaild_demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


class _Proc:
    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_the_demo_waits_for_the_daemons_ready_signal_not_for_a_time() -> None:
    """The demo connects once the daemon says READY=1 (sd_notify), however long its
    self-tests take; a daemon that died first ends the demo with its status."""
    import socket

    demo: Any = _demo()
    ours, daemons = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, daemons:
        daemons.send(b"STATUS=starting")
        daemons.send(b"READY=1\nSTATUS=serving 4 policies")
        demo.wait_until_ready(ours, _Proc(None))  # returns: ready
        with pytest.raises(SystemExit, match="exited early with status 3"):
            demo.wait_until_ready(ours, _Proc(3))
