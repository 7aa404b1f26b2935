"""Between tenants: no two client uids' jails are forks of one zygote (issue 14).

A zygote's jails are forks of it, so they share what no fork can renew: ``AT_RANDOM`` (the
16 bytes glibc derives the stack canary and pointer guard from), the address-space layout
(ASLR is per exec) and the ``str`` hash seed. Before, every uid's jobs of a policy were
forked from the policy's one zygote, so a job could learn another user's canary. Now the
zygote is per (policy, client uid): two uids' jobs show different values, while two jobs
of one uid -- forks of that uid's zygote -- share them, by design within one tenant (the
positive control that the probe sees sharing where there is some). With
``daemon.zygote_scope = "policy"`` the old shape returns, and two uids' jobs share them:
the positive control across uids.

The probe reads AT_RANDOM's bytes (``getauxval``: a jail may not read /proc/self/auxv),
the address of libc's ``printf`` (ASLR; the interpreter itself may not be position-
independent), ``hash('x')`` (the hash seed), and whether the job was forked (the zygote
pre-imported ``colorsys``, which nothing else imports).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    DaemonHandle,
    ForeignClient,
    guard,
    start_daemon,
    sweep_cgroups,
    until,
)

pytestmark = pytest.mark.integration

UID_A, UID_B, GID = 65534, 65533, 65534  # two tenants, both in group nogroup (the socket's)
POLICY = (
    '[limits]\nwall_time_s = 30\n'
    '[pool]\nmode = "zygote"\nmin = 1\nmax = 1\npreimport = ["colorsys"]\n'
)
PROBE = r'''
import ctypes, sys
forked = "colorsys" in sys.modules
libc = ctypes.CDLL("libc.so.6")
libc.getauxval.restype = ctypes.c_ulong
at_random = ctypes.string_at(libc.getauxval(25), 16).hex()  # AT_RANDOM = 25
printf = ctypes.cast(libc.printf, ctypes.c_void_p).value
[forked, at_random, printf, hash("x")]
'''
# As one uid: its first job, then jobs until two were forked from a zygote (the uid's own
# starts in the background after its first job); prints [first, [forked, forked]].
TENANT = r'''
import json, sys, time
from jaild.client import Client
c = Client(sys.argv[1])
first = c.run(sys.argv[2], policy="tenancy")
assert first.status == "ok", first.error
forked = []
deadline = time.monotonic() + float(sys.argv[3])
while len(forked) < 2:
    r = c.run(sys.argv[2], policy="tenancy")
    assert r.status == "ok", r.error
    if r.result[0]:
        forked.append(r.result)
    else:
        assert time.monotonic() < deadline, "no job of this uid was ever forked"
        time.sleep(0.1)
print(json.dumps([first.result, forked]))
'''


@pytest.fixture
def tenancy_daemon(world_dir: Path, tmp_path: Path) -> Iterator[Callable[[str], DaemonHandle]]:
    """A daemon uids 65534 and 65533 may reach, serving the ``tenancy`` policy, with the
    given extra config."""
    started: list[DaemonHandle] = []

    def make(extra: str) -> DaemonHandle:
        config = tmp_path / f"jaild{len(started)}.toml"
        config.write_text('[daemon]\nsocket_group = "nogroup"\n' + extra)
        where = world_dir / f"d{len(started)}"
        handle = start_daemon(where, {"tenancy": POLICY}, with_repo_policies=False,
                              args=("--config", str(config)))
        os.chmod(where, 0o755)
        started.append(handle)
        return handle

    yield make
    for handle in started:
        handle.stop()
        sweep_cgroups(handle)


def _tenant(client: ForeignClient, d: DaemonHandle, uid: int) -> tuple[list[object], list[list[object]]]:
    out = client.run(TENANT, d.socket, PROBE, str(guard(60)), uid=uid, gid=GID, timeout=120)
    assert out.returncode == 0, out.stderr
    first, forked = json.loads(out.stdout)
    return first, forked


def test_two_uids_jobs_share_no_zygote(tenancy_daemon: Callable[[str], DaemonHandle],
                                       foreign_client: ForeignClient) -> None:
    d = tenancy_daemon("")  # zygote_scope = "uid", the default
    first_a, (a1, a2) = _tenant(foreign_client, d, UID_A)
    first_b, (b1, b2) = _tenant(foreign_client, d, UID_B)
    # Each uid's first job was spawned (a fresh exec): B's came after A's zygote was up, and
    # A's zygote did not serve it.
    assert first_a[0] is False and first_b[0] is False
    # Within one tenant, jobs forked from its zygote share the zygote's values: by design.
    assert a1[1:] == a2[1:] and b1[1:] == b2[1:]
    # Across tenants: nothing of it.
    _, random_a, printf_a, hash_a = a1
    _, random_b, printf_b, hash_b = b1
    assert random_a != random_b, "two uids' jobs share AT_RANDOM (the stack canary's source)"
    assert printf_a != printf_b, "two uids' jobs share the ASLR layout (libc's address)"
    assert hash_a != hash_b, "two uids' jobs share the hash seed"
    # Each uid's zygote is its own, in a cgroup of its own.
    names = {p.name for p in d.job_root.glob("zygote-tenancy*")}
    assert {f"zygote-tenancy-u{UID_A}", f"zygote-tenancy-u{UID_B}"} <= names


def test_positive_control_one_zygote_per_policy_is_shared_by_uids(
        tenancy_daemon: Callable[[str], DaemonHandle], foreign_client: ForeignClient) -> None:
    # The old shape, kept for single-tenant hosts: the same probe sees two uids' jobs share
    # the zygote's values, and every job of theirs, the first too, is forked.
    d = tenancy_daemon('zygote_scope = "policy"\n')
    first_a, (a1, _) = _tenant(foreign_client, d, UID_A)
    first_b, (b1, _) = _tenant(foreign_client, d, UID_B)
    assert first_a[0] is True and first_b[0] is True
    assert a1[1:] == b1[1:]


def test_an_idle_uids_zygote_and_pool_are_stopped(
        tenancy_daemon: Callable[[str], DaemonHandle], foreign_client: ForeignClient) -> None:
    d = tenancy_daemon("[limits]\nzygote_idle_s = 2\n")
    _tenant(foreign_client, d, UID_A)
    # its zygote (and the pooled jail it forked for the uid) go once the uid is idle
    until(lambda: not (d.job_root / f"zygote-tenancy-u{UID_A}").exists(),
          "the idle uid's zygote was stopped")
    assert "zygote of policy tenancy for uid 65534: idle, stopped" in d.log()
    # the daemon's own (root's) zygote is not a tenant's: it stays
    assert (d.job_root / "zygote-tenancy").exists()
    assert d.run("6 * 7", policy="tenancy").result == 42
