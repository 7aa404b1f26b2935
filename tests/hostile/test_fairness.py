"""One uid floods the daemon; another uid is still served.

Each test starts a daemon whose socket uid 65534 (group nogroup) may reach, with small
limits in its config. Root floods it with jobs that hold their jail (they sleep) until
the daemon refuses one, and uid 65534 -- the real client library, run as that uid --
then runs a job of its own. With fairness (a per-uid share of the daemon's jails and
memory) the flood stops at its share and the other uid's job runs and ends ok; the
positive control is the same flood with the per-uid limit set to the daemon's, where
the flooder takes everything and the other uid is refused ``busy``. The memory ceiling
is also read from the host: the daemon's cgroup subtree carries it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from jaild.client import Client, Job
from jaild.errors import Busy
from tests.conftest import DaemonHandle, ForeignClient, guard

HOLD = "import time\ntime.sleep(600)\n"  # holds its jail until cancelled

POLICY = """description = "fairness tests: jails that hold 128 MiB of limits"
[limits]
wall_time_s = 900
memory_mb = 128
[pool]
min = 0
max = 0
"""

OTHER_UID = 65534
OTHER = (
    "import json, sys\nfrom jaild.client import Client\nfrom jaild.errors import JaildError\n"
    "try:\n"
    "    with Client(sys.argv[1]) as c:\n"
    "        r = c.run('6 * 7')\n"
    "    print(json.dumps({'status': r.status, 'result': r.result}))\n"
    "except JaildError as exc:\n"
    "    print(json.dumps({'refused': exc.code, 'message': exc.message}))\n"
)


@pytest.fixture
def shared_daemon(reachable_daemon: Callable[[dict[str, str], str], DaemonHandle]
                  ) -> Callable[[str], DaemonHandle]:
    """A daemon with ``limits`` (TOML lines of ``[limits]``) that uid 65534 may reach,
    serving one policy, ``default``: jails of 128 MiB, no warm pool."""
    return lambda limits: reachable_daemon({"default": POLICY}, f"[limits]\n{limits}\n")


def flood(c: Client, most: int) -> tuple[list[Job], Busy]:
    """Submit jobs that hold their jail until the daemon refuses one (at most ``most``)."""
    held: list[Job] = []
    for _ in range(most):
        try:
            held.append(c.submit(HOLD))
        except Busy as exc:
            return held, exc
    raise AssertionError(f"{most} jobs of one uid were all accepted: nothing limits it")


def other_uid_runs(d: DaemonHandle, foreign: ForeignClient) -> dict[str, object]:
    out = foreign.run(OTHER, d.socket, uid=OTHER_UID, gid=OTHER_UID)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def release(held: list[Job]) -> None:
    for job in held:
        job.cancel()
    for job in held:
        assert job.result(guard(60)).status == "cancelled"


def subtree_memory_limit(d: DaemonHandle) -> int:
    """The memory limit of the daemon's cgroup subtree, read from the host."""
    name = "memory.limit_in_bytes" if d.layout.version == 1 else "memory.max"
    return int((d.job_root / name).read_text())


# --------------------------------------------------------------------------- jobs


def test_a_uid_flooding_jobs_stops_at_its_share_and_another_uid_is_served(
        shared_daemon: Callable[[str], DaemonHandle], foreign_client: ForeignClient) -> None:
    # max_jobs_per_uid is not set: its derived default, half of max_jobs, applies
    d = shared_daemon("max_jobs = 4")
    with Client(d.socket) as root:
        session = root.session().open()  # a session holds a jail: it counts toward the share
        held, refusal = flood(root, 5)
        try:
            assert len(held) == 1, [j.job_id for j in held]
            assert refusal.message == (
                "uid 0 holds 2 jobs and sessions, its share (limits.max_jobs_per_uid 2); "
                "retry when one ends")
            # the flood holds its share; the other uid is served, its job ends ok
            assert other_uid_runs(d, foreign_client) == {"status": "ok", "result": 42}
        finally:
            release(held)
            session.close()


def test_positive_control_without_a_per_uid_share_the_flood_shuts_the_other_uid_out(
        shared_daemon: Callable[[str], DaemonHandle], foreign_client: ForeignClient) -> None:
    d = shared_daemon("max_jobs = 4\nmax_jobs_per_uid = 4")  # the share is the whole daemon
    with Client(d.socket) as root:
        session = root.session().open()
        held, refusal = flood(root, 5)
        try:
            assert len(held) == 3
            assert "(limits.max_jobs_per_uid 4)" in refusal.message
            assert other_uid_runs(d, foreign_client) == {
                "refused": "busy",
                "message": "4 jobs and sessions open, the daemon's limit (limits.max_jobs 4); retry later"}
        finally:
            release(held)
            session.close()


# --------------------------------------------------------------------------- memory


def test_a_uid_flooding_memory_stops_at_its_share_and_another_uid_is_served(
        shared_daemon: Callable[[str], DaemonHandle], foreign_client: ForeignClient) -> None:
    # max_memory_mb_per_uid is not set: its derived default, half the ceiling, applies
    d = shared_daemon("max_jobs = 64\nmax_memory_mb = 1024\nmemory_overcommit = 1.0")
    assert subtree_memory_limit(d) == 1024 << 20  # the ceiling is the kernel's, on the subtree
    with Client(d.socket) as root:
        held, refusal = flood(root, 9)
        try:
            assert len(held) == 4  # 4 x 128 MiB: its share of 512 MiB
            assert refusal.message == (
                "uid 0's memory limits would reach 640 MiB (512 MiB held + 128 MiB for this "
                "one), over its share (limits.max_memory_mb_per_uid 512); retry when one ends")
            assert other_uid_runs(d, foreign_client) == {"status": "ok", "result": 42}
        finally:
            release(held)


def test_the_memory_ceiling_refuses_the_job_that_would_overcommit(
        shared_daemon: Callable[[str], DaemonHandle], foreign_client: ForeignClient) -> None:
    # positive control of the share above (the per-uid share is the whole ceiling), and the
    # ceiling itself: 8 jails of 128 MiB fill 1024 MiB, the ninth is refused, naming it
    d = shared_daemon(
        "max_jobs = 64\nmax_memory_mb = 1024\nmemory_overcommit = 1.0\nmax_memory_mb_per_uid = 1024")
    assert subtree_memory_limit(d) == 1024 << 20
    with Client(d.socket) as root:
        held, refusal = flood(root, 9)
        try:
            assert len(held) == 8
            assert "(limits.max_memory_mb_per_uid 1024)" in refusal.message
            assert other_uid_runs(d, foreign_client) == {
                "refused": "busy",
                "message": "jails' memory limits would reach 1.1 GiB (1024 MiB held + 128 MiB "
                           "for this one), over what the daemon admits "
                           "(limits.max_memory_mb 1024); retry later"}
            # under the ceiling the same job runs: one holder ends, and it is served
            release(held[:1])
            assert other_uid_runs(d, foreign_client) == {"status": "ok", "result": 42}
        finally:
            release(held[1:])


def test_the_default_ceiling_is_three_quarters_of_the_hosts_memory(
        hostile: DaemonHandle) -> None:
    # nothing configured: the subtree's limit is derived from the host's MemTotal
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total_kib = int(next(ln for ln in meminfo if ln.startswith("MemTotal:")).split()[1])
    assert subtree_memory_limit(hostile) == (total_kib // 1024) * 3 // 4 << 20
