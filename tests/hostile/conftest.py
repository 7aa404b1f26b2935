"""The hostile suite's daemon, and the leak check that runs after every hostile test.

After the whole suite: no process of the daemon's alive but its standing jails (its
descendants, its uid block's, its subtree's: :func:`daemon_processes`), no job cgroup left
in its subtree, the daemon's descriptor count back where it started, its mount table
unchanged (its own mount namespace's, where the host's mounts propagate and its own stay:
:func:`own_mounts`), no new temporary directories of the daemon's (nsjail's for its uid
block, its own TMPDIR's) -- asserted, not eyeballed. Each counts the daemon's own and
nothing of another jaild instance's on the host (test_leak_attribution.py: the controls).

The daemon's own standing jails are not leaks: each policy's zygote, and a warm pool
of exactly one jail per policy (``min = max = 1``, so the pool's size, and with it the
daemon's descriptor count, is the same before and after).
"""

from __future__ import annotations

import json
import os
import re
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.daemon.selftest import UID_BLOCK
from tests.conftest import (
    REPO_POLICIES,
    TEST_POLICIES,
    DaemonHandle,
    _descendants,
    guard,
    proc_stat,
    start_daemon,
)


def standing(d: DaemonHandle) -> set[str]:
    """The cgroups of the daemon's standing jails: its zygotes, and the jails waiting in its
    pools (each made under the id its job will have; the daemon lists them to root)."""
    names = {p.name for p in d.job_root.glob("zygote-*")}
    with d.client() as c:
        for policy in c.policies():
            names.update((policy.get("pool") or {}).get("jails", []))
    return names


def _job_cgroup_name(d: DaemonHandle, pid: str) -> str:
    """The name of the job cgroup ``pid`` is in, or ""."""
    root = str(d.job_root) + "/"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)  # "7:memory:/..." (v1), "0::/..." (v2)
        if "memory" in controllers.split(",") if d.layout.version == 1 else controllers == "":
            full = ("/sys/fs/cgroup/memory" if d.layout.version == 1 else "/sys/fs/cgroup") + path
            if full.startswith(root):
                return full[len(root):].split("/")[0]
    return ""


def _standing_nsjail(d: DaemonHandle, pid: str, keep: set[str]) -> bool:
    """Is ``pid`` the nsjail of a standing jail (a zygote's)? It runs as the zygote's uid (the
    owner of the zygote's user namespace) outside any job cgroup, and its command line names
    the standing jail's cgroup."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return any(a.endswith(f"{d.config.subtree}/{name}") for a in args for name in keep)


def _in_subtree(d: DaemonHandle, pid: str) -> bool:
    """Is ``pid`` in a cgroup of the daemon's subtree, in any hierarchy (v1) or the one (v2)?"""
    dirs = d.subtree_dirs
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if d.layout.version == 1:
            if controllers in ("", "name=systemd"):
                continue
            full = {f"/sys/fs/cgroup/{c}{path}" for c in controllers.split(",")}
            full.add(f"/sys/fs/cgroup/{controllers}{path}")  # "cpu,cpuacct" mounted as one
        elif controllers == "":
            full = {f"/sys/fs/cgroup{path}"}
        else:
            continue
        if any(f == top or f.startswith(top + "/") for f in full for top in dirs):
            return True
    return False


def _uids(pid: str) -> list[int]:
    """A process's real, effective, saved and file-system uids."""
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ln.startswith("Uid:"))
    return [int(u) for u in line.split()[1:]]


def daemon_processes(d: DaemonHandle) -> dict[int, set[str]]:
    """Every process that is the daemon's, with why: ``tree`` (a descendant of the daemon: it
    is a child subreaper, so whatever it started and orphaned is still below it), ``uid``
    (running as a uid of the daemon's block) or ``cgroup`` (in a cgroup of its subtree).
    Another jaild instance's processes are none of these: they descend from another daemon,
    run as another block's uids (one instance per block: jaild/daemon/uidblock.py) and sit
    in another subtree."""
    tree = _descendants(d.proc.pid)
    block = range(d.config.uid_base, d.config.uid_base + UID_BLOCK)
    found: dict[int, set[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == d.proc.pid:
            continue
        try:
            why = {"tree"} if int(entry) in tree else set()
            if any(u in block for u in _uids(entry)):
                why.add("uid")
            if _in_subtree(d, entry):
                why.add("cgroup")
        except (OSError, StopIteration, ValueError):
            continue  # gone meanwhile
        if why:
            found[int(entry)] = why
    return found


def jail_processes(d: DaemonHandle) -> list[int]:
    """The daemon's processes (:func:`daemon_processes`: jails, the nsjail that runs each as
    the owner of its user namespace, anything either left) that are not a zygote or a waiting
    pooled jail, or their nsjail."""
    out = []
    keep = standing(d)
    for pid in daemon_processes(d):
        try:
            if _job_cgroup_name(d, str(pid)) not in keep and not _standing_nsjail(d, str(pid), keep):
                out.append(pid)
        except (OSError, ValueError):
            continue
    return out


def _exiting(pid: int) -> bool:
    """Has ``pid`` exited (a zombie not reaped yet, or gone)?"""
    try:
        state = proc_stat(pid)[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _describe(pid: int) -> str:
    """A leftover process, for the failure message: its command line and cgroups."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        groups = Path(f"/proc/{pid}/cgroup").read_text().replace("\n", " ")
    except OSError:
        return "(gone)"
    return f"{cmd} | {groups}"


def job_cgroups(d: DaemonHandle) -> list[str]:
    found = []
    keep = standing(d)
    for root in map(Path, d.subtree_dirs):
        if root.is_dir():
            found += [f"{root.parent.name}/{p.name}" for p in root.iterdir()
                      if p.is_dir() and p.name not in keep]
    return found


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fd_count(pid: int) -> int:
    """The descriptor count once connections just closed are gone (stable for 0.3 s)."""
    last, stable = fd_count(pid), 0
    while stable < 6:
        time.sleep(0.05)
        now = fd_count(pid)
        stable = stable + 1 if now == last else 0
        last = now
    return last


NSJAIL_TMP = re.compile(r"nsjail\.(\d+)\.")
"""nsjail's own directories in /tmp, one pair per jail uid (``nsjail.<uid>.root``, ``.tmp``)."""


MountKey = tuple[str, str, str]


def mount_table(pid: int) -> set[MountKey]:
    """A process's mount table: (mount point, file system type, source) of each mount."""
    rows = set()
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        rows.add((fields[4], fields[sep + 1], fields[sep + 2]))
    return rows


def own_mounts(d: DaemonHandle) -> set[MountKey]:
    """The mounts of the daemon's own mount namespace that the host's has not: what the daemon
    and its jails mounted. The hostile daemon runs in a namespace of its own, a slave of the
    host's (``unshare --mount --propagation slave``, as a systemd unit's hardening gives it
    one): the host's mounts -- another suite's containers and network namespaces -- propagate
    into it and so are in both tables, and its own never propagate out."""
    return mount_table(d.proc.pid) - mount_table(os.getpid())


def daemon_tmpdir(d: DaemonHandle) -> Path:
    """The hostile daemon's ``TMPDIR``, beside its socket."""
    return Path(d.socket).parent / "tmp"


def tmp_entries(d: DaemonHandle) -> set[str]:
    """What the daemon and its jails keep in temporary directories: nsjail's directories in
    /tmp for the uids of the daemon's block, and whatever is in the daemon's own ``TMPDIR``
    (its transient private directories). Another jaild's -- another checkout's suite running
    on this host -- are in another block and another ``TMPDIR``, so they are not counted."""
    block = range(d.config.uid_base, d.config.uid_base + UID_BLOCK)
    found = {f"/tmp/{name}" for name in os.listdir("/tmp")
             if (m := NSJAIL_TMP.match(name)) and int(m.group(1)) in block}
    return found | {str(p) for p in daemon_tmpdir(d).iterdir()}


def fixed_pool(text: str) -> str:
    """The policy with a warm pool of a fixed size: min = max = its min, at least 1 (spawn
    policies keep theirs). The pool then holds as many jails after the suite as before."""
    pool = tomllib.loads(text).get("pool", {})
    if pool.get("mode", "zygote") != "zygote":
        return text
    size = max(1, pool.get("min", 0))
    text = re.sub(r"(?ms)^\[pool\].*?(?=^\[|\Z)", "", text)
    return text + (f"\n[pool]\nmin = {size}\nmax = {size}\n"
                   f"preimport = {json.dumps(pool.get('preimport', []))}\n")


def pools_full(d: DaemonHandle) -> None:
    """Wait until every warm pool holds its one jail again."""
    deadline = time.monotonic() + guard(30)
    while time.monotonic() < deadline:
        with d.client() as c:
            pools = [p["pool"] for p in c.policies() if p["available"] and p["pool"]["max"]]
        if all(p["ready"] == p["min"] for p in pools):
            return
        time.sleep(0.1)
    raise AssertionError(f"the warm pools did not refill: {pools}")


def refusals_policy(tiny: str) -> str:
    """``tiny`` with room in time: for tests of what the kernel refuses (pids, files, /tmp's
    bytes and inodes, descriptors), where time is not under test. On tiny's 5 s wall and 2 s
    of CPU, making 2,048 files until ENOSPC ran out of CPU first in an emulated guest."""
    limits = tomllib.loads(tiny)["limits"]
    assert {"wall_time_s", "cpu_time_s"} <= set(limits), "tiny.toml lost a time limit"
    text = re.sub(r"(?m)^wall_time_s = .*$", "wall_time_s = 120", tiny)
    text = re.sub(r"(?m)^cpu_time_s = .*$", "cpu_time_s = 120", text)
    return text.replace('description = "Test policy: tiny limits"',
                        'description = "Test policy: tiny limits but time"')


@pytest.fixture(scope="package")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    policies = {src.stem: fixed_pool(src.read_text())
                for src in [*REPO_POLICIES.glob("*.toml"), *TEST_POLICIES.glob("*.toml")]}
    policies["refusals"] = refusals_policy(policies["tiny"])
    directory = tmp_path_factory.mktemp("hostile")
    tmpdir = directory / "tmp"  # the daemon's TMPDIR (daemon_tmpdir): its entries are its own
    tmpdir.mkdir()
    d = start_daemon(directory, policies, extra_env={"TMPDIR": str(tmpdir)},
                     wrapper=("unshare", "--mount", "--propagation", "slave"))
    d.assert_serving()  # warm: everything the daemon opens lazily is open now
    pools_full(d)
    baseline_fds = settled_fd_count(d.proc.pid)
    mounts = own_mounts(d)
    tmp_before = tmp_entries(d)
    yield d
    try:
        d.assert_serving()
        pools_full(d)
        # A jail's last process may be exiting as we look (a zombie its parent reaps in a
        # moment); only those are waited for, under a liveness guard. A live one fails at once.
        deadline = time.monotonic() + guard(30)
        while (dying := jail_processes(d)) and all(_exiting(pid) for pid in dying) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        leftover = {pid: _describe(pid) for pid in jail_processes(d)}
        assert leftover == {}, "jailed processes outlived their jobs"
        assert job_cgroups(d) == [], "job cgroups were left behind"
        # connections the tests just closed may still be closing
        deadline = time.monotonic() + guard(30)
        while fd_count(d.proc.pid) != baseline_fds and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fd_count(d.proc.pid) == baseline_fds, "the daemon leaked file descriptors"
        assert own_mounts(d) == mounts, "the daemon's mount table changed"
        tmp_after = tmp_entries(d)
        assert tmp_after <= tmp_before, f"new temporary entries: {tmp_after - tmp_before}"
    finally:
        assert d.stop() == 0  # whatever failed above, no daemon outlives the suite
