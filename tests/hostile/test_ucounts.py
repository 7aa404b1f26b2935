"""Host kernel quotas (ucounts): what a jail consumes is charged to a uid of its own, never
to host root's.

The kernel counts inotify instances, queued signals and more per user, and charges each
object to its creator's uid *and to the owner of every user namespace above it*. So the
owner of a jail's user namespace decides whose quota the jail uses up. jaild makes it a
host uid of the jail's own (a spawned jail's job uid, a zygote's own uid) rather than root.

Each attack below exhausts what the jail can get, and while it holds all of it, a host
process of root (the tool call runs during the attack) must still get one more. The
positive control runs the same attack in a user namespace the test makes with a throwaway
owner uid, and a host process of that uid is then refused: the kernel charges whatever a
namespace holds to its owner, whoever that is -- for these two counts it makes no
exception for root (no capability lifts the inotify or the queued-signal limit) -- so an
owner starved in the control is exactly what root was when jails' namespaces were root's.
The control uses a throwaway uid so that the suite never takes host root's own quota.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jaild.client import Client
from jaild.daemon.jails.launch.handle import userns_owner
from jaild.errors import ConnectionLost
from jaild.policy.compile import JAIL_SIGPENDING, JOB_UIDS
from jaild.runtime.zygote import USERNS_LIMITS
from tests.conftest import DaemonHandle, guard, start_daemon, until, wait_listening

CONTROL_UID = 3_999_999_017
"""The positive control's throwaway namespace owner: no account, no process, not a job uid."""
PYTHON = os.path.realpath(sys.executable)
"""The base interpreter (not the venv's, which another uid may not reach from a 0700 clone)."""

_POLICY = """
description = "Test policy: kernel quotas ({mode})"
[limits]
wall_time_s = 120
memory_mb = 256
pids = 64
open_files = 256
[seccomp]
allow = ["inotify_init1", "rt_tgsigqueueinfo"]
[pool]
mode = "{mode}"
min = 0
max = 0
"""
POLICIES = {"uc-spawn": _POLICY.format(mode="spawn"), "uc-zygote": _POLICY.format(mode="zygote")}

# The attacks: the same source runs in a jail and in the control. ``attack()`` takes all it
# can and keeps it (in ``held``) until the process ends; it says how many and why it stopped.
INOTIFY_ATTACK = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
held = []

def attack():
    while len(held) < 100_000:
        fd = libc.inotify_init1(0)
        if fd < 0:
            return {"count": len(held), "errno": ctypes.get_errno()}
        held.append(fd)
    return {"count": len(held), "errno": 0}
"""

SIGNAL_ATTACK = """
import ctypes, os, signal, threading
libc = ctypes.CDLL(None, use_errno=True)
SIG = signal.SIGRTMIN + 3
held = []

def attack():
    # queued to this thread, which blocks the signal: each stays pending, charged to its uid
    signal.pthread_sigmask(signal.SIG_BLOCK, {SIG})
    info = (ctypes.c_int * 32)()
    info[0], info[2], info[4], info[5] = SIG, -1, os.getpid(), os.getuid()  # SI_QUEUE
    tid = threading.get_native_id()
    count = 0
    while count < 1_000_000:
        if libc.syscall(297, os.getpid(), tid, SIG, info) != 0:  # rt_tgsigqueueinfo
            return {"count": count, "errno": ctypes.get_errno()}
        count += 1
    return {"count": count, "errno": 0}
"""

ATTACKS = {"inotify": INOTIFY_ATTACK, "signals": SIGNAL_ATTACK}
REFUSED = {"inotify": errno.EMFILE, "signals": errno.EAGAIN}

HOST_CHECK = """
import ctypes, os, signal, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[1] == "inotify":
    fd = libc.inotify_init1(0)
    print(0 if fd >= 0 else ctypes.get_errno())
else:
    sig = signal.SIGRTMIN + 3
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    info = (ctypes.c_int * 32)()
    info[0], info[2], info[4], info[5] = sig, -1, os.getpid(), os.getuid()
    ok = libc.syscall(297, os.getpid(), threading.get_native_id(), sig, info) == 0
    print(0 if ok else ctypes.get_errno())
"""
"""One more of the kind, from a host process: prints 0, or the errno that refused it."""


def host_check(kind: str, uid: int = 0) -> int:
    """Whether a host process of ``uid`` (in the host's user namespace) gets one more
    inotify instance / queued signal now: 0, or the errno that refused it."""
    prefix = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}",
                                  "--clear-groups", "--"]
    out = subprocess.run([*prefix, PYTHON, "-I", "-S", "-c", HOST_CHECK, kind], check=True,
                         capture_output=True, text=True, timeout=guard(60), cwd="/")
    return int(out.stdout)


def host_uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])


@pytest.fixture(scope="module")
def quotas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """A daemon with a spawn-mode and a zygote-mode policy that allow both attacks' calls
    (whatever the shipped profiles allow)."""
    d = start_daemon(tmp_path_factory.mktemp("ucounts"), POLICIES, with_repo_policies=False)
    yield d
    assert d.stop() == 0, d.log()[-4000:]


def expected_count(kind: str, policy: str) -> int:
    """All a jail of ``policy`` may hold: a zygote jail its per-jail share; a spawned jail
    its own uid's whole quota (the host's per-user inotify limit; nsjail's, so the daemon's,
    RLIMIT_SIGPENDING)."""
    if kind == "inotify":
        if policy == "uc-zygote":
            return USERNS_LIMITS["max_inotify_instances"]
        return int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    if policy == "uc-zygote":
        return JAIL_SIGPENDING
    return resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]


@pytest.mark.parametrize("policy", ["uc-spawn", "uc-zygote"])
@pytest.mark.parametrize("kind", ["inotify", "signals"])
def test_a_jail_exhausts_only_its_own_kernel_quota(quotas: DaemonHandle, kind: str,
                                                   policy: str) -> None:
    def during() -> dict[str, int]:
        # the jail holds all it could get: host root, and a sibling jail, still get theirs
        root = host_check(kind)
        sibling = quotas.run(ATTACKS[kind] + "\nattack()", policy)
        assert sibling.status == "ok", (sibling.status, sibling.error)
        return {"root": root, "sibling": sibling.result["count"]}

    code = ATTACKS[kind] + "\nfacts = attack()\nfacts['during'] = await tools.during()\nfacts"
    with quotas.client() as c:
        r = c.run(code, policy, tools={"during": during})
    assert r.status == "ok", (r.status, r.error, r.stderr)
    facts = r.result
    # while the jail held all it could get, host root got one more, and so did another job
    # of the same policy ...
    assert facts["during"]["root"] == 0
    assert facts["during"]["sibling"] >= 1
    # ... and the jail did take everything it could: its own share, to the last one
    assert facts["errno"] == REFUSED[kind]
    assert facts["count"] == expected_count(kind, policy)


@pytest.mark.parametrize("kind", ["inotify", "signals"])
def test_control_the_same_attack_starves_its_namespace_owner(kind: str) -> None:
    # The attack in a user namespace the test makes, owned by a throwaway uid: the owner's
    # own host process is refused while the attack holds its take; root is not.
    assert host_check(kind, CONTROL_UID) == 0  # before: the owner gets one
    probe = ATTACKS[kind] + (
        "\nimport json, sys\nprint(json.dumps(attack()), flush=True)\nsys.stdin.readline()\n"
    )
    with subprocess.Popen(
        ["setpriv", f"--reuid={CONTROL_UID}", f"--regid={CONTROL_UID}", "--clear-groups", "--",
         "unshare", "--user", "--", PYTHON, "-I", "-S", "-c", probe],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
    ) as attacker:
        assert attacker.stdin is not None and attacker.stdout is not None
        try:
            facts = json.loads(attacker.stdout.readline())
            assert userns_owner(attacker.pid) == CONTROL_UID
            assert facts["errno"] == REFUSED[kind] and facts["count"] > 0
            assert host_check(kind, CONTROL_UID) == REFUSED[kind]  # the owner is starved
            assert host_check(kind) == 0  # root is not its owner here
        finally:
            attacker.stdin.close()
            attacker.wait(guard(60))
    assert host_check(kind, CONTROL_UID) == 0  # and gets it back when the attack ends


def _zygote_of(d: DaemonHandle, policy: str) -> int:
    """The host pid of ``d``'s zygote of ``policy``: pid 1 one pid namespace down, in the
    zygote's cgroup (its jails are two down)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            cgroup = Path(f"/proc/{entry}/cgroup").read_text()
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        nspid = next(ln for ln in status.splitlines() if ln.startswith("NSpid:")).split()
        if (b"jaild.runtime.zygote" in cmdline and f"/{d.config.subtree}/zygote-{policy}"
                in cgroup and len(nspid) == 3):
            return int(entry)
    raise AssertionError(f"no zygote of policy {policy}")


def _while_running(d: DaemonHandle, code: str, policy: str,
                   look: Callable[[str], Any]) -> tuple[Any, Any]:
    """Run ``code`` (which calls ``tools.hold()``) and ``look(job_id)`` from the host while
    the jail waits in that call; the job's result and what ``look`` returned."""
    inside, release = threading.Event(), threading.Event()

    def hold() -> bool:
        inside.set()
        return release.wait(guard(60))

    with Client(d.socket) as c:
        job = c.submit(code, policy=policy, tools={"hold": hold})
        try:
            assert inside.wait(guard(60))
            seen = look(job.job_id)
        finally:
            release.set()
        r = job.result(guard(120))
    assert r.status == "ok", (r.status, r.error, r.stderr)
    return r.result, seen


JAIL_VIEW = """
import os
await tools.hold()
mounts = open("/proc/self/mountinfo").read()
{"sys": os.path.exists("/sys"), "cgroupfs": " - cgroup" in mounts, "uid": os.getuid()}
"""


def test_a_spawned_jails_namespace_is_owned_by_its_job_uid(quotas: DaemonHandle) -> None:
    def look(job_id: str) -> dict[str, Any]:
        pids = quotas.job_pids(job_id)
        assert pids
        made = [p for p in quotas.cgroup_dir(job_id).iterdir() if p.is_dir()]
        return {"owners": {userns_owner(p) for p in pids}, "uids": {host_uid(p) for p in pids},
                "cgroup_owners": {p.stat().st_uid for p in made}}

    inside, seen = _while_running(quotas, JAIL_VIEW, "uc-spawn", look)
    (job_uid,) = seen["uids"]
    assert quotas.config.uid_base <= job_uid < quotas.config.uid_base + JOB_UIDS
    assert seen["owners"] == {job_uid}  # not root: the job's own uid owns its namespace
    # nsjail, running as that uid, made the jail's cgroup below the job's: it is the job
    # uid's, so the jail must have no way to reach a cgroup filesystem
    assert seen["cgroup_owners"] == {job_uid}
    assert inside == {"sys": False, "cgroupfs": False, "uid": 65534}


def test_a_zygote_jails_namespace_is_owned_by_the_zygotes_uid(quotas: DaemonHandle) -> None:
    def look(job_id: str) -> dict[str, Any]:
        pids = quotas.job_pids(job_id)
        assert pids
        zygote = _zygote_of(quotas, "uc-zygote")
        return {"owners": {userns_owner(p) for p in pids}, "uids": {host_uid(p) for p in pids},
                "zygote_uid": host_uid(zygote), "zygote_owner": userns_owner(zygote),
                "same_ns": {os.readlink(f"/proc/{p}/ns/user") for p in pids}
                == {os.readlink(f"/proc/{zygote}/ns/user")}}

    inside, seen = _while_running(quotas, JAIL_VIEW, "uc-zygote", look)
    (job_uid,) = seen["uids"]
    base = quotas.config.uid_base
    assert base <= job_uid < base + JOB_UIDS
    assert base + JOB_UIDS <= seen["zygote_uid"] < base + 65536
    assert seen["same_ns"]  # a zygote jail lives in its zygote's user namespace ...
    assert seen["owners"] == {seen["zygote_uid"]} == {seen["zygote_owner"]}  # ... its uid's
    assert inside == {"sys": False, "cgroupfs": False, "uid": job_uid}


def test_work_directories_planted_in_tmp_do_not_stop_spawned_jails(quotas: DaemonHandle) -> None:
    # nsjail, run as a job's uid, mounts on /tmp/nsjail.<uid>.root and .tmp: predictable names
    # in a directory every local user may write. A file planted there stops nsjail (it mounts
    # on whatever it finds) -- unless the daemon makes them itself first.
    base = quotas.config.uid_base
    planted = [Path(f"/tmp/nsjail.{base + slot}.{purpose}")
               for slot in range(16) for purpose in ("root", "tmp")]
    try:
        for path in planted:
            path.write_text("planted")
        r = quotas.run("6 * 7", "uc-spawn")
        assert r.status == "ok" and r.result == 42, (r.status, r.error, r.stderr)
        # the job's own were made fresh, and removed when its nsjail exited
        left = [p for p in planted if p.exists()]
        assert len(left) == len(planted) - 2
        assert all(p.read_text() == "planted" for p in left)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


def test_a_spawned_nsjail_run_as_the_job_uid_still_dies_with_the_daemon(
        private_daemon: Callable[..., DaemonHandle]) -> None:
    # setpriv changes credentials, which clears a parent-death signal: it must set it after.
    d = private_daemon(POLICIES, with_repo_policies=False)
    inside, release = threading.Event(), threading.Event()

    def hold() -> bool:
        inside.set()
        return release.wait(guard(60))

    try:
        with Client(d.socket) as c:
            job = c.submit("await tools.hold()", policy="uc-spawn", tools={"hold": hold})
            assert inside.wait(guard(60))
            jail = d.job_pids(job.job_id)[0]
            uid = host_uid(jail)
            nsjails = [int(p) for p in filter(str.isdigit, os.listdir("/proc"))
                       if _is_nsjail_of(int(p), uid)]
            assert nsjails  # control: nsjail runs, as the job's uid
            d.proc.kill()
            d.proc.wait(guard(10))
            until(lambda: not any(Path(f"/proc/{p}").exists() for p in [*nsjails, jail]),
                  "nsjail and its jail dying with the daemon", 30)
            release.set()
            with pytest.raises(ConnectionLost):
                job.result(guard(60))
    finally:
        release.set()
    # the next start (same socket, same uids) sweeps the work directories nsjail left
    assert any(Path(f"/tmp/nsjail.{uid}.{p}").exists() for p in ("root", "tmp"))
    restarted = subprocess.Popen(d.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(d.socket, restarted, d.log_path)
        assert not any(Path(f"/tmp/nsjail.{uid}.{p}").exists() for p in ("root", "tmp"))
        assert d.run("1 + 1", "uc-spawn").result == 2
    finally:
        restarted.terminate()
        assert restarted.wait(guard(30)) == 0


def _is_nsjail_of(pid: int, uid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return cmdline[0].endswith(b"nsjail") and host_uid(pid) == uid
    except (OSError, StopIteration):
        return False
