"""The leak checks count their own daemon's processes, cgroups, temporary entries and mounts,
and only those (issue 27: two suites on one host, each with its daemons); the session's
cgroup check counts the subtrees of the daemons this suite started, and only those. The
control: the same kind of thing of the daemon's own -- its running job, a process of its uid
block, a cgroup of its subtree, an entry of its block or TMPDIR, a mount in its own mount
namespace -- is counted, exactly as a leak would be."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.daemon.config import DaemonConfig
from jaild.daemon.jails.cgroups import detect
from jaild.daemon.selftest import UID_BLOCK
from tests.conftest import (
    DaemonHandle,
    _descendants,
    _subtrees,
    guard,
    held_subtrees,
    start_daemon,
    sweep_cgroups,
)
from tests.hostile.conftest import (
    daemon_processes,
    daemon_tmpdir,
    jail_processes,
    job_cgroups,
    own_mounts,
    tmp_entries,
)


def test_only_the_daemons_own_temporary_entries_are_counted(hostile: DaemonHandle) -> None:
    base = hostile.config.uid_base
    # another jaild's block: the next one along, or the one before at the top
    other = base + UID_BLOCK if base + 2 * UID_BLOCK < 2**32 else base - UID_BLOCK
    theirs = Path(f"/tmp/nsjail.{other + 7}.root")
    ours = Path(f"/tmp/nsjail.{base + 7}.root")
    private = daemon_tmpdir(hostile) / "jaild-leaf-probe"
    made = []
    try:
        for path in (theirs, ours, private):
            assert not path.exists(), f"{path} exists already"
            path.mkdir()
            made.append(path)
        found = tmp_entries(hostile)
        assert str(theirs) not in found  # another instance's: not ours to count
        assert str(ours) in found  # the control: our block's is counted
        assert str(private) in found  # and so is what is in our TMPDIR
    finally:
        for path in made:
            os.rmdir(path)


def test_only_the_daemons_own_mounts_are_counted(hostile: DaemonHandle, tmp_path: Path) -> None:
    """A mount on the host (another suite's container, say) is not the daemon's; one in the
    daemon's own mount namespace is (the control: what a jail's escaped mount would be)."""
    host_point, own_point = tmp_path / "host", daemon_tmpdir(hostile) / "own-probe"
    host_point.mkdir()
    own_point.mkdir()
    before = own_mounts(hostile)
    subprocess.run(["mount", "-t", "tmpfs", "probe-host", str(host_point)], check=True)
    try:
        assert own_mounts(hostile) == before  # the host's: not counted
        subprocess.run(["nsenter", "--mount", f"--target={hostile.proc.pid}",
                        "mount", "-t", "tmpfs", "probe-own", str(own_point)], check=True)
        try:
            assert own_mounts(hostile) - before == {(str(own_point), "tmpfs", "probe-own")}
        finally:
            subprocess.run(["nsenter", "--mount", f"--target={hostile.proc.pid}",
                            "umount", str(own_point)], check=True)
    finally:
        subprocess.run(["umount", str(host_point)], check=True)
        os.rmdir(own_point)
    assert own_mounts(hostile) == before


@pytest.fixture
def other_instance(tmp_path: Path, hostile: DaemonHandle) -> Iterator[DaemonHandle]:
    """Another jaild instance beside the hostile daemon: another socket, so another instance
    name, subtree and uid block (start_daemon's socket is on a block no daemon holds)."""
    other = start_daemon(tmp_path / "other", {"default": ""}, with_repo_policies=False)
    try:
        assert other.config.uid_base != hostile.config.uid_base
        assert other.config.subtree != hostile.config.subtree
        yield other
    finally:
        assert other.stop() == 0, other.log()[-2000:]
        sweep_cgroups(other)


class Held:
    """A job held in a tool call (its jail running) until :meth:`end`."""

    def __init__(self, d: DaemonHandle) -> None:
        self.inside, self.release = threading.Event(), threading.Event()
        self.client = Client(d.socket)
        self.job = self.client.submit("await tools.hold()", tools={"hold": self._hold})
        assert self.inside.wait(guard(60)), "the job never reached its tool call"
        self.pids = d.job_pids(self.job.job_id)
        assert self.pids, "the held job has no processes"

    def _hold(self) -> bool:
        self.inside.set()
        return self.release.wait(guard(60))

    def end(self) -> None:
        self.release.set()
        try:
            assert self.job.result(guard(60)).status == "ok"
        finally:
            self.client.close()


def _probe_process(*prefix: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*prefix, "sleep", "120"], stdin=subprocess.DEVNULL)


def _as_uid(uid: int) -> tuple[str, ...]:
    return ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups")


def _in_new_cgroup(d: DaemonHandle, name: str, proc: subprocess.Popen[bytes]) -> Path:
    """Move ``proc`` into a new cgroup ``name`` of ``d``'s subtree (v1: the memory
    hierarchy's), as a job's process would be."""
    cgroup = d.job_root / name
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text(str(proc.pid))
    return cgroup


def test_only_the_daemons_own_processes_and_cgroups_are_counted(
    hostile: DaemonHandle, other_instance: DaemonHandle,
) -> None:
    """Another instance's running job, a process of its uid block and one in its subtree are
    not the hostile daemon's; the same of the hostile daemon's own are (the control), each
    for what makes it the daemon's, and the cgroup check counts the cgroup."""
    ours, theirs = hostile.config.uid_base, other_instance.config.uid_base
    held = [Held(hostile), Held(other_instance)]
    probes = {"our uid": _probe_process(*_as_uid(ours + 7)),
              "their uid": _probe_process(*_as_uid(theirs + 7)),
              "our cgroup": _probe_process(), "their cgroup": _probe_process()}
    cgroups = []
    try:
        cgroups = [_in_new_cgroup(hostile, "leak-probe-ours", probes["our cgroup"]),
                   _in_new_cgroup(other_instance, "leak-probe-theirs", probes["their cgroup"])]
        counted, theirs_counted = daemon_processes(hostile), daemon_processes(other_instance)
        leftover = jail_processes(hostile)

        # the control: our running job's processes are ours three times over, and a leak
        for pid in held[0].pids:
            assert counted.get(pid) == {"tree", "uid", "cgroup"}, (pid, counted.get(pid))
        assert set(held[0].pids) <= set(leftover)
        assert counted[probes["our uid"].pid] == {"uid"}
        assert counted[probes["our cgroup"].pid] == {"cgroup"}
        assert {probes["our uid"].pid, probes["our cgroup"].pid} <= set(leftover)
        assert "leak-probe-ours" in {c.rsplit("/", 1)[-1] for c in job_cgroups(hostile)}

        # the other instance's: none of its processes (its daemon's whole tree: zygotes,
        # nsjails, the held job), nor a process of its block or in its subtree
        other_tree = _descendants(other_instance.proc.pid)
        assert set(held[1].pids) <= other_tree
        assert not (other_tree | {probes["their uid"].pid, probes["their cgroup"].pid}) & set(counted)
        assert "leak-probe-theirs" not in {c.rsplit("/", 1)[-1] for c in job_cgroups(hostile)}
        # ... which the other instance's own check does count (the control, the other way)
        assert set(held[1].pids) <= set(theirs_counted)
        assert theirs_counted[probes["their uid"].pid] == {"uid"}
        assert theirs_counted[probes["their cgroup"].pid] == {"cgroup"}
        assert "leak-probe-theirs" in {c.rsplit("/", 1)[-1] for c in job_cgroups(other_instance)}
    finally:
        for proc in probes.values():
            proc.kill()
            proc.wait()
        for cgroup in cgroups:
            cgroup.rmdir()
        for job in held:
            job.end()
    assert set(jail_processes(hostile)).isdisjoint(held[0].pids)


def test_only_the_subtrees_of_this_suites_daemons_are_held_to_account(tmp_path: Path) -> None:
    """The session's cgroup check: a subtree named for a daemon this suite started -- with its
    socket on the command line or in its config file -- is held to account; one named for a
    daemon another process started (another suite's) is not. Each start fails at once (no
    policies), and each subtree is made here, as a daemon that died would leave it."""
    config = tmp_path / "jaild.toml"
    config.write_text(f'[daemon]\nsocket = "{tmp_path / "by-config.sock"}"\n')
    serve = [sys.executable, "-m", "jaild", "serve", "--policies", str(tmp_path / "none")]
    starts = {
        "ours": [*serve, "--socket", str(tmp_path / "ours.sock")],
        "ours by config": [*serve, "--config", str(config)],
        # another process's daemon: this process starts a shell, and the shell the daemon
        "theirs": ["sh", "-c", " ".join([*serve, "--socket", str(tmp_path / "theirs.sock")])],
    }
    for argv in starts.values():
        done = subprocess.run(argv, capture_output=True, text=True, timeout=guard(60), check=False)
        assert done.returncode != 0 and "cannot load policies" in done.stderr, done.stderr
    names = {what: DaemonConfig(socket_path=str(tmp_path / sock)).subtree
             for what, sock in (("ours", "ours.sock"), ("ours by config", "by-config.sock"),
                                ("theirs", "theirs.sock"))}
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    root = Path("/sys/fs/cgroup") if v2 else Path(detect("").v1_base("memory"))
    made = []
    try:
        for name in names.values():
            (root / name).mkdir()
            made.append(root / name)
        assert {Path(p).name for p in _subtrees()} >= set(names.values())  # all are found
        held = {Path(p).name for p in held_subtrees()}
        assert names["ours"] in held and names["ours by config"] in held  # the control
        assert names["theirs"] not in held
    finally:
        for directory in made:
            directory.rmdir()
    assert not {Path(p).name for p in held_subtrees()} & set(names.values())
