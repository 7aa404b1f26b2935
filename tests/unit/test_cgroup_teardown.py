"""A job cgroup's end, on this host's real cgroups (v1 here): the kill that reads one
hierarchy, and the removal that is one ``rmdir`` when the cgroup is empty and still kills
and removes what is left when it is not (:mod:`jaild.daemon.jails.cgroups`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.daemon.jails import cgroups as cgroups_module
from jaild.daemon.jails.cgroups import Cgroups, JobCgroup, detect

pytestmark = pytest.mark.skipif(
    os.path.exists("/sys/fs/cgroup/cgroup.controllers"),
    reason="cgroup v1 only: on v2 preparing a subtree moves the calling process into a leaf",
)


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    made = Cgroups(detect(f"teardown-test-{os.getpid()}"))
    made.prepare()
    yield made
    for root in made.subtree_dirs():
        for job in Path(root).iterdir() if Path(root).is_dir() else []:
            if job.is_dir():
                cgroups_module._rmtree_cgroup(str(job))
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(root)


def _sleeper() -> int:
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(600)
        finally:
            os._exit(0)
    return pid


def _killed(pid: int) -> bool:
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _adopted(job: JobCgroup) -> int:
    pid = _sleeper()
    job.adopt(pid)
    assert pid in job.member_pids(jail_only=True)
    return pid


def test_a_jail_is_killed_through_its_memory_cgroup_alone(cgroups: Cgroups) -> None:
    job = cgroups.create_job("j1", 64, 16, with_cpu=False)
    try:
        assert len(job.dirs) >= 2  # memory, pids (and cpuacct where mounted)
        assert cgroups_module._cgroup_dirs(job.memory_dir) == [job.memory_dir]
        pid = _adopted(job)
        assert job.kill_jail() == 1
        assert _killed(pid)
    finally:
        job.remove()
    assert not any(os.path.exists(d) for d in job.dirs)


def test_removing_an_empty_job_cgroup_and_a_busy_one(cgroups: Cgroups) -> None:
    empty = cgroups.create_job("j2", 64, 16, with_cpu=False)
    empty.remove()
    assert not any(os.path.exists(d) for d in empty.dirs)
    busy = cgroups.create_job("j3", 64, 16, with_cpu=False)
    pid = _adopted(busy)
    busy.remove()  # what is in it is killed first, then it goes
    assert _killed(pid)
    assert not any(os.path.exists(d) for d in busy.dirs)


def test_a_job_cgroup_with_cgroups_below_it_is_walked(cgroups: Cgroups) -> None:
    """nsjail (spawn mode) puts its child in ``<job>/NSJAIL.<pid>``: the kill and the
    removal go below the job's cgroup, deepest first."""
    job = cgroups.create_job("j4", 64, 16, with_cpu=False)
    below = os.path.join(job.memory_dir, "NSJAIL.1")
    os.mkdir(below)
    pid = _sleeper()
    cgroups_module._write(os.path.join(below, "cgroup.procs"), str(pid))
    assert cgroups_module._cgroup_dirs(job.memory_dir) == [below, job.memory_dir]
    assert job.kill_jail() == 1
    assert _killed(pid)
    job.remove()
    assert not os.path.exists(below) and not any(os.path.exists(d) for d in job.dirs)
