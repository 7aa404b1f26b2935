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
import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from jaild.client import Client
from tests.conftest import DaemonHandle, ForeignClient, guard

pytestmark = pytest.mark.integration

HOSTILE = """
await tools.opened()
import os
os.close(1)
os.close(2)
await tools.closed()
"done"
"""

POLICY = '[limits]\nwall_time_s = 600\n[pool]\nmode = "zygote"\nmin = 1\nmax = 1\n'
NEIGHBOUR_UID, GID = 65534, 65534  # in group nogroup, the socket's
# Another uid's client: one job that keeps writing to its stdout; "speaking" once its output
# arrives; runs until the test kills it (the daemon then cancels the job).
NEIGHBOUR = r'''
import sys, threading
from jaild.client import Client
CODE = """
import sys, time
while True:
    sys.stdout.write("neighbour's secret output\\n" * 50)
    sys.stdout.flush()
    time.sleep(0.001)
"""
said = threading.Event()
def speaking(_text):
    if not said.is_set():
        said.set()
        print("speaking", flush=True)
with Client(sys.argv[1]) as c:
    c.run(CODE, policy="out", on_stdout=speaking)
'''


def _links(pid: int) -> dict[int, str]:
    out = {}
    for entry in os.scandir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[int(entry.name)] = os.readlink(entry.path)
    return out


def test_a_job_that_closes_its_output_early_drains_nothing_of_another_uids_job(
    reachable_daemon: Callable[[dict[str, str], str], DaemonHandle],
    foreign_client: ForeignClient,
) -> None:
    d = reachable_daemon({"out": POLICY}, "")
    daemon_pid = d.proc.pid
    neighbour: subprocess.Popen[str] | None = None
    with Client(d.socket) as c:
        opened, looked = threading.Event(), threading.Event()
        closed, release = threading.Event(), threading.Event()

        def on_opened() -> bool:  # the job waits while the test looks at its pipes
            opened.set()
            return looked.wait(guard(60))

        def on_closed() -> bool:
            closed.set()
            return release.wait(guard(60))

        hostile = c.submit(HOSTILE, policy="out",
                           tools={"opened": on_opened, "closed": on_closed})
        try:
            assert opened.wait(guard(30)), "the hostile job did not start"
            (pid,) = d.job_pids(hostile.job_id)
            pipes = {os.readlink(f"/proc/{pid}/fd/{n}") for n in (1, 2)}
            assert all(p.startswith("pipe:") for p in pipes), pipes
            numbers = sorted(n for n, target in _links(daemon_pid).items() if target in pipes)
            assert len(numbers) == 2, (numbers, pipes)  # the daemon's read ends
            looked.set()
            assert closed.wait(guard(30)), "the hostile job did not close its output"
            deadline = time.monotonic() + guard(30)  # the daemon sees EOF and closes its ends
            while pipes & set(_links(daemon_pid).values()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not pipes & set(_links(daemon_pid).values()), "the daemon kept the pipes"

            neighbour = subprocess.Popen(
                foreign_client.argv(NEIGHBOUR, d.socket), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, user=NEIGHBOUR_UID, group=GID,
                extra_groups=[], cwd=foreign_client.path,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
            assert neighbour.stdout is not None
            line = neighbour.stdout.readline()  # its job runs and writes (a liveness guard:
            assert line == "speaking\n", (line, neighbour.poll())  # the job's own deadline)
            # the control: the freed numbers are the other uid's job's files now
            reused = _links(daemon_pid)
            assert all(n in reused and reused[n] not in pipes for n in numbers), (numbers, reused)
        finally:
            looked.set()
            release.set()
            r = hostile.result(guard(60))
            if neighbour is not None:
                neighbour.kill()
                neighbour.communicate(timeout=guard(30))
    assert (r.status, r.result) == ("ok", "done"), (r.status, r.error)
    assert (r.stdout, r.stderr) == ("", ""), (r.stdout[:200], r.stderr[:200])
