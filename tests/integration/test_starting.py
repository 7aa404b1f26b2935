"""A daemon that is starting answers at once (issue 43, item 7): driven for real.

The daemon is held in its start-up deterministically: its nsjail is a wrapper that takes a
shared ``flock`` on a file the test holds locked (exclusively) before it starts the daemon,
then execs the real nsjail. The first nsjail a daemon runs is its zygote's (step 6 of
jaild/daemon/startup.py), after it serves its socket: so while the test holds the lock, the
daemon is starting -- "starting the zygotes of policies default" -- and cannot become ready;
once the test lets go, every waiting nsjail goes on, and later ones pass at once. No sleep
and no timing decides an outcome here: every deadline below is a liveness guard.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jaild.client import Client, JobResult
from jaild.daemon.jails.staging import locate_nsjail
from jaild.errors import EXIT_UNAVAILABLE, DaemonUnavailable, PolicyUnavailable, Starting
from jaild.protocol import NEED_DATA, PROTOCOL_VERSION, Connection, Role, unpack
from jaild.protocol.messages import (
    Error,
    GetStats,
    Hello,
    JobAccepted,
    JobDescription,
    JobFinished,
    ListPolicies,
    Message,
    PolicyList,
    RunJob,
    Stats,
    Welcome,
)
from tests.conftest import (
    STATE_DIR,
    DaemonHandle,
    free_socket,
    guard,
    policy_texts,
    require_jail_host,
    start_daemon,
    until,
    wait_listening,
    welcome,
)

pytestmark = pytest.mark.integration

PENDING = "starting the zygotes of policies default"
"""What a daemon held at its gate is doing (its one policy, default, makes zygote jails)."""


@contextlib.contextmanager
def gate(fail: bool = False) -> Iterator[tuple[str, Any]]:
    """An nsjail wrapper held shut: yields its path and what opens the gate. ``fail``: once
    let through, it fails (exit 1) instead of running nsjail, as a broken nsjail would.
    In /tmp (0755), since each nsjail runs as its jail's own uid."""
    directory = Path(tempfile.mkdtemp(prefix="jaild-gate-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        lock = directory / "lock"
        lock.touch(mode=0o644)
        then = "exit 1" if fail else f'exec {locate_nsjail(None)} "$@"'
        wrapper = directory / "nsjail"
        wrapper.write_text(f"#!/bin/sh\nflock -s {lock} true\n{then}\n")
        wrapper.chmod(0o755)
        held = os.open(lock, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield str(wrapper), lambda: fcntl.flock(held, fcntl.LOCK_UN)
        finally:
            os.close(held)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def held_daemon(directory: Path, nsjail: str, config_text: str = "") -> DaemonHandle:
    """A daemon serving the default policy with the gated ``nsjail``, once its Welcome says
    it is starting its zygotes (every Welcome before says it is starting: the gate is shut)."""
    args: tuple[str, ...] = ("--nsjail", nsjail)
    if config_text:
        config = directory / "jaild.toml"
        directory.mkdir(parents=True, exist_ok=True)
        config.write_text(config_text)
        args += ("--config", str(config))
    handle = start_daemon(directory, policy_texts("default"), with_repo_policies=False,
                          args=args, wait=False)
    answers: list[Message | None] = []

    def at_the_gate() -> bool:  # it answers from its staging on; the gate holds it here
        assert handle.proc.poll() is None, Path(handle.log_path).read_text(errors="replace")
        answers.append(welcome(handle.socket, guard(10)))
        said = answers[-1]
        assert said is None or (isinstance(said, Welcome) and said.starting is not None), said
        return said is not None and said.starting is not None and said.starting.pending == PENDING

    try:
        until(at_the_gate, "the starting daemon's Welcome, held at its zygotes")
    except BaseException:
        handle.stop()
        raise
    return handle


class Raw:
    """One connection spoken frame by frame (the order of requests is the test's)."""

    def __init__(self, path: str) -> None:
        self.conn = Connection(Role.CLIENT, 1 << 26)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(guard(120))
        self.sock.connect(path)

    def send(self, *msgs: Message) -> None:
        self.sock.sendall(b"".join(self.conn.send(m) for m in msgs))

    def next(self) -> Message:
        while True:
            event = self.conn.next_event()
            if isinstance(event, Message):
                return event
            assert event is NEED_DATA, event
            data = self.sock.recv(1 << 20)
            assert data, "the daemon closed the connection"
            self.conn.receive_data(data)

    def close(self) -> None:
        self.sock.close()


def waiting_job(path: str) -> Raw:
    """A connection to a held daemon whose job (ref 1, ``6*7``) waits: welcomed, the job
    sent, and a listing asked after it answered (so the job's request is in)."""
    raw = Raw(path)
    raw.send(Hello(protocol=PROTOCOL_VERSION, client="test-starting"))
    assert isinstance(raw.next(), Welcome)
    raw.send(RunJob(ref=1, job=JobDescription(code="6*7"), policy="default"),
             ListPolicies(ref=2))
    assert isinstance(raw.next(), PolicyList)  # the job's request is in, waiting
    return raw


def jaild_policies(path: str) -> subprocess.CompletedProcess[str]:
    """The DaemonSet's exec probe (deploy/kubernetes/daemonset.yaml)."""
    return subprocess.run([sys.executable, "-m", "jaild", "policies", "--socket", path],
                          capture_output=True, text=True, timeout=guard(60))


def run_in_thread(client: Client, code: str) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = client.run(code)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_starting_daemon_welcomes_answers_and_runs_the_job_once_ready(
        tmp_path: Path, loop: str) -> None:
    """Held at its gate, the daemon says Welcome at once (starting, with what is pending and
    the bound), answers policies and stats on the very connection whose job waits -- the
    job's request went first, and no JobAccepted comes before those answers -- and its
    health probe says not ready. Opened, the waiting jobs run (the raw one and the client
    library's), Welcome says nothing of starting, and the probe passes: the control that
    the same daemon, probe and jobs are fine once it is ready."""
    with gate() as (nsjail, open_gate):
        daemon = held_daemon(tmp_path / "d", nsjail, f'[daemon]\nevent_loop = "{loop}"\n')
        try:
            raw = Raw(daemon.socket)
            raw.send(Hello(protocol=PROTOCOL_VERSION, client="test-starting"))
            hello = raw.next()
            assert isinstance(hello, Welcome) and hello.starting is not None
            assert hello.starting.pending == PENDING
            assert hello.starting.wait_s == 300.0  # limits.startup_wait_s's default
            raw.send(RunJob(ref=1, job=JobDescription(code="6*7"), policy="default"),
                     ListPolicies(ref=2), GetStats(ref=3))
            listed, stats = raw.next(), raw.next()  # answered while ref 1 waits
            assert isinstance(listed, PolicyList) and listed.ref == 2, listed
            assert [p.name for p in listed.policies] == ["default"]
            assert isinstance(stats, Stats) and stats.ref == 3, stats
            assert stats.stats.running.jobs == 0

            with Client(daemon.socket) as client:
                assert client.starting == {"pending": PENDING, "wait_s": 300.0}
                assert client.jobs() == []
                thread, out = run_in_thread(client, "sum(range(10))")
                probe = jaild_policies(daemon.socket)
                assert probe.returncode == EXIT_UNAVAILABLE, probe
                assert "default" in probe.stdout
                assert f"starting: the daemon is still starting ({PENDING})" in probe.stderr

                open_gate()
                accepted = raw.next()
                assert isinstance(accepted, JobAccepted) and accepted.ref == 1, accepted
                finished = raw.next()
                assert isinstance(finished, JobFinished), finished
                assert finished.record.status == "ok", finished.record
                assert finished.result is not None and unpack(finished.result) == 42
                thread.join(guard(120))
                assert not thread.is_alive() and "error" not in out, out
                result: JobResult = out["result"]
                assert result.status == "ok" and result.result == 45, result
            raw.close()

            wait_listening(daemon.socket, daemon.proc, daemon.log_path)
            ready = welcome(daemon.socket, guard(10))
            assert isinstance(ready, Welcome) and ready.starting is None
            probe = jaild_policies(daemon.socket)
            assert probe.returncode == 0 and probe.stderr == "", probe
            served = re.search(r"jaild \S+ serving .*; (\w+)$",
                               Path(daemon.log_path).read_text(errors="replace"), re.M)
            assert served is not None and served.group(1) == loop  # on the loop asked for
        finally:
            open_gate()
            daemon.stop()


def test_past_its_bound_a_waiting_job_gets_starting_naming_what_is_pending(
        tmp_path: Path) -> None:
    """With limits.startup_wait_s = 1 and the gate shut (it stays shut until the answer
    came, so the bound must pass), a job gets the typed ``Starting``, naming what is pending
    and the bound. Control: the same client's same job, once the gate is open, runs."""
    with gate() as (nsjail, open_gate):
        daemon = held_daemon(tmp_path / "d", nsjail, "[limits]\nstartup_wait_s = 1\n")
        try:
            with Client(daemon.socket) as client:
                assert client.starting == {"pending": PENDING, "wait_s": 1.0}
                with pytest.raises(Starting) as caught:
                    client.run("6*7")
                assert caught.value.code == "starting"
                assert f"the daemon is still starting ({PENDING})" in caught.value.message
                assert "waits at most 1 s" in caught.value.message
                assert "limits.startup_wait_s" in caught.value.message
                assert client.lost is None  # the connection goes on
                open_gate()
                wait_listening(daemon.socket, daemon.proc, daemon.log_path)
                again = client.run("6*7")
                assert again.status == "ok" and again.result == 42, again
        finally:
            open_gate()
            daemon.stop()


def test_a_policy_that_fails_while_a_job_waits_refuses_it(tmp_path: Path) -> None:
    """The gate lets nsjail through only to fail: the default policy's zygote does not come
    up, so the policy is not served -- and the job that waited for it gets that refusal
    (policy_unavailable, naming the zygote), not a hang and not ``starting``. Its control:
    the first test, where the same wait ends with the job run."""
    with gate(fail=True) as (nsjail, open_gate):
        daemon = held_daemon(tmp_path / "d", nsjail)
        try:
            raw = waiting_job(daemon.socket)
            open_gate()
            refused = raw.next()
            assert isinstance(refused, Error) and refused.ref == 1, refused
            assert refused.code == PolicyUnavailable.code, refused
            assert "its zygote did not start" in refused.message, refused
            raw.close()
        finally:
            open_gate()
            daemon.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_start_that_fails_after_serving_tells_its_client_why(tmp_path: Path,
                                                              loop: str) -> None:
    """A start that fails once the socket is served (here: its nsjail is missing, found
    only after the socket serves) tells the client that connected -- the one whose
    connection activated it, so it waits from before the start -- why, a DaemonUnavailable
    naming the cause, whether the daemon had accepted it yet or not. The control, the
    same activation with a real nsjail serving, is test_systemd_integration's
    test_socket_activation; a failure before serving is test_a_start_that_fails_tells_the_
    waiting_client_why there."""
    from tests.integration.test_systemd_integration import ACTIVATE, activator, in_thread, joined

    assert ACTIVATE is not None, "systemd-socket-activate is missing: apt-get install systemd"
    require_jail_host()
    sock_path = free_socket(tmp_path)  # on a uid block no daemon holds
    pdir = tmp_path / "policies"
    pdir.mkdir()
    (pdir / "default.toml").write_text(policy_texts("default")["default"])
    missing = str(tmp_path / "no-nsjail")
    config = tmp_path / "jaild.toml"  # the answer to the backlog is a socket of the loop's
    config.write_text(f'[daemon]\nevent_loop = "{loop}"\n')
    with open(tmp_path / "jaild.log", "wb") as log_file:
        proc, kill_group = activator(
            [ACTIVATE, "-l", sock_path, sys.executable, "-m", "jaild", "serve", "--socket",
             sock_path, "--policies", str(pdir), "--state-dir", STATE_DIR,
             "--nsjail", missing, "--config", str(config)], log_file, sock_path, tmp_path)
        try:
            def first_contact() -> Any:
                with Client(sock_path) as client:
                    return client.policies()  # a daemon that accepted us tells us here

            thread, out = in_thread(first_contact)
            with pytest.raises(DaemonUnavailable) as caught:
                joined(thread, out, guard(60), kill_group, "the activating connection")
            assert proc.wait(timeout=guard(60)) == 1
        finally:
            kill_group()
    assert str(caught.value) == (
        f"the jaild daemon at {sock_path} cannot start: nsjail at {missing} is missing "
        "or not executable"), (tmp_path / "jaild.log").read_text(errors="replace")


def test_a_start_that_fails_while_a_job_waits_tells_it_why(tmp_path: Path) -> None:
    """Its network listener's certificate cannot be read, which the daemon finds out last,
    after its zygotes and self-tests (the gate holds it before): the connection whose job
    waits is told why -- an Error without ref, daemon_unavailable, with the reason (the
    client runs as the daemon's uid) -- not a hang and not a reset. Control: the first
    test, the same wait ending with the job run when nothing fails."""
    missing = tmp_path / "no-such-cert.pem"
    with gate() as (nsjail, open_gate):
        daemon = held_daemon(
            tmp_path / "d", nsjail,
            f'[daemon]\nlisten = ["tls://127.0.0.1:0"]\n'
            f'[tls]\ncert = "{missing}"\nkey = "{missing}"\nclient_ca = "{missing}"')
        try:
            raw = waiting_job(daemon.socket)
            open_gate()
            told = raw.next()
            assert isinstance(told, Error) and told.ref is None, told
            assert told.code == DaemonUnavailable.code, told
            # the first of the TLS files it could not read, named (the CAs are read first)
            assert told.message.startswith(
                f"the jaild daemon at {daemon.socket} cannot start: tls.client_ca {missing}"), told
            raw.close()
            assert daemon.proc.wait(timeout=guard(60)) == 1
        finally:
            open_gate()
            daemon.stop()


def test_no_more_requests_wait_than_may_run(tmp_path: Path) -> None:
    """With limits.max_jobs_per_connection = 1, a connection's second job while the daemon
    starts is refused busy at once, naming the limit (as it would be while both ran); the
    first still waits and runs once the gate opens -- the control that the refusal is the
    cap's, not the start's."""
    with gate() as (nsjail, open_gate):
        daemon = held_daemon(tmp_path / "d", nsjail, "[limits]\nmax_jobs_per_connection = 1\n")
        try:
            raw = Raw(daemon.socket)
            raw.send(Hello(protocol=PROTOCOL_VERSION, client="test-starting"))
            assert isinstance(raw.next(), Welcome)
            raw.send(RunJob(ref=1, job=JobDescription(code="6*7"), policy="default"),
                     RunJob(ref=2, job=JobDescription(code="7*8"), policy="default"))
            busy = raw.next()
            assert isinstance(busy, Error) and busy.ref == 2 and busy.code == "busy", busy
            assert "limits.max_jobs_per_connection 1" in busy.message, busy
            open_gate()
            accepted, finished = raw.next(), raw.next()
            assert isinstance(accepted, JobAccepted) and accepted.ref == 1, accepted
            assert isinstance(finished, JobFinished) and finished.record.status == "ok"
            assert finished.result is not None and unpack(finished.result) == 42
            raw.close()
        finally:
            open_gate()
            daemon.stop()
