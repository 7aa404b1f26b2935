"""Draining on SIGTERM (``daemon.drain_s``): the jobs running finish, new work is refused
``busy`` "draining", the daemon then stops as before and a new one serves at the same path.
The control: the same SIGTERM without a drain cancels the running job."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.errors import Busy
from tests.conftest import DaemonHandle, guard, start_daemon, sweep_cgroups, until

SLEEPER = "import time\ntime.sleep(3)\n'finished'"


def config(directory: Path, text: str) -> tuple[str, ...]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "jaild.toml"
    path.write_text(text)
    return ("--config", str(path))


def stopped(handle: DaemonHandle) -> int:
    code = handle.proc.wait(timeout=guard(60))
    sweep_cgroups(handle)
    return code


def started(directory: Path, args: tuple[str, ...]) -> DaemonHandle:
    return start_daemon(directory, with_repo_policies=False,
                        policies={"default": "[limits]\nwall_time_s = 30\n"}, args=args)


Make = Callable[[Path, tuple[str, ...]], DaemonHandle]


@pytest.fixture
def daemons() -> Iterator[tuple[list[DaemonHandle], Make]]:
    """Start daemons (one directory may serve twice); each is stopped and swept after."""
    handles: list[DaemonHandle] = []

    def make(directory: Path, args: tuple[str, ...]) -> DaemonHandle:
        handles.append(started(directory, args))
        return handles[-1]

    yield handles, make
    for handle in handles:
        if handle.proc.poll() is None:
            handle.stop(signal.SIGKILL)
        sweep_cgroups(handle)


def test_a_drain_lets_the_running_job_finish_and_refuses_new_work(
    tmp_path: Path,
    daemons: tuple[list[DaemonHandle], Make],
) -> None:
    _, make = daemons
    d = make(tmp_path / "d", config(tmp_path / "d", "[daemon]\ndrain_s = 60\n"))
    with Client(d.socket) as c, c.session() as s:
        s.run("x = 1")
        job = c.submit(SLEEPER)
        d.proc.send_signal(signal.SIGTERM)
        until(lambda: "draining: 1 job(s) running" in d.log(), "the drain to start")
        # new work from another connection and from this one: refused, the socket still open
        with pytest.raises(Busy, match=r"draining.*within 60 s, daemon\.drain_s"), \
                Client(d.socket) as other:
            other.run("1")
        with pytest.raises(Busy, match="draining"):
            c.run("1")
        with pytest.raises(Busy, match="draining"):
            s.run("x")
        r = job.result(timeout=guard(60))
        assert (r.status, r.result) == ("ok", "finished"), (r.status, r.error)
    assert stopped(d) == 0, d.log()[-3000:]
    assert "drained: every running job finished" in d.log()
    assert not os.path.exists(d.socket)
    # the next daemon (a rolling update's) serves at the same path
    again = make(tmp_path / "d", config(tmp_path / "d", "[daemon]\ndrain_s = 60\n"))
    assert again.socket == d.socket
    again.assert_serving()


def test_positive_control_without_a_drain_sigterm_cancels_the_running_job(
    tmp_path: Path,
    daemons: tuple[list[DaemonHandle], Make],
) -> None:
    _, make = daemons
    d = make(tmp_path / "d", ())
    with Client(d.socket) as c:
        job = c.submit(SLEEPER)
        d.proc.send_signal(signal.SIGTERM)
        r = job.result(timeout=guard(60))
    assert r.status == "cancelled", (r.status, r.error)
    assert "shutting down" in (r.error or {}).get("message", "")
    assert stopped(d) == 0
    assert "draining" not in d.log()


def test_a_drain_that_runs_out_cancels_what_still_runs(
    tmp_path: Path,
    daemons: tuple[list[DaemonHandle], Make],
) -> None:
    _, make = daemons
    d = make(tmp_path / "d", config(tmp_path / "d", "[daemon]\ndrain_s = 1\n"))
    with Client(d.socket) as c:
        job = c.submit("import time\ntime.sleep(60)")
        d.proc.send_signal(signal.SIGTERM)
        r = job.result(timeout=guard(60))
    assert r.status == "cancelled", (r.status, r.error)
    assert stopped(d) == 0
    assert "drained for 1 s: 1 job(s) still running are cancelled" in d.log()
