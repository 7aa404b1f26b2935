"""jaild/daemon/leftovers.py without root: what counts as a gone instance's cgroup tree,
judged by its uid block's lock (held here by the test itself, as a daemon holds it), and
what ``clean`` removes -- never a tree whose lock is held."""

from __future__ import annotations

import dataclasses
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.daemon.config import DaemonConfig, instance_uid_base
from jaild.daemon.leftovers import (
    Leftover,
    cgroup_mounts,
    clean,
    find_leftovers,
    leftover_checks,
)
from jaild.daemon.uidblock import claim_record, lock_path

MOUNTINFO = (
    "30 23 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "35 30 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    "36 30 0:32 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
    "37 30 0:33 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    "38 23 8:1 / /tmp rw - ext4 /dev/sda1 rw\n"
)


def test_every_cgroup_hierarchy_is_searched() -> None:
    assert cgroup_mounts(MOUNTINFO) == [
        "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified"]


GONE = DaemonConfig(socket_path="/tmp/gone/jaild.sock")
LIVE = DaemonConfig(socket_path="/tmp/live/jaild.sock")
UNCLAIMED = DaemonConfig(socket_path="/tmp/elsewhere/jaild.sock")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[str, str, list[str]]]:
    """A cgroup "mount" holding the trees of three instances -- one gone, one running (its
    lock held by this test, as its daemon would), one whose claims are not in this lock
    directory -- and the lock directory; yields (mountinfo, lock dir, the gone one's dirs)."""
    mount, locks = tmp_path / "cg", tmp_path / "locks"
    locks.mkdir()
    for config in (GONE, LIVE, UNCLAIMED):
        for job in ("job-1", "zygote-default/NSJAIL.7"):
            (mount / "base" / config.instance / job).mkdir(parents=True)
        if config is not UNCLAIMED:
            lock = Path(lock_path(config.uid_base, str(locks)))
            lock.write_text(claim_record(config.socket_path, 4242))
    gone = [str(mount / "base" / GONE.instance)]
    (mount / "base" / "jaild-not-an-instance").mkdir()
    fd = os.open(lock_path(LIVE.uid_base, str(locks)), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield f"40 23 0:40 / {mount} rw - cgroup cgroup rw,memory\n", str(locks), gone
    finally:
        os.close(fd)


def test_only_the_gone_instances_tree_is_named(host: tuple[str, str, list[str]],
                                                tmp_path: Path) -> None:
    mountinfo, locks, gone = host
    found = find_leftovers(mountinfo=mountinfo, lock_dir=locks, tmp=str(tmp_path / "none"))
    assert [(f.instance, f.kind, f.path) for f in found] == [(GONE.instance, "cgroup", gone[0])]
    assert found[0].last_claimant == "socket /tmp/gone/jaild.sock, pid 4242"
    assert found[0].uid_base == instance_uid_base(GONE.instance) == GONE.uid_base
    row, = leftover_checks(found)
    assert not row.ok and row.detail.startswith(f"{gone[0]} ({GONE.instance}, gone (last: ")
    assert row.warn  # nothing runs in it: the doctor warns and still exits 0
    busy = dataclasses.replace(found[0], processes=2)
    row, = leftover_checks([busy])  # control: a gone instance's processes still run there
    assert not row.ok and not row.warn and "2 process(es) still in it" in row.detail
    assert row.fix.startswith(f"find {gone[0]} -name cgroup.procs -exec cat {{}} + | xargs")


def test_a_config_subtree_of_another_name_is_found(tmp_path: Path) -> None:
    config = DaemonConfig(socket_path="/tmp/named/jaild.sock", cgroup_subtree="sandboxes")
    (tmp_path / "cg" / "sandboxes" / "job-1").mkdir(parents=True)
    (tmp_path / "locks").mkdir()
    Path(lock_path(config.uid_base, str(tmp_path / "locks"))).write_text("")
    mountinfo = f"40 23 0:40 / {tmp_path / 'cg'} rw - cgroup cgroup rw,memory\n"
    found = find_leftovers(config, mountinfo=mountinfo, lock_dir=str(tmp_path / "locks"),
                           tmp=str(tmp_path))
    assert [(f.instance, f.path) for f in found] == [
        (config.instance, str(tmp_path / "cg" / "sandboxes"))]
    assert found[0].last_claimant == ""


def test_clean_removes_the_gone_tree_and_never_a_held_one(
    host: tuple[str, str, list[str]], tmp_path: Path,
) -> None:
    mountinfo, locks, gone = host
    live_tree = str(tmp_path / "cg" / "base" / LIVE.instance)
    found = find_leftovers(mountinfo=mountinfo, lock_dir=locks, tmp=str(tmp_path / "none"))
    forced = Leftover(LIVE.instance, "cgroup", live_tree, LIVE.uid_base, "")
    failed = clean([*found, forced], lock_dir=locks)
    assert failed == {live_tree: "its instance is running again (its uid block is claimed): "
                                 "left to it"}
    assert not os.path.exists(gone[0]) and os.path.isdir(live_tree)
    rows = leftover_checks([*found, forced], failed)
    assert [(r.ok, r.detail.split(" (")[0]) for r in rows] == [
        (True, f"removed {gone[0]}"), (False, live_tree)]
    assert "not removed: its instance is running again" in rows[1].detail


def test_a_work_directory_not_of_its_uid_is_not_named(tmp_path: Path) -> None:
    (tmp_path / "locks").mkdir()
    uid = GONE.uid_base + 5
    Path(lock_path(GONE.uid_base, str(tmp_path / "locks"))).write_text("")
    (tmp_path / f"nsjail.{uid}.root").mkdir()  # this test's uid's, not the jail's
    (tmp_path / "nsjail.12.root").mkdir()  # no jail uid at all
    assert find_leftovers(mountinfo="", lock_dir=str(tmp_path / "locks"), tmp=str(tmp_path)) == []


def test_nothing_left_is_one_passing_row() -> None:
    row, = leftover_checks([])
    assert row.ok and row.name == "leftovers of gone instances"
