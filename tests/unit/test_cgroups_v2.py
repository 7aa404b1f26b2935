"""cgroup v2 placement decisions and v2 evidence, without a v2 host.

The placement is proven for real in a Debian 12 guest (``make test-hosts``: the whole
integration suite, and the installed service's checks). Here: each branch of
:func:`jaild.daemon.jails.cgroups.place_v2` on the facts it reads, and what a job's v2 counters say when
a kernel lacks some of them (``memory.peak`` arrived in 5.19): absent, never made up.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaild.daemon.jails import cgroups
from jaild.daemon.jails.cgroups import CgroupError, JobCgroup, place_v2
from jaild.policy.compile import CgroupLayout


class Host:
    """The facts place_v2 reads, and what it did."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, own: str, *, systemd: bool,
                 delegated: set[str], procs: dict[str, set[int]], container: bool = False,
                 namespace_root: bool = False) -> None:
        self.own = own
        self.joined: list[str] = []
        self.moved: list[int] = []
        self.scopes: list[str] = []
        pid = os.getpid()
        monkeypatch.setattr(cgroups, "cgroup_of", lambda p="self": self.own)
        monkeypatch.setattr(cgroups, "_systemd_running", lambda: systemd)
        monkeypatch.setattr(cgroups, "_delegated", lambda d: d in delegated)
        monkeypatch.setattr(cgroups, "in_container", lambda: container)
        monkeypatch.setattr(cgroups, "_namespace_root", lambda: namespace_root)
        monkeypatch.setattr(cgroups, "_procs", lambda d: procs.get(d, {pid}))

        def join(directory: str, p: int) -> None:
            self.joined.append(directory)
            self.moved.append(p)
            if p == pid:
                self.own = directory[len("/sys/fs/cgroup"):]

        def scope(unit: str, p: int) -> str:
            self.scopes.append(unit)
            self.own = f"/system.slice/{unit}"
            return self.own

        monkeypatch.setattr(cgroups, "_join", join)
        monkeypatch.setattr(cgroups, "_start_scope", scope)


SERVICE = "/sys/fs/cgroup/system.slice/jaild.service"


def test_a_delegated_service_is_the_base_and_the_daemon_moves_into_its_leaf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = Host(monkeypatch, "/system.slice/jaild.service", systemd=True,
                delegated={SERVICE}, procs={})
    p = place_v2("jaild")
    assert (p.how, p.base, p.leaf) == ("delegated", SERVICE, SERVICE + "/daemon")
    assert host.joined == [SERVICE + "/daemon"] and host.scopes == []


def test_placing_twice_in_one_process_keeps_the_same_base(monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(monkeypatch, "/system.slice/jaild.service/daemon", systemd=True,
                delegated={SERVICE}, procs={})
    p = place_v2("jaild")
    assert (p.how, p.base) == ("delegated", SERVICE)
    assert host.joined == []  # already in its leaf


def test_from_a_shell_the_daemon_gets_a_delegated_scope_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = Host(monkeypatch, "/user.slice/user-0.slice/session-3.scope", systemd=True,
                delegated=set(), procs={})
    p = place_v2("jaild-0123456789")
    assert host.scopes == ["jaild-0123456789.scope"]
    assert p.how == "scope" and p.base == "/sys/fs/cgroup/system.slice/jaild-0123456789.scope"
    assert host.joined == [p.base + "/daemon"]
    assert "not delegated" in p.detail


def test_a_delegated_cgroup_shared_with_other_processes_is_not_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # e.g. a test daemon started by a test runner inside a delegated unit
    shared = "/sys/fs/cgroup/system.slice/ci.service"
    host = Host(monkeypatch, "/system.slice/ci.service", systemd=True, delegated={shared},
                procs={shared: {os.getpid(), 1234}})
    p = place_v2("jaild-x")
    assert p.how == "scope" and host.scopes == ["jaild-x.scope"]
    assert "shared with other processes" in p.detail


def test_no_systemd_in_the_root_cgroup_uses_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(monkeypatch, "/", systemd=False, delegated=set(), procs={})
    p = place_v2("jaild")
    assert (p.how, p.base, p.leaf) == ("root", "/sys/fs/cgroup", None)
    assert host.joined == []


def test_no_systemd_in_a_cgroup_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    Host(monkeypatch, "/container", systemd=False, delegated=set(), procs={})
    p = place_v2("jaild")
    assert (p.how, p.base) == ("own", "/sys/fs/cgroup/container")


def test_no_systemd_in_a_shared_cgroup_is_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Host(monkeypatch, "/container", systemd=False, delegated=set(),
         procs={"/sys/fs/cgroup/container": {os.getpid(), 99}})
    with pytest.raises(CgroupError, match="cgroup of its own"):
        place_v2("jaild")


def test_a_private_cgroup_namespace_is_the_containers_cgroup_not_the_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a container with a private cgroup namespace the daemon sees itself at "/", but
    that root is the container's cgroup (it has cgroup.type), not the real root: the
    daemon and the container's init (tini, pid 1) both move into the leaf, so the cgroup
    can hand its controllers to the jobs' cgroups."""
    host = Host(monkeypatch, "/", systemd=False, delegated=set(),
                procs={"/sys/fs/cgroup": {os.getpid(), 1}}, namespace_root=True)
    p = place_v2("jaild")
    assert (p.how, p.base, p.leaf) == ("container", "/sys/fs/cgroup", "/sys/fs/cgroup/daemon")
    assert sorted(host.moved) == sorted([1, os.getpid()])
    assert "private cgroup namespace" in p.detail and "1 process(es) moved" in p.detail


def test_a_container_in_the_hosts_cgroup_namespace_uses_its_own_cgroup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = "/sys/fs/cgroup/kubepods.slice/pod1/cri-containerd-abc.scope"
    host = Host(monkeypatch, here[len("/sys/fs/cgroup"):], systemd=False, delegated=set(),
                procs={here: {os.getpid(), 4242}}, container=True)
    p = place_v2("jaild")
    assert (p.how, p.base) == ("container", here)
    assert sorted(host.moved) == sorted([4242, os.getpid()])


def test_the_real_root_cgroup_is_not_mistaken_for_a_containers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control of the namespace test: at the real root (no cgroup.type) nobody moves,
    whatever the markers say."""
    host = Host(monkeypatch, "/", systemd=False, delegated=set(),
                procs={"/sys/fs/cgroup": {os.getpid(), 1}}, container=True)
    assert place_v2("jaild").how == "root" and host.moved == []


def test_a_scope_systemd_refuses_names_both_ways_out(monkeypatch: pytest.MonkeyPatch) -> None:
    Host(monkeypatch, "/user.slice/session-1.scope", systemd=True, delegated=set(), procs={})

    def refuse(unit: str, pid: int) -> str:
        raise CgroupError("Access denied")

    monkeypatch.setattr(cgroups, "_start_scope", refuse)
    with pytest.raises(CgroupError) as err:
        place_v2("jaild")
    assert "systemd-run --scope -p Delegate=yes" in str(err.value)
    assert "systemctl enable --now jaild.socket" in str(err.value)


def _v2_job(tmp_path: Path, files: dict[str, str]) -> JobCgroup:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    job = JobCgroup(CgroupLayout(version=2, subtree="jaild"))
    job.memory_dir = job.pids_dir = str(tmp_path)
    return job


def test_v2_evidence_from_the_kernel_files(tmp_path: Path) -> None:
    job = _v2_job(tmp_path, {
        "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n",
        "memory.peak": "104857600\n",
        "pids.peak": "7\n",
        "cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n",
        "memory.max": "268435456\n", "memory.swap.max": "0\n", "pids.max": "64\n",
    })
    assert job.oom_killed() is True
    assert job.peak_memory_bytes() == 100 << 20 and job.peak_pids() == 7
    assert job.cpu_times() == (1.0, 0.5)
    assert job.limits() == {"memory_limit": 256 << 20, "memsw_limit": 256 << 20, "pids_max": 64}


def test_counters_an_older_kernel_lacks_are_absent_not_made_up(tmp_path: Path) -> None:
    # kernel 5.10 (Debian 11): no memory.peak; pids.peak is absent on kernels before 6.1
    job = _v2_job(tmp_path, {
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
        "cpu.stat": "usage_usec 10\nuser_usec 6\nsystem_usec 4\n",
    })
    assert job.oom_killed() is False
    assert job.peak_memory_bytes() is None and job.peak_pids() is None


EVIDENCE = {
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
    "memory.peak": "1048576\n",
    "pids.peak": "2\n",
    "cpu.stat": "usage_usec 30\nuser_usec 20\nsystem_usec 10\n",
}


def test_kept_counters_are_read_through_their_open_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _v2_job(tmp_path, EVIDENCE)
    job.keep_counters_open()
    assert sorted(os.path.basename(p) for p in job._kept) == sorted(EVIDENCE)

    def no_open(path: str) -> str:
        raise AssertionError(f"opened {path}")

    monkeypatch.setattr(cgroups, "_read", no_open)
    # the files change under the kept fds (same inode, as a kernel counter does)
    for name, text in {
        "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        "memory.peak": "104857600\n", "pids.peak": "7\n",
        "cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n",
    }.items():
        with open(tmp_path / name, "r+") as f:
            f.write(text)
    assert job.oom_killed() is True
    assert job.peak_memory_bytes() == 100 << 20 and job.peak_pids() == 7
    assert job.cpu_times() == (1.0, 0.5)


def test_once_removed_the_kept_fds_are_closed_and_reads_open_their_file(tmp_path: Path) -> None:
    job = _v2_job(tmp_path, EVIDENCE)
    job.keep_counters_open()
    fds = list(job._kept.values())
    job.dirs = []  # nothing to rmdir here: only the fds
    job.remove()
    assert job._kept == {}
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert job.peak_pids() == 2  # positive control: still readable, by opening the file


def test_with_fds_short_no_counter_is_kept_and_reads_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _v2_job(tmp_path, EVIDENCE)
    monkeypatch.setattr(cgroups.resource, "getrlimit", lambda _: (8, 8))  # half: 4, all used
    job.keep_counters_open()
    assert job._kept == {}
    assert job.peak_memory_bytes() == 1 << 20 and job.cpu_times() == (20e-6, 10e-6)

