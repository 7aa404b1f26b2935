"""The leak check counts its own daemon's temporary entries and mounts, and only those
(issue 27: two suites on one host, each with its daemons). The control: an entry of the
daemon's own uid block or TMPDIR, and a mount in its own mount namespace, are counted -- the
same probe a leak would be."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from jaild.daemon.selftest import UID_BLOCK
from tests.conftest import DaemonHandle
from tests.hostile.conftest import daemon_tmpdir, own_mounts, tmp_entries


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
