"""A job's output pipes are read through numbers the daemon owns only while the pipes are
open. A hostile job can close its own stdout and stderr early (``os.close(1)``): the daemon
sees EOF and closes its ends, and the kernel hands the same descriptor numbers to the next
file the daemon opens -- another job's pipe, its cgroup's counters, a client's socket. When
the hostile job then ends, the daemon drains its pipes for output not yet read: it must not
read those numbers, now someone else's (it did: the drain read the numbers it had been given,
whatever they had become, into the hostile job's record)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

import pytest

from jaild.client import Client
from tests.conftest import DaemonHandle, guard

pytestmark = pytest.mark.integration

HOSTILE = """
await tools.opened()
import os
os.close(1)
os.close(2)
await tools.closed()
"done"
"""

NEIGHBOUR = """
import sys, time
end = time.monotonic() + 600
while time.monotonic() < end:
    sys.stdout.write("neighbour's secret output\\n" * 50)
    sys.stdout.flush()
    time.sleep(0.001)
"""


def _links(pid: int) -> dict[int, str]:
    out = {}
    for entry in os.scandir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[int(entry.name)] = os.readlink(entry.path)
    return out


def test_a_job_that_closes_its_output_early_drains_nothing_of_anyone_else(
    private_daemon: Callable[..., DaemonHandle],
) -> None:
    d = private_daemon()
    daemon_pid = d.proc.pid
    with Client(d.socket) as c:
        opened, closed, release = threading.Event(), threading.Event(), threading.Event()

        def on_opened() -> None:
            opened.set()

        def on_closed() -> bool:
            closed.set()
            return release.wait(guard(60))

        hostile = c.submit(HOSTILE, tools={"opened": on_opened, "closed": on_closed})
        neighbour = None
        try:
            assert opened.wait(guard(30)), "the hostile job did not start"
            (pid,) = d.job_pids(hostile.job_id)
            pipes = {os.readlink(f"/proc/{pid}/fd/{n}") for n in (1, 2)}
            assert all(p.startswith("pipe:") for p in pipes), pipes
            numbers = sorted(n for n, target in _links(daemon_pid).items() if target in pipes)
            assert len(numbers) == 2, (numbers, pipes)  # the daemon's read ends
            assert closed.wait(guard(30)), "the hostile job did not close its output"
            deadline = time.monotonic() + guard(30)  # the daemon sees EOF and closes its ends
            while pipes & set(_links(daemon_pid).values()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not pipes & set(_links(daemon_pid).values()), "the daemon kept the pipes"

            speaking = threading.Event()
            neighbour = c.submit(NEIGHBOUR, on_stdout=lambda _text: speaking.set())
            deadline = time.monotonic() + guard(30)  # its start reuses the freed numbers
            while time.monotonic() < deadline:
                now = _links(daemon_pid)
                if all(n in now for n in numbers) and speaking.is_set():
                    break
                time.sleep(0.01)
            reused = _links(daemon_pid)
            # the control: the numbers are someone else's now (the neighbour's files)
            assert all(n in reused and reused[n] not in pipes for n in numbers), (numbers, reused)
        finally:
            release.set()
        r = hostile.result(guard(60))
        if neighbour is not None:
            neighbour.cancel()
            neighbour.result(guard(60))
    assert (r.status, r.result) == ("ok", "done"), (r.status, r.error)
    assert (r.stdout, r.stderr) == ("", ""), (r.stdout[:200], r.stderr[:200])
