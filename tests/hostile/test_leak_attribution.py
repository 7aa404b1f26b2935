"""The leak check counts its own daemon's temporary entries, and only those (issue 27: two
suites on one host, each with its daemons). The control: an entry of the daemon's own uid
block, or in its own TMPDIR, is counted -- the same probe a leak would be."""

from __future__ import annotations

import os
from pathlib import Path

from jaild.daemon.selftest import UID_BLOCK
from tests.conftest import DaemonHandle
from tests.hostile.conftest import daemon_tmpdir, tmp_entries


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
