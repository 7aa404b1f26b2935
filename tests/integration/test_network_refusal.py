"""A network attempt under a policy without a network (issue 17, item 5): refused in words,
and the job goes on with its work; the record counts the refusals.

The positive control for each probe is the same code under ``netprobe`` (loopback: AF_INET
allowed, the filter lets the calls through): there the attempt reaches the kernel and fails
the kernel's way (no DNS, no route), nothing is counted -- so the refusal under ``default``
is the policy's doing, not a broken probe. That the filter itself refuses the sockets (for
code out of the runtime's sight) is shown in tests/hostile/test_syscalls.py.
"""

from __future__ import annotations

import errno

import pytest

from jaild.client import Client
from tests.conftest import DaemonHandle

pytestmark = pytest.mark.integration

CAUGHT_FETCH = """
import urllib.request
work = sum(range(10))
try:
    urllib.request.urlopen("https://example.com/", timeout=5)
    fetched = "fetched"
except OSError as e:
    fetched = f"{type(e).__name__}: {e}"
print("still here")
{"work": work, "fetched": fetched}
"""

REFUSED_GETADDRINFO = (
    "URLError: <urlopen error [Errno 13] network access refused in this jail "
    "(getaddrinfo('example.com', 443)): policy '{policy}' has no network "
    '(network.mode = "none"); nothing was sent. For network access, use a policy with '
    'network.mode = "egress"'
)


@pytest.mark.parametrize("policy", ["default", "spawn", "strict", "errno"])
def test_a_caught_fetch_keeps_the_jobs_work_and_the_record_says_it_was_refused(
    daemon: DaemonHandle, policy: str
) -> None:
    """The brief's case: agent code wraps a fetch in try/except. Zygote and spawned jails,
    the strict profile (no socket() at all), and the errno action alike."""
    r = daemon.run(CAUGHT_FETCH, policy=policy)
    assert r.status == "ok", (r.status, r.error, r.stderr)
    assert r.result["work"] == 45 and r.stdout == "still here\n"
    assert r.result["fetched"].startswith(REFUSED_GETADDRINFO.format(policy=policy)), r.result
    assert r.network_refused == 1 and r.record.network_refused == 1
    assert r.to_dict()["network_refused"] == 1
    audited = daemon.audited(r.job_id)
    assert audited is not None and audited["network_refused"] == "1"


def test_control_with_a_network_the_same_fetch_reaches_the_kernel(daemon: DaemonHandle) -> None:
    r = daemon.run(CAUGHT_FETCH, policy="netprobe")
    assert r.status == "ok", (r.status, r.error)
    assert r.result["work"] == 45
    fetched = r.result["fetched"]
    assert fetched.startswith("URLError: ") and "network access refused" not in fetched
    assert r.network_refused == 0 and "network_refused" not in r.to_dict()


# Every way to the network a job's interpreter has, each caught; and one the runtime cannot
# see (a raw syscall through ctypes), which the filter refuses with a bare EACCES.
EVERY_WAY = """
import asyncio, ctypes, socket, _socket
seen = {}
def attempt(name, f):
    try:
        f()
        seen[name] = "made"
    except OSError as e:
        seen[name] = [type(e).__name__, e.errno, str(e)]
attempt("socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
attempt("_socket", lambda: _socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close())
attempt("create_connection", lambda: socket.create_connection(("192.0.2.1", 80), timeout=2))
attempt("gethostbyname", lambda: socket.gethostbyname("example.com"))
async def conn():
    await asyncio.wait_for(asyncio.open_connection("192.0.2.1", 80), 2)
attempt("asyncio", lambda: asyncio.run(conn()))
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
seen["ctypes"] = [fd, ctypes.get_errno()]
seen
"""
IN_SIGHT = ["socket", "_socket", "create_connection", "gethostbyname", "asyncio"]


def test_every_way_in_the_jobs_interpreter_is_refused_in_words(daemon: DaemonHandle) -> None:
    r = daemon.run(EVERY_WAY)
    assert r.status == "ok", (r.status, r.error)
    seen = r.result
    for name in IN_SIGHT:
        kind, code, message = seen[name]
        assert (kind, code) == ("PermissionError", errno.EACCES), (name, seen[name])
        assert "network access refused in this jail (" in message, name
        assert "policy 'default' has no network" in message, name
    assert "(socket(AF_INET, SOCK_STREAM))" in seen["socket"][2]
    assert "(socket(AF_INET6, SOCK_DGRAM))" in seen["_socket"][2]
    assert "(getaddrinfo('192.0.2.1', 80))" in seen["create_connection"][2]
    assert "(gethostbyname('example.com'))" in seen["gethostbyname"][2]
    assert seen["ctypes"] == [-1, errno.EACCES]  # the filter's bare answer: not counted
    assert r.network_refused == len(IN_SIGHT)


def test_control_with_a_network_every_way_reaches_the_kernel(daemon: DaemonHandle) -> None:
    r = daemon.run(EVERY_WAY, policy="netprobe")
    assert r.status == "ok", (r.status, r.error)
    seen = r.result
    assert seen["socket"] == "made" and seen["_socket"] == "made"
    for name in ("create_connection", "asyncio"):  # the jail's lo only: no route to 192.0.2.1
        assert seen[name][1] == errno.ENETUNREACH, (name, seen[name])
    assert seen["gethostbyname"][0] == "gaierror"  # no /etc/hosts, no DNS server
    assert seen["ctypes"][0] >= 0  # a descriptor: the filter let it through
    assert r.network_refused == 0


def test_an_uncaught_refusal_is_the_jobs_error_naming_the_policy(daemon: DaemonHandle) -> None:
    r = daemon.run("x = 1\nimport socket\nsocket.create_connection(('192.0.2.1', 80))\n")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "PermissionError" and r.error["lineno"] == 3
    assert "policy 'default' has no network" in r.error["message"]
    assert "PermissionError: [Errno 13] network access refused" in r.error["traceback"]
    assert r.network_refused == 1


def test_a_sessions_runs_count_their_own_refusals(daemon: DaemonHandle) -> None:
    probe = "import socket\ntry:\n    socket.socket(socket.AF_INET)\nexcept OSError:\n    pass\n"
    with Client(daemon.socket) as c, c.session() as s:
        first = s.run(probe + probe)
        second = s.run("1")
        third = s.run(probe)
    assert [r.status for r in (first, second, third)] == ["ok"] * 3
    assert [r.network_refused for r in (first, second, third)] == [2, 0, 1]


def test_a_run_stopped_before_it_reports_has_no_count(daemon: DaemonHandle) -> None:
    """The count comes with the runtime's report: a run the daemon stops has none, and the
    record says nil rather than a count it does not know."""
    r = daemon.run("import socket, time\ntry:\n    socket.socket(socket.AF_INET)\n"
                   "except OSError:\n    pass\ntime.sleep(30)\n", limits={"wall_time_s": 1})
    assert r.status == "timeout"
    assert r.network_refused is None and r.record.network_refused is None
