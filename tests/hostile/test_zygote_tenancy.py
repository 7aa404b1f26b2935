"""Between jails forked from zygotes (issue 14): per-uid zygotes, and the shared user namespace.

**Tenants.** No two client uids' jails are forks of one zygote.

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

**The zygote's user namespace.** Every jail of a zygote is in the zygote's user namespace,
where the zygote is uid 0 with full capabilities. jaild keeps that shared namespace (one per
zygote, not one per jail) and shows that no jail can use it, at three depths: from a real
jail (its own pid namespace, its seccomp filter, its uid); below both, as a process of a
job uid in *every* namespace of the zygote with no seccomp filter (the kernel's own checks);
and the positive control, the same as the zygote's uid 0, where every probe succeeds.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import (
    DaemonHandle,
    ForeignClient,
    guard,
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
def tenancy_daemon(reachable_daemon: Callable[[dict[str, str], str], DaemonHandle]
                   ) -> Callable[[str], DaemonHandle]:
    """A daemon uids 65534 and 65533 may reach, serving the ``tenancy`` policy, with the
    given extra config."""
    return lambda extra: reachable_daemon({"tenancy": POLICY}, extra)


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
    # ... running as a host uid of its own (its kernel quotas are its own, too)
    zygotes = ("tenancy", f"tenancy-u{UID_A}", f"tenancy-u{UID_B}")  # root's, A's, B's
    assert len({_status(_zygote_of(d, z), "Uid")[0] for z in zygotes}) == 3


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


# ------------------------------------------------------------ the zygote's user namespace

# A jail forked from a zygote lives in the zygote's user namespace, where the zygote is uid 0
# with every capability. The probe tries what that namespace would give: signals, ptrace,
# process_vm_readv and /proc access to the zygote and a sibling jail, joining their
# namespaces, and capability-gated operations on objects the namespace owns (its uts and
# mount namespaces, a new network namespace, uid 0). argv[1]: the targets' pids as the
# probe's pid namespace numbers them; "scan": also signal 0 to every pid up to 32768.
NS_PROBE = r'''
import ctypes, errno, json, os, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
targets = json.loads(sys.argv[1])
seen = {}


def outcome(fn):
    try:
        rc = fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    if isinstance(rc, int) and rc < 0:
        return errno.errorcode.get(ctypes.get_errno(), "?")
    return "ok"


def in_child(fn):
    """Run fn in a child (it changes the process), its outcome as the child's exit code."""
    pid = os.fork()
    if pid == 0:
        result = outcome(fn)
        os._exit(0 if result == "ok" else getattr(errno, result, 255))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return "ok" if code == 0 else errno.errorcode.get(code, str(code))


class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def vm_read(pid):
    try:  # a mapped address in the target, if its maps are readable; else one of ours
        address = int(open(f"/proc/{pid}/maps").readline().split("-")[0], 16)
    except OSError:
        address = ctypes.cast(libc.printf, ctypes.c_void_p).value
    buf = ctypes.create_string_buffer(8)
    local, remote = iovec(ctypes.addressof(buf), 8), iovec(address, 8)
    return libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)


for who, pid in targets.items():
    seen[f"kill {who}"] = outcome(lambda: os.kill(pid, 0))
    seen[f"ptrace {who}"] = in_child(lambda: libc.ptrace(0x4206, pid, None, None))  # SEIZE
    seen[f"process_vm_readv {who}"] = outcome(lambda: vm_read(pid))
    seen[f"/proc/{who}/mem"] = outcome(lambda: os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY)))
    seen[f"/proc/{who}/environ"] = outcome(lambda: open(f"/proc/{pid}/environ", "rb").read(1))
    seen[f"/proc/{who}/fd"] = outcome(lambda: os.listdir(f"/proc/{pid}/fd"))
    seen[f"setns {who}'s net"] = in_child(
        lambda: libc.setns(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY), 0x40000000))
seen["sethostname"] = in_child(lambda: libc.sethostname(b"probe", 5))
mnt = "/tmp/.jaild-probe-mnt"
os.makedirs(mnt, exist_ok=True)
seen["mount"] = in_child(lambda: libc.mount(b"none", mnt.encode(), b"tmpfs", 0, None)
                         or libc.umount2(mnt.encode(), 2))
os.rmdir(mnt)
seen["unshare net"] = in_child(lambda: libc.unshare(0x40000000))
seen["setresuid 0"] = in_child(lambda: os.setresuid(0, 0, 0))
if "scan" in sys.argv[2:]:  # every pid number another process could have, signal 0
    seen["kill scan"] = [
        p for p in range(2, 32769) if p != os.getpid() and outcome(lambda: os.kill(p, 0)) != "ESRCH"
    ]
print(json.dumps(seen))
'''
NS_POLICY = '[seccomp]\naction = "errno"\n[pool]\nmode = "zygote"\nmin = 0\nmax = 0\n'
"""Zygote jails whose disallowed calls fail with EPERM, so the probe runs to its end."""


def _status(pid: int, key: str) -> list[str]:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith(key + ":"))
    return line.split()[1:]


def _zygote_of(d: DaemonHandle, policy: str) -> int:
    """The host pid of the daemon's zygote of ``policy`` (its own uid's; ``policy-uN``: uid
    N's): pid 1 one pid namespace down (a jail it forked, still in its cgroup, is two down)."""
    for entry in os.listdir("/proc"):
        try:
            if (entry.isdigit() and f"/{d.config.subtree}/zygote-{policy}/"
                    in Path(f"/proc/{entry}/cgroup").read_text()
                    and len(_status(int(entry), "NSpid")) == 2):
                return int(entry)
        except OSError:
            continue
    raise AssertionError(f"no zygote for policy {policy}")


def _nsenter_probe(zygote: int, uid: int, targets: dict[str, int]) -> dict[str, str]:
    """The probe in every namespace of the zygote (its user, pid, mount, uts, net, ipc and
    cgroup namespaces, its root), as ``uid`` there, with no seccomp filter."""
    out = subprocess.run(
        ["nsenter", "-t", str(zygote), "-U", "-p", "-m", "-u", "-n", "-i", "-C", "-r", "-w",
         "-S", str(uid), "-G", str(uid), "/usr/bin/python3", "-I", "-c", NS_PROBE,
         json.dumps(targets)],
        capture_output=True, text=True, timeout=guard(60), check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_no_zygote_jail_can_use_the_zygotes_user_namespace(
        private_daemon: Callable[..., DaemonHandle]) -> None:
    d = private_daemon({"nsprobe": NS_POLICY}, with_repo_policies=False)
    with d.client() as c:
        up, release = threading.Event(), threading.Event()

        def hold() -> bool:
            up.set()
            return release.wait(guard(60))

        sibling = c.submit("await tools.hold()", policy="nsprobe", tools={"hold": hold})
        try:
            assert up.wait(guard(30)), "the sibling did not reach its tool call"
            (a_host,) = d.job_pids(sibling.job_id)
            a_in_zygote = int(_status(a_host, "NSpid")[1])
            a_uid = int(_status(a_host, "Uid")[0])
            zygote = _zygote_of(d, "nsprobe")
            # 1. From a jail: the zygote and its sibling by every number they have (host, and
            # the zygote's pid namespace); the jail sees no other process at all.
            targets = {"zygote": zygote, "sibling": a_host, "sibling in the zygote": a_in_zygote}
            jailed = c.run(f"import sys\nsys.argv = ['probe', {json.dumps(targets)!r}, 'scan']\n"
                           + NS_PROBE.replace("print(json.dumps(seen))", "seen"), policy="nsprobe")
            assert jailed.status == "ok", (jailed.error, jailed.stderr)
            # 2. Below the jail's pid namespace and seccomp filter: a process of another job's
            # uid in every namespace of the zygote, where both are in reach.
            near = {"zygote": 1, "sibling": a_in_zygote}
            unprivileged = _nsenter_probe(zygote, a_uid + 1000, near)
            # 3. The positive control: the same, as the zygote's uid 0, with its capabilities.
            privileged = _nsenter_probe(zygote, 0, near)
        finally:
            release.set()
        assert sibling.result(guard(60)).status == "ok"
    assert jailed.result.pop("kill scan") == [], "the jail can signal another process"
    assert [k for k, v in jailed.result.items() if v == "ok"] == []
    assert len(jailed.result) == 3 * 7 + 4
    assert [k for k, v in unprivileged.items() if v == "ok"] == []
    assert privileged == dict.fromkeys(privileged, "ok")
    assert set(privileged) == set(unprivileged) and len(privileged) == 2 * 7 + 4
