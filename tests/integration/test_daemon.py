"""The daemon under hostile or broken clients, bad policies, and at start and stop."""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from jaild.client import Client
from jaild.errors import BadRequest, PermissionDenied, UnknownPolicy
from jaild.protocol import PROTOCOL_VERSION
from tests.conftest import REPO, DaemonHandle, guard, policy_texts, start_daemon

pytestmark = pytest.mark.integration


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def read_frames(sock: socket.socket, timeout: float = 10) -> list[dict[str, Any]]:
    """Every frame until the daemon closes the connection (or the timeout)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        pass
    out = []
    while len(data) >= 4:
        (n,) = struct.unpack(">I", data[:4])
        out.append(msgpack.unpackb(data[4 : 4 + n], raw=False))
        data = data[4 + n :]
    return out


def raw_exchange(daemon: DaemonHandle, payload: bytes, *, hello: bool = False) -> list[dict[str, Any]]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        if hello:
            s.sendall(frame({"type": "Hello", "protocol": PROTOCOL_VERSION, "client": "raw"}))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)  # EOF after our input: the daemon answers, then closes
        return read_frames(s)


HELLO_WELCOME = {"type": "Welcome", "protocol": PROTOCOL_VERSION}


@pytest.mark.parametrize(
    ("payload", "hello", "code"),
    [
        (b"\x00\x00\x00\x05garbage-and-more", False, "bad_frame"),
        (b"\xff\xff\xff\xff", False, "frame_too_large"),
        (frame({"type": "RunJob", "ref": 1, "job": {"code": "1"}, "policy": "default"}), False,
         "unexpected_message"),
        (frame({"type": "Hello", "protocol": 99}), False, "unsupported_version"),
        (frame([1, 2, 3]), True, "bad_frame"),
        (frame({"type": "Welcome", "protocol": PROTOCOL_VERSION}), True, "bad_frame"),
        (frame({"type": "RunJob", "ref": 1, "job": {"code": 5}, "policy": "default"}), True,
         "bad_frame"),
        (frame({"type": "RunJob", "ref": 1, "job": {"code": "1"}, "policy": "default",
                "evil": 1}), True, "bad_frame"),
        (frame({"type": "RunJob", "ref": 1, "job": {"code": "1", "evil": 1},
                "policy": "default"}), True, "bad_frame"),
        # protocol 5's shape, the job's fields beside ref and policy: named, not guessed at
        (frame({"type": "RunJob", "ref": 1, "code": "1", "policy": "default"}), True,
         "bad_frame"),
        (frame({"type": "Hello", "protocol": PROTOCOL_VERSION}), True, "unexpected_message"),
        (b"\x00\x00\x00\x03\xc1\xc1\xc1", True, "bad_frame"),
    ],
    ids=["garbage", "oversize-length", "before-hello", "wrong-version", "not-a-map",
         "wrong-direction", "wrong-field-type", "unknown-field", "unknown-job-field",
         "protocol-5-shape", "second-hello", "invalid-msgpack"],
)
def test_bad_input_gets_an_error_frame_and_the_daemon_keeps_serving(
    daemon: DaemonHandle, payload: bytes, hello: bool, code: str
) -> None:
    frames = raw_exchange(daemon, payload, hello=hello)
    errors = [f for f in frames if f.get("type") == "Error"]
    assert errors, frames
    assert errors[-1]["code"] == code
    assert errors[-1]["message"]
    daemon.assert_serving()


def test_truncated_frame_then_disconnect(daemon: DaemonHandle) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(frame({"type": "Hello", "protocol": PROTOCOL_VERSION})[:-2])
    daemon.assert_serving()


def test_semantic_errors_keep_the_connection(daemon: DaemonHandle) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(daemon.socket)
        s.sendall(frame({"type": "Hello", "protocol": PROTOCOL_VERSION}))
        s.sendall(frame({"type": "CancelJob", "job_id": "job-0000"}))
        s.sendall(frame({"type": "ToolReturned", "job_id": "job-0001", "call_id": 1, "value": b"\xc0"}))
        s.sendall(frame({"type": "RunJob", "ref": 7, "job": {"code": "1"},
                         "policy": "no-such-policy"}))
        s.sendall(frame({"type": "ListPolicies", "ref": 8}))
        s.shutdown(socket.SHUT_WR)
        frames = read_frames(s)
    kinds = [(f["type"], f.get("code")) for f in frames]
    assert kinds[:5] == [("Welcome", None), ("Error", "unknown_job"), ("Error", "unknown_job"),
                         ("Error", "unknown_policy"), ("PolicyList", None)]
    assert frames[3]["ref"] == 7


def test_a_client_cannot_touch_another_clients_job(daemon: DaemonHandle) -> None:
    release = threading.Event()
    with Client(daemon.socket) as owner:
        job = owner.submit("await tools.hold()", tools={"hold": lambda: release.wait(guard(20))})
        frames = raw_exchange(
            daemon,
            frame({"type": "CancelJob", "job_id": job.job_id})
            + frame({"type": "ToolReturned", "job_id": job.job_id, "call_id": 1,
                     "value": msgpack.packb("forged")}),
            hello=True,
        )
        assert [f.get("code") for f in frames if f["type"] == "Error"] == ["unknown_job"] * 2
        release.set()
        r = job.result(guard(20))
    assert (r.status, r.result) == ("ok", True)


def test_refused_requests_are_clear_errors(client: Client) -> None:
    with pytest.raises(UnknownPolicy, match="no policy 'nope'; this daemon serves: data, default"):
        client.run("1", policy="nope")
    with pytest.raises(BadRequest, match="accepts at most"):
        client.run("x = 1\n" * 50000)
    with pytest.raises(PermissionDenied, match="may not use policy 'nobody-allowed'"):
        client.run("1", policy="nobody-allowed")


def test_duplicate_tool_names_are_refused(daemon: DaemonHandle) -> None:
    tool = {"name": "t", "description": "", "parameters": {}}
    frames = raw_exchange(
        daemon,
        frame({"type": "RunJob", "ref": 3, "job": {"code": "1", "tools": [tool, tool]},
               "policy": "default"})
        + frame({"type": "ListPolicies", "ref": 4}),
        hello=True,
    )
    assert frames[1]["type"] == "Error" and frames[1]["code"] == "bad_request"
    assert frames[1]["ref"] == 3 and "unique" in frames[1]["message"]


def test_policies_lists_what_this_user_may_use(client: Client) -> None:
    names = {p["name"] for p in client.policies()}
    assert {"default", "strict", "tiny"} <= names
    assert "nobody-allowed" not in names
    default = next(p for p in client.policies() if p["name"] == "default")
    assert default["limits"]["memory_mb"] == 256 and default["network"] == "none"


def test_socket_is_created_0660(daemon: DaemonHandle) -> None:
    mode = os.stat(daemon.socket).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


def test_daemon_refuses_to_start_on_an_invalid_policy(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, {"broken": "[limits]\nmemory_mb = -5\n"}, wait=False)
    assert d.proc.wait(guard(60)) == 1
    log = d.log()
    assert "broken.toml: limits.memory_mb: must be between 16 and 1048576, got -5" in log
    assert not os.path.exists(d.socket)


def test_a_missing_policy_directory_is_named_as_what_it_is(tmp_path: Path) -> None:
    """Not "invalid policy": the directory is missing, and the message says how to name one."""
    missing = tmp_path / "no-policies"
    r = subprocess.run(
        [sys.executable, "-m", "jaild", "serve", "--socket", str(tmp_path / "s.sock"),
         "--policies", str(missing)], capture_output=True, text=True, timeout=guard(60),
        check=False,
    )
    assert r.returncode == 1
    assert (f"cannot load policies: {missing}: policy directory does not exist (set "
            "daemon.policies_dir in the config file, --policies or JAILD_POLICIES)") in r.stderr
    assert "invalid policy" not in r.stderr


def test_daemon_refuses_a_policy_whose_env_is_missing(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, {"noenv": '[python]\nenv = "does-not-exist"\n'}, wait=False)
    assert d.proc.wait(guard(60)) == 1
    assert "noenv.toml: python.env: environment /var/lib/jaild/envs/does-not-exist does not exist" in d.log()


def test_stale_socket_is_replaced_but_a_live_one_is_not(private_daemon: Callable[..., DaemonHandle],
                                                       tmp_path: Path) -> None:
    first = private_daemon(policy_texts("default"), with_repo_policies=False)
    # A second daemon on the same socket must refuse: someone is listening.
    clash = subprocess.run(
        [sys.executable, "-m", "jaild", "serve", "--socket", first.socket, "--policies",
         first.policies_dir], capture_output=True, text=True, timeout=guard(60), check=False,
    )
    assert clash.returncode == 1
    assert "another daemon is already listening" in clash.stderr
    first.assert_serving()
    # Kill -9 the first: its socket file stays behind, stale. A new daemon replaces it.
    first.proc.kill()
    first.proc.wait()
    assert os.path.exists(first.socket)
    restarted = subprocess.Popen(
        [sys.executable, "-m", "jaild", "serve", "--socket", first.socket, "--policies",
         first.policies_dir], stderr=subprocess.PIPE, text=True,
    )
    try:
        from tests.conftest import wait_listening

        wait_listening(first.socket, restarted, first.log_path)
        with Client(first.socket) as c:
            assert c.run("1 + 1").result == 2
    finally:
        restarted.terminate()
        _, err = restarted.communicate(timeout=guard(30))
    assert "removed stale socket" in err
    assert restarted.returncode == 0


def test_a_non_socket_at_the_socket_path_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "not-a-socket"
    target.write_text("precious")
    out = subprocess.run(
        [sys.executable, "-m", "jaild", "serve", "--socket", str(target)],
        capture_output=True, text=True, timeout=guard(60), check=False,
    )
    assert out.returncode == 1
    assert "exists and is not a socket" in out.stderr
    assert target.read_text() == "precious"


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_the_daemon_serves_jobs_and_tool_calls_on_either_event_loop(
        private_daemon: Callable[..., DaemonHandle], tmp_path: Path, event_loop: str) -> None:
    config = tmp_path / "jaild.toml"
    config.write_text(f'[daemon]\nevent_loop = "{event_loop}"\n')
    d = private_daemon(policy_texts("default"), with_repo_policies=False, args=("--config", str(config)))
    serving = [line for line in d.log().splitlines() if " serving " in line]
    assert serving and serving[0].endswith(f"; {event_loop}"), serving
    with Client(d.socket, event_loop="asyncio") as c:
        r = c.run("[await tools.double(21), await tools.double(2)]", tools={"double": lambda x: 2 * x})
    assert (r.status, r.result) == ("ok", [42, 4]), r.error


def _slices() -> tuple[int, int]:
    """A fresh process's slice before and after it asks for 100 us: the kernel's default, and
    whether the kernel keeps a per-task slice (6.12+; before, both read 0)."""
    probe = subprocess.run(
        [sys.executable, "-c", "from jaild.daemon import sched\n"
         "before = sched.slice_ns()\nsched.request_slice(100)\nprint(before, sched.slice_ns())"],
        capture_output=True, text=True, check=True, timeout=guard(30),
    )
    before, after = map(int, probe.stdout.split())
    return before, after


def test_the_daemon_asks_for_a_short_slice_and_its_jails_keep_the_kernels_default(
        private_daemon: Callable[..., DaemonHandle], tmp_path: Path) -> None:
    from jaild.daemon import sched

    d = private_daemon(policy_texts("default"), with_repo_policies=False)  # the default: daemon.sched_slice_us = 100
    said = [line for line in d.log().splitlines() if "scheduling: " in line]
    default, asked = _slices()
    if asked != 100_000:  # before 6.12 the request does nothing, and the daemon says so
        assert said and said[0].endswith("(this kernel has no per-task slices; 6.12 does)"), said
        assert sched.slice_ns(d.proc.pid) == default
        return
    assert default != 100_000
    assert said and said[0].endswith("scheduling: a 100 us slice"), said
    assert sched.slice_ns(d.proc.pid) == 100_000  # positive control: the daemon has it
    with Client(d.socket) as c:
        seen = threading.Event()
        job = c.submit("import time\nprint('up', flush=True)\ntime.sleep(600)",
                       on_stdout=lambda _: seen.set())
        assert seen.wait(guard(60))
        pids = d.job_pids(job.job_id)
        assert pids
        # the jail (forked from a zygote the daemon spawned) has the kernel's default
        assert {p: sched.slice_ns(p) for p in pids} == dict.fromkeys(pids, default)
        job.cancel()
        assert job.result(guard(60)).status == "cancelled"
    # and 0 leaves the kernel's default for the daemon too
    config = tmp_path / "jaild.toml"
    config.write_text("[daemon]\nsched_slice_us = 0\n")
    off = private_daemon(policy_texts("default"), with_repo_policies=False, args=("--config", str(config)))
    assert "scheduling: the kernel's default slice" in off.log()
    assert sched.slice_ns(off.proc.pid) == default


def test_a_daemon_says_at_info_only_what_is_news_and_a_failed_start_ends_on_its_reason(
        private_daemon: Callable[..., DaemonHandle], tmp_path: Path) -> None:
    """``jaild serve`` at its default level: no line of routine (the scheduling slice is
    debug), and a start that fails ends on ``cannot start: <reason>``, not on ``jaild
    stopped`` (it never served). Control: a daemon that served ends on ``jaild stopped``."""
    policy = {"default": (REPO / "policies/default.toml").read_text()}
    served = private_daemon(policy, with_repo_policies=False, args=("--log-level", "info"))
    assert served.stop() == 0
    lines = served.log().splitlines()
    assert lines[-1].endswith(": INFO: jaild stopped"), lines[-3:]
    assert [line for line in lines if "scheduling:" in line] == []
    with socket.socket() as busy:  # daemon.metrics_address on a port in use: it cannot start
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = tmp_path / "jaild.toml"
        config.write_text(f'[daemon]\nmetrics_address = "127.0.0.1:{busy.getsockname()[1]}"\n')
        failed = private_daemon(policy, with_repo_policies=False, wait=False,
                                args=("--config", str(config), "--log-level", "info"))
        assert failed.proc.wait(timeout=guard(60)) == 1
    lines = failed.log().splitlines()
    assert lines[-1].startswith("jaild: cannot start: daemon.metrics_address: "), lines[-3:]
    assert "jaild stopped" not in failed.log()
