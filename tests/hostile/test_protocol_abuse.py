"""Protocol abuse from inside the jail and from clients; daemon-level faults.

The jail's end of the channel is in the hostile code's hands (it can write any
bytes to fd 3): every frame it sends is validated by the daemon, and nothing it
sends can touch another job or the client beyond its own tool calls.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import pytest

from jaild.client import Client
from jaild.protocol import PROTOCOL_VERSION
from tests.conftest import REPO_POLICIES, STATE_DIR, DaemonHandle, free_socket, guard

pytestmark = pytest.mark.integration

SEND = (
    "import os, msgpack, struct\n"
    "def send(obj):\n"
    "    b = msgpack.packb(obj)\n"
    "    os.write(3, struct.pack('>I', len(b)) + b)\n"
)


def test_jail_repeats_its_handshake(hostile: DaemonHandle) -> None:
    r = hostile.run(SEND + "send({'type': 'JailReady', 'protocol': 2})\nimport time\ntime.sleep(5)")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "ChannelError"
    assert "JailReady is not allowed here" in r.error["message"]
    hostile.assert_serving()


def test_jail_sends_a_message_of_the_wrong_direction(hostile: DaemonHandle) -> None:
    r = hostile.run(SEND + "send({'type': 'RunJob', 'ref': 1, 'code': '1', 'policy': 'x'})\n"
                    "import time\ntime.sleep(5)")
    assert r.status == "error" and r.error is not None and r.error["type"] == "ChannelError"
    assert "unknown message type 'RunJob'" in r.error["message"]


def test_jail_floods_tool_calls(hostile: DaemonHandle) -> None:
    calls: list[int] = []
    code = SEND + (
        "for i in range(1, 5001):\n"
        "    send({'type': 'CallTool', 'call_id': 10**6 + i, 'name': 'count', 'args': msgpack.packb([[i], {}])})\n"
        "'flooded'"
    )
    r = hostile.run(code, policy="tiny", tools={"count": calls.append})  # tiny: 2 in flight
    assert (r.status, r.result) == ("ok", "flooded")
    refused = [c for c in r.tool_calls if c.get("error_type") == "too_many_calls"]
    assert refused  # the flood hit the in-flight cap
    assert len(r.tool_calls) <= 1000  # the record stays bounded ...
    assert len(r.tool_calls) + r.tool_calls_omitted >= len(calls)
    assert len(calls) < 5000  # ... and most calls never reached the host
    hostile.assert_serving()


def test_jail_sends_deeply_nested_arguments(hostile: DaemonHandle) -> None:
    got: list[object] = []
    code = SEND + (
        "nested = b'\\x91' * 100000 + b'\\xc0'\n"  # 100000 nested one-element arrays
        "send({'type': 'CallTool', 'call_id': 1, 'name': 'take', 'args': nested})\n"
        # the job ends once the call's answer is in (read off the channel here), so the
        # record has the call's outcome -- not after a sleep a slow host may outlast
        "import select\nselect.select([3], [], [], 60)\nanswer = os.read(3, 1 << 16)\n'sent'"
    )
    r = hostile.run(code, tools={"take": got.append})
    assert (r.status, r.result) == ("ok", "sent")
    assert got == []  # the client refused to decode it; the handler never ran
    assert r.tool_calls[0]["ok"] is False
    hostile.assert_serving()


def test_jail_lies_about_the_payload_length(hostile: DaemonHandle) -> None:
    # a frame that claims 2000 bytes and then stops: the job is stopped by its deadline,
    # not by the daemon waiting forever
    code = "import os, struct, time\nos.write(3, struct.pack('>I', 2000) + b'x' * 10)\ntime.sleep(30)"
    r = hostile.run(code, timeout=1)
    assert r.status == "timeout"
    hostile.assert_serving()


def test_reentrant_tool_call_runs_a_nested_job(hostile: DaemonHandle) -> None:
    with Client(hostile.socket) as c:
        def nested(code: str) -> object:
            """A tool that itself runs a job through the same client."""
            return c.run(code).result

        r = c.run("await tools.nested('21 * 2')", tools={"nested": nested})
    assert (r.status, r.result) == ("ok", 42)


def test_client_sends_deeply_nested_tool_schema(hostile: DaemonHandle) -> None:
    schema: dict[str, object] = {}
    node = schema
    for _ in range(100):
        node["x"] = {}
        node = node["x"]  # type: ignore[assignment]
    payload = msgpack.packb({"type": "RunJob", "ref": 1, "policy": "default",
                             "job": {"code": "1", "tools": [{"name": "t", "parameters": schema}]}})
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(hostile.socket)
        hello = msgpack.packb({"type": "Hello", "protocol": PROTOCOL_VERSION})
        s.sendall(struct.pack(">I", len(hello)) + hello + struct.pack(">I", len(payload)) + payload)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert b"bad_frame" in data and b"nested deeper than 32" in data
    hostile.assert_serving()


def test_a_client_that_never_reads(hostile: DaemonHandle) -> None:
    # it submits a job that prints a lot, then stops reading; others are not affected
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(hostile.socket)
        hello = msgpack.packb({"type": "Hello", "protocol": PROTOCOL_VERSION})
        job = msgpack.packb({"type": "RunJob", "ref": 1, "policy": "default",
                             "job": {"code": "for _ in range(2000):\n    print('z' * 400)"}})
        s.sendall(struct.pack(">I", len(hello)) + hello + struct.pack(">I", len(job)) + job)
        hostile.assert_serving()
        hostile.assert_serving()
    finally:
        s.close()
    hostile.assert_serving()


def test_many_concurrent_clients_and_one_abusive(hostile: DaemonHandle) -> None:
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with Client(hostile.socket) as c:
                assert c.run(f"{i} * 3").result == i * 3
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    with socket.socket(socket.AF_UNIX) as abusive:
        abusive.connect(hostile.socket)
        for t in threads:
            t.start()
        abusive.sendall(b"\xff" * 100000)
        for t in threads:
            t.join(60)
    assert errors == []


def test_daemon_refuses_to_start_without_nsjail(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jaild", "serve", "--socket", free_socket(tmp_path),
         "--policies", str(REPO_POLICIES), "--state-dir", STATE_DIR, "--nsjail", "/nonexistent/nsjail"],
        capture_output=True, text=True, timeout=guard(60), check=False,
    )
    assert out.returncode == 1
    assert "nsjail at /nonexistent/nsjail is missing or not executable" in out.stderr
    assert not any(tmp_path.glob("*.sock"))
