"""Abuse of sessions and of file transfer: by other connections, by the jail, by forged data.

Every test ends with the daemon serving; the package fixture then checks nothing leaked
(processes, cgroups, descriptors, mounts, temporary files).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from jaild.client import Client
from jaild.errors import UnknownSession
from jaild.protocol.messages import CloseSession, Error, JobDescription, Message, RunJob
from tests.conftest import DaemonHandle, RawClient, guard
from tests.hostile.test_protocol_abuse import SEND

pytestmark = pytest.mark.integration

def raw(socket_path: str, *msgs: Message) -> list[Message]:
    """Send ``msgs``, each answered by one message; the answers (a daemon that answers
    fewer fails the liveness guard, RawClient's 30 s; more are not waited for)."""
    with RawClient(socket_path) as client:
        out = []
        for msg in msgs:
            client.send(msg)
            answer = client.next()
            assert answer is not None, f"no answer to {msg!r} (got {out!r})"
            out.append(answer)
        return out


def test_other_connections_cannot_use_or_close_a_session(hostile: DaemonHandle) -> None:
    with Client(hostile.socket) as c, c.session() as s:
        s.run("secret = 42")
        ident = s.id or ""
        run = RunJob(ref=1, job=JobDescription(code="secret"), policy="default", session_id=ident)
        answers = raw(hostile.socket, run, CloseSession(session_id=ident))
        codes = [a.code for a in answers if isinstance(a, Error)]
        assert codes == ["unknown_session", "unknown_session"], answers
        assert s.run("secret").result == 42  # untouched
        with pytest.raises(UnknownSession):  # ids are not guessable either
            c._call(c._client._submit("1", "default", None, {}, "ses-0000000000000000"))


def test_a_jail_talking_between_runs_ends_its_session(hostile: DaemonHandle) -> None:
    with Client(hostile.socket) as c:
        s = c.session().open()
        # the thread speaks once told to by a signal from the host -- sent after the run's
        # record is in hand, so between runs; not after a sleep a slow host may outlast
        r = s.run(SEND + "import signal, threading\ngo = threading.Event()\n"
                  "signal.signal(signal.SIGUSR1, lambda *_: go.set())\n"
                  "def later():\n    if go.wait(60):\n"
                  "        send({'type': 'CallTool', 'call_id': 1, 'name': 'x', 'args': b''})\n"
                  "threading.Thread(target=later, daemon=True).start()")
        assert r.status == "ok", r.error
        pids = hostile.job_pids(s.id or "")
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + guard(60)  # a liveness guard
        while s.closed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.closed == "error" and "protocol" in s.close_message, s.close_message
    hostile.assert_serving()


def test_a_forged_listing_too_big_for_the_channel(hostile: DaemonHandle) -> None:
    """A listing larger than the jail link's frame limit is a protocol error, not a buffer."""
    forge = (
        "open('trigger', 'w').write('t')  # the runtime lists only a working dir with files\n"
        "import jaild.runtime.files as f\n"
        "class Huge:\n"
        "    def to_wire(self):\n"
        "        return {'files': [], 'data': {f'f{i}': b'x' * 4096 for i in range(6000)},"
        " 'skipped': []}\n"
        "f.collect = lambda *a, **k: Huge()\n"
    )
    r = hostile.run(forge, download=["*"])
    assert r.status == "error" and r.error["type"] == "ChannelError", r.error
    assert "frame" in r.error["message"]
    assert r.downloads == {}
    hostile.assert_serving()


def test_a_forged_listing_of_hostile_shapes(hostile: DaemonHandle) -> None:
    for wire in ("None", "[1, 2]", "{'files': 'x', 'data': [], 'skipped': 3}",
                 "{'files': [{'path': None}], 'data': {1: 2}, 'skipped': [None]}",
                 "{'files': [{'path': 'a' * 5000, 'size': -1, 'sha256': 'zz'}]}"):
        forge = ("open('trigger', 'w').write('t')\nimport jaild.runtime.files as f\n"
                 f"class W:\n    def to_wire(self):\n        return {wire}\n"
                 "f.collect = lambda *a, **k: W()\n'done'")
        r = hostile.run(forge, download=["*"])
        assert (r.status, r.result) == ("ok", "done"), (wire, r.error)
        assert r.files == [] and r.downloads == {}, wire
    hostile.assert_serving()


def test_session_jails_leave_nothing_behind(hostile: DaemonHandle) -> None:
    with Client(hostile.socket) as c:
        for _ in range(5):
            with c.session() as s:
                s.run("import subprocess\nsubprocess.Popen(['sleep', '300'])\n"
                      "open('/tmp/x', 'w').write('x')")
    hostile.assert_serving()  # the package fixture checks processes, cgroups, descriptors
