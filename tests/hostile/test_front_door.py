"""The daemon's front door under a local user who floods it (issue 14, "Daemon resources
that one party can take from everyone").

Two real uids besides root reach the daemon's socket (group ``nogroup``): ``nobody``
(65534), whom ``access.users`` allows, and ``bin`` (2), whom it refuses. Each attack runs
as that uid in a subprocess of the base interpreter, with only the standard library, and
root -- the other tenant -- must still be served. Each test fails on the code before the
fix (checked against a19ce62's ``jaild/``: root refused ``busy: 40 connections open``, the
daemon's peak RSS up by the 288 MiB sent, 3,000 audit lines for 3,000 refused calls); the
positive controls are noted where they are made.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.daemon.observe.audit import REFUSALS_PER_WINDOW, REFUSED_CALLS_PER_JOB
from jaild.errors import Busy
from jaild.protocol import PROTOCOL_VERSION, Connection, Role
from jaild.protocol.connection import HANDSHAKE_FRAME_BYTES
from jaild.protocol.messages import Hello
from jaild.testing import frames
from tests.conftest import (
    REPO_POLICIES,
    DaemonHandle,
    guard,
    start_daemon,
    sweep_cgroups,
    until,
    world_tempdir,
)

pytestmark = pytest.mark.integration

REFUSED_UID = 2  # bin: not in access.users
ALLOWED_UID = 65534  # nobody: in access.users
NOGROUP = 65534  # the socket's group
MAX_CONNECTIONS, PER_UID = 16, 4
FLOOD = 40  # connections per flood: well past both limits
HUGE = 79 << 20  # the frame size announced
SENT = 24 << 20  # the part of it actually sent, per connection

# Run as the attacking uid: connect N times (optionally starting a huge frame on each),
# say "connected", wait for a line on stdin, then read what the daemon said on each
# connection until it closed (or, with "keep", do not read), and print it.
FLOODER = r"""
import json, socket, struct, sys
path, n, sent, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
huge, guard = int(sys.argv[5]), float(sys.argv[6])
hello = bytes.fromhex(sys.argv[7]) if len(sys.argv) > 7 else b""  # a framed Hello, or none
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    socks.append(s)
    if sent:
        try:
            s.sendall(hello + struct.pack(">I", huge))
            chunk = bytes(1 << 20)
            for _ in range(sent >> 20):
                s.sendall(chunk)
        except OSError:
            pass  # the daemon answered and closed: what it said is read below
print("connected", flush=True)
sys.stdin.readline()
out = []
if mode == "read":
    for s in socks:
        s.settimeout(guard)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass  # after the daemon's Error: it closed with our bytes unread
        out.append(data.hex())
print(json.dumps(out), flush=True)
sys.stdin.readline()
"""


HELLO = Connection(Role.CLIENT, 1 << 20).send(Hello(protocol=PROTOCOL_VERSION, client="flood"))


class Flood:
    """A flooder process running as ``uid``: see FLOODER."""

    def __init__(self, d: DaemonHandle, uid: int, n: int, sent: int = 0,
                 mode: str = "read", hello: bool = False) -> None:
        python = getattr(sys, "_base_executable", "") or sys.executable
        greeting = [HELLO.hex()] if hello else []
        self.proc = subprocess.Popen(
            [python, "-I", "-S", "-B", "-c", FLOODER, d.socket, str(n), str(sent), mode,
             str(HUGE), str(guard(60)), *greeting],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, user=uid, group=NOGROUP,
            extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        assert line == "connected\n", f"the flooder failed: {line!r}"

    def answers(self) -> list[bytes]:
        """What the daemon said on each connection, up to its close."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return [bytes.fromhex(h) for h in json.loads(self.proc.stdout.readline())]

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=guard(30))  # reaped, and its pipes closed


def vm_hwm(pid: int) -> int:
    """The process's peak resident set (bytes), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def audit_records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def door() -> Iterator[tuple[DaemonHandle, Path]]:
    """A daemon with small connection limits that ``nobody`` and ``bin`` can reach, and
    that allows root and ``nobody`` only; its audit file."""
    world = world_tempdir("jaild-test-door-")
    audit = world / "audit.jsonl"
    config = world / "jaild.toml"
    config.write_text(
        f'[daemon]\nsocket_group = "nogroup"\naudit_log = "{audit}"\n'
        '[access]\nusers = ["root", "nobody"]\n'
        f"[limits]\nmax_connections = {MAX_CONNECTIONS}\nmax_connections_per_uid = {PER_UID}\n"
        "handshake_timeout_s = 600\nframe_timeout_s = 600\n"
    )
    default = (REPO_POLICIES / "default.toml").read_text()
    d = start_daemon(world / "d", {"default": default}, with_repo_policies=False,
                     args=("--config", str(config)))
    try:
        yield d, audit
    finally:
        try:
            assert d.stop(signal.SIGTERM, timeout=30) == 0
        finally:
            sweep_cgroups(d)
            shutil.rmtree(world, ignore_errors=True)


def connections(d: DaemonHandle, c: Client | None = None) -> int:
    """The daemon's connections now, this client's own included. The listening socket is
    FIFO, so a connection made after a flood is accepted -- and the flood admitted or
    refused -- first."""
    if c is None:
        with Client(d.socket) as c:
            return connections(d, c)
    return int(c.stats()["running"]["connections"])


def settled(d: DaemonHandle) -> None:
    """Wait until the connections an earlier test closed are gone from the daemon."""
    until(lambda: connections(d) == 1, "the daemon noticing closed connections")


def test_a_refused_uid_cannot_fill_the_connection_table(
        door: tuple[DaemonHandle, Path]) -> None:
    d, audit = door
    settled(d)
    flood = Flood(d, REFUSED_UID, FLOOD)
    try:
        # Before the fix: every one of bin's connections held a slot until its Hello, and
        # root was refused "busy: 40 connections open".
        with Client(d.socket) as c:
            assert c.run("6 * 7").result == 42
            assert connections(d, c) == 1  # refused ones hold nothing: only root's own
        answers = flood.answers()
    finally:
        flood.close()
    # positive control: the flood did reach the daemon, and each connection was told why
    for data in answers:
        (error,) = frames(data, "daemon->client")
        assert error.code == "permission_denied"  # type: ignore[attr-defined]
        assert f"uid {REFUSED_UID} may not use this daemon" in error.message  # type: ignore[attr-defined]
    refused = [r for r in audit_records(audit)
               if r["event"] == "refused" and r["uid"] == REFUSED_UID]
    assert 1 <= len(refused) <= 2 * REFUSALS_PER_WINDOW  # audited, and rate-limited


def test_one_allowed_uid_cannot_fill_the_connection_table(
        door: tuple[DaemonHandle, Path]) -> None:
    d, _ = door
    settled(d)
    flood = Flood(d, ALLOWED_UID, FLOOD, mode="keep")  # never says Hello
    try:
        # Before the fix the per-uid cap applied only at Hello: nobody's 40 idle connections
        # all held slots, and root was refused busy.
        with Client(d.socket) as c:
            assert c.run("6 * 7").result == 42
            # counted from the first byte: nobody holds exactly its cap, Hello or not
            assert connections(d, c) == PER_UID + 1
    finally:
        flood.close()
    settled(d)
    # positive control: the same limit applies to root -- PER_UID raw connections that never
    # said Hello, and root's next client is refused naming the per-uid limit
    idle = [socket.socket(socket.AF_UNIX) for _ in range(PER_UID)]
    try:
        for s in idle:
            s.connect(d.socket)
        # on either loop: uvloop reads the refusal before the client has sent its Hello
        for loop in ("asyncio", "uvloop"):
            with pytest.raises(Busy, match=f"uid 0 already has {PER_UID} connections"):
                Client(d.socket, event_loop=loop)
    finally:
        for s in idle:
            s.close()


def test_huge_frames_before_hello_are_not_buffered(door: tuple[DaemonHandle, Path]) -> None:
    d, _ = door
    settled(d)
    before = vm_hwm(d.proc.pid)
    # The attack: 8 huge unfinished frames from a refused uid (before the fix
    # buffered whole: 8 x 24 MiB here) ...
    refused = Flood(d, REFUSED_UID, 8, sent=SENT)
    # ... and the same from an allowed uid that has not said Hello yet
    allowed = Flood(d, ALLOWED_UID, PER_UID, sent=SENT)
    try:
        grown, sent = vm_hwm(d.proc.pid) - before, (8 + PER_UID) * SENT
        # A memory bound with a wide margin: what was sent is 288 MiB; before the fix the
        # daemon's peak grew by about that much.
        assert grown < 64 << 20, f"the daemon's peak RSS grew by {grown >> 20} of {sent >> 20} MiB"
        answers = refused.answers(), allowed.answers()
    finally:
        refused.close()
        allowed.close()
    for data in answers[0]:
        assert frames(data, "daemon->client")[0].code == "permission_denied"  # type: ignore[attr-defined]
    for data in answers[1]:
        (error,) = frames(data, "daemon->client")
        assert error.code == "frame_too_large"  # type: ignore[attr-defined]
        assert f"before Hello; until the handshake a frame may have at most " \
               f"{HANDSHAKE_FRAME_BYTES} bytes" in error.message  # type: ignore[attr-defined]
    # positive control: after Hello, frames past the handshake's cap are the client's right
    code = "x = 1\n" + "#" * (2 * HANDSHAKE_FRAME_BYTES) + "\nx + 1"
    assert d.run(code).result == 2


def test_one_uids_unfinished_frames_after_hello_are_bounded(
    reachable_daemon: Callable[[dict[str, str], str], DaemonHandle],
) -> None:
    """After Hello a frame may be 80 MiB, so an allowed uid's unfinished frames on its
    connections (128 by default) could hold gigabytes of the daemon's memory; together
    they may hold limits.max_frame_bytes_per_uid (here its least: one 80 MiB frame)."""
    default = (REPO_POLICIES / "default.toml").read_text()
    budget = 80 << 20
    # frame_timeout_s ends the connections left under the budget, waiting for the rest of
    # their frame, so the flooder reads every connection to its end; it must not end one
    # before the flood is sent (a liveness guard)
    d = reachable_daemon({"default": default}, f"[limits]\nmax_frame_bytes_per_uid = {budget}\n"
                         f"frame_timeout_s = {guard(10)}\n")
    settled(d)
    before = vm_hwm(d.proc.pid)
    flood = Flood(d, ALLOWED_UID, 8, sent=SENT, hello=True)  # 8 x 24 MiB after Hello
    try:
        grown, sent = vm_hwm(d.proc.pid) - before, 8 * SENT
        answers = flood.answers()
        assert d.run("6 * 7").result == 42  # and everyone else is served
    finally:
        flood.close()
    # a memory bound with a wide margin: 192 MiB sent against a budget of 80 MiB
    assert grown < budget + (32 << 20), \
        f"the daemon's peak RSS grew by {grown >> 20} of {sent >> 20} MiB"
    errors = [frames(data, "daemon->client")[-1] for data in answers]
    codes = [e.code for e in errors]  # type: ignore[attr-defined]
    assert set(codes) <= {"frame_too_large", "read_timeout"}, codes
    assert codes.count("frame_too_large") >= 4, codes  # 192 MiB against 80
    over = next(e for e in errors if e.code == "frame_too_large")  # type: ignore[attr-defined]
    assert f"over its limit (limits.max_frame_bytes_per_uid {budget})" \
        in over.message  # type: ignore[attr-defined]


def test_unfinished_frames_within_the_budget_are_buffered(
    reachable_daemon: Callable[[dict[str, str], str], DaemonHandle],
) -> None:
    """The positive control: the same flood within a larger budget is buffered whole, as a
    large upload's frame must be."""
    default = (REPO_POLICIES / "default.toml").read_text()
    d = reachable_daemon({"default": default}, f"[limits]\nmax_frame_bytes_per_uid = {256 << 20}\n"
                         f"frame_timeout_s = {guard(10)}\n")
    settled(d)
    before = vm_hwm(d.proc.pid)
    flood = Flood(d, ALLOWED_UID, 8, sent=SENT, hello=True)
    try:
        until(lambda: vm_hwm(d.proc.pid) - before >= 8 * SENT - (8 << 20),
              what="the daemon buffering the eight unfinished frames")
        answers = flood.answers()
    finally:
        flood.close()
    assert [frames(data, "daemon->client")[-1].code  # type: ignore[attr-defined]
            for data in answers] == ["read_timeout"] * 8


SPIN = (
    "import os, msgpack, struct\n"
    "def send(obj):\n"
    "    b = msgpack.packb(obj)\n"
    "    os.write(3, struct.pack('>I', len(b)) + b)\n"
    "for i in range(1, {n} + 1):\n"
    "    send({{'type': 'CallTool', 'call_id': i, 'name': 'nope', 'args': msgpack.packb([[], {{}}])}})\n"
    "'spun'"
)


def test_a_job_spinning_on_an_unknown_tool_writes_a_bounded_audit(
        door: tuple[DaemonHandle, Path]) -> None:
    d, audit = door
    quota, calls = 1000, 3000
    r = d.run(SPIN.format(n=calls), tools={"real": lambda: 1}, limits={"tool_calls": quota})
    assert (r.status, r.result) == ("ok", "spun")
    # every call counts against limits.tool_calls: refused ones too
    assert len(r.tool_calls) + r.tool_calls_omitted == calls
    records = [x for x in audit_records(audit) if x.get("job") == r.job_id]
    lines = [x for x in records if x["event"] == "tool_call"]
    # before the fix: 3000 tool_call lines, and no summary
    assert len(lines) == REFUSED_CALLS_PER_JOB
    (summary,) = [x for x in records if x["event"] == "tool_calls_refused"]
    assert summary["refused"] == {"unknown_tool": quota, "quota_exceeded": calls - quota}
    assert summary["suppressed"] == calls - REFUSED_CALLS_PER_JOB
    (job,) = [x for x in records if x["event"] == "job"]
    assert job["tool_calls"] == calls
    # positive control: calls that are answered are each audited, as before
    ok = d.run("[await tools.real() for _ in range(30)]", tools={"real": lambda: 1})
    assert ok.result == [1] * 30
    answered = [x for x in audit_records(audit)
                if x.get("job") == ok.job_id and x["event"] == "tool_call"]
    assert len(answered) == 30 and {x["outcome"] for x in answered} == {"ok"}
