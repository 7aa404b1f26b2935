"""The front door's pure parts: the pre-Hello frame cap, the rate-limited audit of refusals
and of refused tool calls, the connection limits' config rule, admission at accept."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from jaild.daemon.config import DaemonConfig, load_config_file
from jaild.daemon.observe.audit import (
    REFUSAL_WINDOW_S,
    REFUSALS_PER_WINDOW,
    REFUSED_CALLS_PER_JOB,
    AuditLog,
    Peer,
)
from jaild.errors import FrameTooLarge, PolicyError
from jaild.protocol import NEED_DATA, PROTOCOL_VERSION, Connection, Role
from jaild.protocol.connection import HANDSHAKE_FRAME_BYTES
from jaild.protocol.framing import HEADER
from jaild.protocol.messages import Error, Hello, Welcome
from jaild.testing import fake_daemon, frame, frames
from tests.conftest import guard

BIG = 79 << 20
PEER = Peer(pid=7, uid=1000, gid=1000)


# ----------------------------------------------------------------------------- frames


def test_a_large_frame_before_hello_is_refused_at_its_header() -> None:
    conn = Connection(Role.DAEMON, 80 << 20)
    conn.receive_data(HEADER.pack(BIG) + b"x" * 1000)
    with pytest.raises(FrameTooLarge, match=f"before Hello; .* at most {HANDSHAKE_FRAME_BYTES}"):
        conn.next_event()


def test_after_hello_the_links_own_limit_applies() -> None:
    # positive control: the same header, once Hello is in, is a frame being received
    conn = Connection(Role.DAEMON, 80 << 20)
    conn.receive_data(frame(Hello(protocol=PROTOCOL_VERSION)))
    assert isinstance(conn.next_event(), Hello)
    conn.send(Welcome(protocol=PROTOCOL_VERSION))
    conn.receive_data(HEADER.pack(BIG) + b"x" * 1000)
    assert conn.next_event() is NEED_DATA and conn.inside_frame
    assert conn.receive_limit == conn.max_frame_bytes == 80 << 20


def test_hello_itself_fits_the_handshake_cap_with_room() -> None:
    longest = frame(Hello(protocol=PROTOCOL_VERSION, client="c" * 256))
    assert len(longest) < HANDSHAKE_FRAME_BYTES // 100


def test_other_roles_are_not_capped_before_their_handshake() -> None:
    conn = Connection(Role.CLIENT, 80 << 20)
    assert conn.receive_limit == 80 << 20


# ----------------------------------------------------------------------------- audit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_refusals_are_rate_limited_per_uid_and_summarised(tmp_path: Path) -> None:
    path, clock = tmp_path / "audit.jsonl", Clock()
    audit = AuditLog(str(path), clock)
    written = [audit.refused(PEER, "permission_denied", "no") for _ in range(100)]
    assert written == [True] * REFUSALS_PER_WINDOW + [False] * (100 - REFUSALS_PER_WINDOW)
    other = Peer(pid=8, uid=0, gid=0)
    assert audit.refused(other, "busy", "full")  # another uid has its own budget
    clock.now += REFUSAL_WINDOW_S
    assert audit.refused(PEER, "busy", "again")  # a new window
    audit.close()
    got = records(path)
    summary = [r for r in got if r["event"] == "refused_summary"]
    assert summary == [{**summary[0], "uid": 1000, "audited": REFUSALS_PER_WINDOW,
                        "suppressed": {"permission_denied": 100 - REFUSALS_PER_WINDOW}}]
    single = [r for r in got if r["event"] == "refused"]
    assert len(single) == REFUSALS_PER_WINDOW + 2


def test_refused_tool_calls_are_summarised_at_the_jobs_end(tmp_path: Path) -> None:
    from jaild.protocol.records import JobRecord

    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    for _ in range(1000):
        audit.tool_call(PEER, "job-1", "nope", "unknown_tool", 0.0)
    for _ in range(5):
        audit.tool_call(PEER, "job-1", "nope", "quota_exceeded", 0.0)
    for _ in range(30):  # answered calls are bounded by the quota: each is written
        audit.tool_call(PEER, "job-1", "t", "ok", 0.01)
    audit.tool_call(PEER, "job-2", "nope", "unknown_tool", 0.0)
    # what the audit reads of a record: its call log of MAX_CALL_RECORDS, the rest counted
    record = SimpleNamespace(job_id="job-1", status="ok", policy="default", duration_s=1.0,
                             error=None, usage=None, session=None,
                             tool_calls=[SimpleNamespace(name="nope")] * 100,
                             tool_calls_omitted=935, network_refused=None, flow=None)
    audit.job(PEER, cast(JobRecord, record))
    refused = SimpleNamespace(**{**vars(record), "job_id": "job-3", "network_refused": 2})
    audit.job(PEER, cast(JobRecord, refused))
    audit.close()
    got = records(path)
    calls = [r for r in got if r["event"] == "tool_call" and r["job"] == "job-1"]
    assert len(calls) == REFUSED_CALLS_PER_JOB + 30
    summary = [r for r in got if r["event"] == "tool_calls_refused"]
    # job-2's one refusal was written on its own: no summary for it
    assert [s["job"] for s in summary] == ["job-1"]
    assert summary[0]["refused"] == {"unknown_tool": 1000, "quota_exceeded": 5}
    assert summary[0]["audited"] == REFUSED_CALLS_PER_JOB
    assert summary[0]["suppressed"] == 1005 - REFUSED_CALLS_PER_JOB
    job = next(r for r in got if r["event"] == "job")
    assert job["tool_calls"] == 1035
    assert "network_refused" not in job  # nil or 0: not written
    assert next(r for r in got if r.get("job") == "job-3")["network_refused"] == 2
    assert got.index(summary[0]) < got.index(job)  # the summary comes before the job's record


# ----------------------------------------------------------------------------- config


def test_one_uid_may_not_take_every_connection(tmp_path: Path) -> None:
    p = tmp_path / "jaild.toml"
    p.write_text("[limits]\nmax_connections = 64\n")
    with pytest.raises(PolicyError, match=r"limits.max_connections_per_uid: must be less than "
                                          r"limits.max_connections \(64\)"):
        load_config_file(str(p))
    p.write_text("[limits]\nmax_connections = 64\nmax_connections_per_uid = 63\n")
    assert load_config_file(str(p))["limits"].max_connections_per_uid == 63  # control


def test_a_uids_frame_budget_holds_one_frame_of_the_largest_size(tmp_path: Path) -> None:
    p = tmp_path / "jaild.toml"
    p.write_text("[limits]\nmax_frame_bytes = 1048576\nmax_frame_bytes_per_uid = 1048575\n")
    with pytest.raises(PolicyError, match=r"limits.max_frame_bytes_per_uid: must be at least "
                                          r"limits.max_frame_bytes \(1048576\)"):
        load_config_file(str(p))
    p.write_text("[limits]\nmax_frame_bytes = 1048576\nmax_frame_bytes_per_uid = 1048576\n")
    assert load_config_file(str(p))["limits"].max_frame_bytes_per_uid == 1048576  # control
    derived = DaemonConfig(max_frame_bytes=1 << 20)
    assert derived.frame_bytes_per_uid == 2 << 20  # 0: twice the largest frame


# ----------------------------------------------------------------------------- the door


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


def test_a_refused_peer_is_answered_before_it_says_anything() -> None:
    async def main(users: tuple[str, ...]) -> bytes:
        config = DaemonConfig(allowed_users=users, probe_policies=False)
        async with asyncio.timeout(guard(60)), fake_daemon(config=config) as fake:
            raw = fake.raw_connection()
            raw.setblocking(False)
            loop = asyncio.get_running_loop()
            if users == ("*",):  # control: an allowed peer is answered only after Hello
                await loop.sock_sendall(raw, frame(Hello(protocol=PROTOCOL_VERSION)))
            data = await loop.sock_recv(raw, 1 << 16)
            raw.close()
            return data

    refused = frames(asyncio.run(main(("nobody-at-all-9",))), "daemon->client")
    assert isinstance(refused[0], Error) and refused[0].code == "permission_denied"
    served = frames(asyncio.run(main(("*",))), "daemon->client")
    assert isinstance(served[0], Welcome)


# ----------------------------------------------------------------------------- the unit


def test_the_service_has_a_memory_ceiling_that_leaves_the_host_some() -> None:
    from tests.unit.test_systemd_units import SERVICE, settings

    unit = settings(SERVICE)
    (ceiling,) = unit[("Service", "MemoryMax")]
    assert ceiling.endswith("%") and 50 <= int(ceiling[:-1]) < 100
    # an OOM kill under the ceiling is a job's end, not the service's
    assert unit[("Service", "OOMPolicy")] == ["continue"]


def test_an_egress_record_holds_the_summary_fields_and_nothing_else(tmp_path: Path) -> None:
    """Whatever a summary carries, the audit writes only the named fields (never a header
    or its value)."""
    import json

    from jaild.daemon.core.peer import Peer
    from jaild.daemon.observe.audit import EGRESS_FIELDS, AuditLog

    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    audit.egress(Peer(1, 1000, 1000), "job-1", {
        "policy": "web", "method": "GET", "host": "api.github.com", "port": 443, "status": 200,
        "bytes_out": 10, "bytes_in": 20, "intercepted": True,
        "authorization": "Bearer secret", "headers": {"x": "y"},
    })
    audit.close()
    record = json.loads(path.read_text())
    assert record["event"] == "egress" and record["job"] == "job-1" and record["uid"] == 1000
    assert set(record) - {"ts", "event", "job", "uid"} <= set(EGRESS_FIELDS)
    assert "secret" not in path.read_text()
