"""The daemon's two systemd protocols, driven for real without systemd as PID 1.

* sd_notify: the test binds the datagram socket systemd would, names it in
  ``$NOTIFY_SOCKET``, and checks what a ``Type=notify`` unit relies on: READY=1
  only once the daemon serves, sent by the main process itself
  (``NotifyAccess=main``), then STOPPING=1 on SIGTERM and a clean exit within
  the unit's ``TimeoutStopSec``, having cancelled the running job.
* socket activation: ``systemd-socket-activate`` binds and listens like
  jaild.socket, and execs the daemon (same pid, ``LISTEN_PID``/``LISTEN_FDS``)
  on the first connection. The daemon must serve that connection -- already
  queued on the inherited socket -- and later ones, and on stop must leave the
  socket file alone: it belongs to whoever bound it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from jaild.client import Client, JobResult
from jaild.errors import DaemonUnavailable
from tests.conftest import (
    REPO,
    REPO_POLICIES,
    STATE_DIR,
    TEST_POLICIES,
    DaemonHandle,
    free_socket,
    policy_texts,
    require_jail_host,
    start_daemon,
    wait_listening,
)

pytestmark = pytest.mark.integration

ACTIVATE = shutil.which("systemd-socket-activate")
SERVICE_UNIT = REPO / "systemd" / "jaild.service"
DEADLINE_S = 60.0  # generous bound for anything that should take a second or two


def unit_stop_timeout_s() -> float:
    """TimeoutStopSec of the shipped unit: systemd SIGKILLs the daemon after this."""
    match = re.search(r"^TimeoutStopSec=(\d+)s$", SERVICE_UNIT.read_text(), re.M)
    assert match, "jaild.service must set TimeoutStopSec=<n>s"
    return float(match.group(1))


# ---------------------------------------------------------------- notify socket


@contextlib.contextmanager
def notify_socket(address: str) -> Iterator[socket.socket]:
    """A datagram socket like systemd's notify socket, receiving sender credentials."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        yield sock
    finally:
        sock.close()


def receive(sock: socket.socket, timeout: float = DEADLINE_S) -> tuple[dict[str, str], int]:
    """One notification as {field: value}, and the pid the kernel says sent it."""
    sock.settimeout(timeout)
    try:
        data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(12))
    except TimeoutError:
        raise AssertionError(f"no sd_notify message within {timeout} s") from None
    pid = -1
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("3i", payload[:12])[0]
    fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
    return fields, pid


def assert_nothing_pending(sock: socket.socket) -> None:
    sock.settimeout(0)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


# ---------------------------------------------------------------- helpers


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a thread; the dict gets ``result`` or ``error``."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: dict[str, Any], timeout: float,
           on_timeout: Callable[[], None], what: str) -> Any:
    """The thread's result; on timeout call ``on_timeout`` (which must unblock it) and fail."""
    thread.join(timeout)
    if thread.is_alive():
        on_timeout()
        thread.join(DEADLINE_S)
        raise AssertionError(f"{what} did not finish within {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["result"]


def policy_dir(directory: Path) -> Path:
    """The repository policies plus tests/policies, as the shared daemon gets them."""
    pdir = directory / "policies"
    pdir.mkdir(parents=True)
    for src in [*REPO_POLICIES.glob("*.toml"), *TEST_POLICIES.glob("*.toml")]:
        shutil.copy(src, pdir / src.name)
    return pdir


# ---------------------------------------------------------------- sd_notify


def test_notify_ready_then_stopping_with_graceful_cancel(tmp_path: Path) -> None:
    require_jail_host()
    address = str(tmp_path / "notify.sock")
    with notify_socket(address) as notify:
        handle = start_daemon(tmp_path / "d", policy_texts("default"), with_repo_policies=False,
                              extra_env={"NOTIFY_SOCKET": address}, wait=False)
        try:
            wait_listening(handle.socket, handle.proc, handle.log_path)
            fields, sender = receive(notify)
            assert fields.get("READY") == "1", fields
            assert fields.get("STATUS", "").startswith("serving "), fields
            # NotifyAccess=main: systemd would drop it from any other process.
            assert sender == handle.proc.pid
            handle.assert_serving()  # READY=1 meant it: a real job runs

            # A job is running when SIGTERM comes: it must end "cancelled", the
            # daemon must exit 0 within the unit's TimeoutStopSec (after which
            # systemd would SIGKILL it) and remove the socket it created.
            started = threading.Event()
            client = Client(handle.socket)
            try:
                thread, out = in_thread(lambda: client.run(
                    "import time\nprint('started', flush=True)\ntime.sleep(600)",
                    on_stdout=lambda text: started.set(),
                ))
                assert started.wait(DEADLINE_S), "the job never started:\n" + handle.log()[-2000:]
                handle.proc.send_signal(signal.SIGTERM)
                fields, sender = receive(notify)
                assert fields == {"STOPPING": "1"}
                assert sender == handle.proc.pid
                code = handle.proc.wait(timeout=unit_stop_timeout_s())
                result: JobResult = joined(thread, out, DEADLINE_S, lambda: None, "the job")
            finally:
                client.close()
            assert code == 0, handle.log()[-4000:]
            assert result.status == "cancelled", (result.status, result.error)
            assert not os.path.lexists(handle.socket)
            assert_nothing_pending(notify)  # nothing else (no jail) sent anything
        finally:
            if handle.proc.poll() is None:
                handle.proc.kill()
                handle.proc.wait(timeout=DEADLINE_S)


def serve_once_and_stop(handle: DaemonHandle) -> None:
    """The daemon serves a job, stops with status 0 and removes the socket it created."""
    try:
        wait_listening(handle.socket, handle.proc, handle.log_path)
        handle.assert_serving()
    finally:
        code = handle.stop()
    assert code == 0, handle.log()[-4000:]
    assert not os.path.lexists(handle.socket)


def test_unreachable_notify_socket_is_harmless(tmp_path: Path) -> None:
    """A NOTIFY_SOCKET nobody listens on (systemd gone) must not stop the daemon
    from starting, serving or stopping cleanly."""
    dead = str(tmp_path / "nobody-listens.sock")
    serve_once_and_stop(start_daemon(tmp_path / "d", policy_texts("default"), with_repo_policies=False,
                                     extra_env={"NOTIFY_SOCKET": dead}, wait=False))


# ---------------------------------------------------------------- socket activation


def activator(argv: list[str], log_file: IO[bytes], sock_path: str,
              cwd: Path) -> tuple[subprocess.Popen[bytes], Callable[[], None]]:
    """Start ``systemd-socket-activate`` (``argv``) in a session of its own and wait until it
    has bound ``sock_path``; returns it and what kills its whole process group."""
    proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=cwd)

    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(sock_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group()
            log_file.flush()
            raise AssertionError(f"activator never bound its socket (exit {proc.poll()}):\n"
                                 + Path(log_file.name).read_text(errors="replace"))
        time.sleep(0.02)
    return proc, kill_group


def test_socket_activation(tmp_path: Path) -> None:
    require_jail_host()
    assert ACTIVATE is not None, "systemd-socket-activate is missing: apt-get install systemd (make test does)"
    sock_path = free_socket(tmp_path)  # on a uid block no daemon holds
    log_path = tmp_path / "jaild.log"
    # An abstract-namespace notify socket ("@..."), as systemd may also use.
    notify_name = f"@jaild-test-{secrets.token_hex(8)}"
    pdir = policy_dir(tmp_path)
    argv = [
        ACTIVATE, "-l", sock_path, "-E", f"NOTIFY_SOCKET={notify_name}",
        sys.executable, "-m", "jaild", "serve", "--socket", sock_path,
        "--policies", str(pdir), "--state-dir", STATE_DIR, "--log-level", "debug",
    ]

    def log() -> str:
        return log_path.read_text(errors="replace")

    with notify_socket("\0" + notify_name[1:]) as notify, open(log_path, "wb") as log_file:
        proc, kill_group = activator(argv, log_file, sock_path, tmp_path)
        try:
            bound = os.stat(sock_path)
            assert_nothing_pending(notify)  # nothing runs until a client connects

            # The first client's connect is what starts the daemon; its Hello waits
            # in the inherited socket's queue until the daemon is up.
            def first_job() -> JobResult:
                with Client(sock_path) as c:
                    return c.run("6*7")

            thread, out = in_thread(first_job)
            first = joined(thread, out, DEADLINE_S, kill_group, "the first (activating) job")
            assert first.status == "ok", (first.status, first.error, log()[-4000:])
            assert first.result == 42

            fields, sender = receive(notify)
            assert fields.get("READY") == "1", fields
            # Same pid as the activator: it exec'd the daemon, so LISTEN_PID matched.
            assert sender == proc.pid

            thread, out = in_thread(lambda: Client(sock_path))
            second_client: Client = joined(thread, out, DEADLINE_S, kill_group, "connecting")
            with second_client as c:
                second = c.run("sum(range(10))")
            assert second.status == "ok", (second.status, second.error)
            assert second.result == 45

            daemon_log = log()
            assert "removed stale socket" not in daemon_log
            # Still the activator's socket: the daemon never bound one of its own.
            now = os.stat(sock_path)
            assert (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino)

            os.kill(proc.pid, signal.SIGTERM)
            fields, sender = receive(notify)
            assert fields == {"STOPPING": "1"}
            assert proc.wait(timeout=unit_stop_timeout_s()) == 0, log()[-4000:]
            # Not the daemon's socket, so it must still be there, untouched.
            after = os.stat(sock_path)
            assert (after.st_dev, after.st_ino) == (bound.st_dev, bound.st_ino)
            assert_nothing_pending(notify)
        finally:
            if proc.poll() is None:
                kill_group()
                proc.wait(timeout=DEADLINE_S)
            else:
                kill_group()  # stragglers in the group, if any


def test_foreign_listen_fds_are_ignored(tmp_path: Path) -> None:
    """LISTEN_FDS meant for another process (LISTEN_PID is not ours) must not be used:
    the daemon binds its own socket and still owns (and removes) it."""
    serve_once_and_stop(start_daemon(tmp_path / "d", policy_texts("default"), with_repo_policies=False,
                                     extra_env={"LISTEN_PID": "1", "LISTEN_FDS": "1"},
                                     wait=False))


def test_a_start_that_fails_tells_the_waiting_client_why(tmp_path: Path) -> None:
    """An activated daemon whose start fails once it holds the socket (here: its metrics
    port is taken) answers the connection that activated it with the reason -- a
    DaemonUnavailable -- instead of resetting it (the client saw 'Connection reset by
    peer' and the reason was only in the daemon's log). The control, the same activation
    with nothing in the way serving, is test_socket_activation."""
    require_jail_host()
    assert ACTIVATE is not None, "systemd-socket-activate is missing: apt-get install systemd (make test does)"
    sock_path = free_socket(tmp_path)  # on a uid block no daemon holds
    pdir = tmp_path / "policies"
    pdir.mkdir()
    shutil.copy(REPO_POLICIES / "default.toml", pdir / "default.toml")
    log_path = tmp_path / "jaild.log"
    with socket.socket() as busy, open(log_path, "wb") as log_file:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = tmp_path / "jaild.toml"
        config.write_text(f'[daemon]\nmetrics_address = "127.0.0.1:{port}"\n')
        proc, kill_group = activator(
            [ACTIVATE, "-l", sock_path, sys.executable, "-m", "jaild", "serve", "--socket",
             sock_path, "--policies", str(pdir), "--state-dir", STATE_DIR, "--config",
             str(config)], log_file, sock_path, tmp_path)
        try:
            thread, out = in_thread(lambda: Client(sock_path))
            with pytest.raises(DaemonUnavailable) as caught:
                joined(thread, out, DEADLINE_S, kill_group, "the activating connection")
            assert proc.wait(timeout=DEADLINE_S) == 1
        finally:
            kill_group()
    assert str(caught.value) == (
        f"the jaild daemon at {sock_path} cannot start: daemon.metrics_address: cannot "
        f"listen on '127.0.0.1:{port}': port {port} on 127.0.0.1 is already in use "
        f"(`ss -ltnp 'sport = :{port}'` shows by whom); stop that program or choose another "
        "daemon.metrics_address"
    ), log_path.read_text(errors="replace")
