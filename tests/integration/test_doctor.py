"""``jaild doctor`` names what a daemon killed with ``kill -9`` left (its cgroup tree), with
the command that removes it, and never a running daemon's (the control).

Nothing here runs ``jaild doctor --clean``: this host's other suites kill daemons and check
that the next start on the same socket sweeps what they left, so the test removes only its
own daemon's leftovers (:func:`jaild.daemon.leftovers.clean` on those alone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from jaild.daemon.leftovers import Leftover, clean, find_leftovers
from tests.conftest import REPO, STATE_DIR, DaemonHandle, guard

pytestmark = pytest.mark.integration


def doctor(tmp_path: Path) -> dict[str, list[dict[str, object]]]:
    """``jaild doctor --json``'s sections (no policies: no self-test daemon, just the checks)."""
    empty = tmp_path / "no-policies"
    empty.mkdir(exist_ok=True)
    out = subprocess.run(
        [sys.executable, "-m", "jaild", "doctor", "--json", "--policies", str(empty),
         "--state-dir", STATE_DIR],
        capture_output=True, text=True, cwd=REPO, timeout=guard(120),
    )
    sections: dict[str, list[dict[str, object]]] = json.loads(out.stdout)
    return sections


def named(sections: dict[str, list[dict[str, object]]]) -> dict[str, dict[str, object]]:
    """The leftovers doctor names, by path."""
    return {str(row["detail"]).split(" (")[0]: row
            for row in sections["leftovers"] if not row["ok"]}


def served(d: DaemonHandle) -> list[str]:
    with d.client() as c:
        assert c.run("6 * 7").result == 42
    return d.subtree_dirs


def test_doctor_names_a_killed_daemons_cgroup_tree_and_how_to_remove_it(
    private_daemon: Callable[..., DaemonHandle], tmp_path: Path,
) -> None:
    d = private_daemon()
    trees = served(d)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(guard(10))
    before = {t for t in trees if os.path.isdir(t)}
    rows = named(doctor(tmp_path))
    left = before & {t for t in trees if os.path.isdir(t)}  # v2: systemd may collect a scope
    if d.layout.version == 1:
        assert left == set(trees)  # nothing but a daemon removes them there
    assert left, "the killed daemon left no cgroup tree to name"
    for tree in left:
        row = rows.get(tree)
        assert row is not None, (tree, sorted(rows))
        assert row["name"] == "leftover cgroup tree"
        assert f"{d.config.instance}, gone (last: socket {d.socket}, pid {d.proc.pid})" in str(
            row["detail"])
        assert str(row["fix"]).startswith(f"find {tree} -name cgroup.procs")
    # removed under the instance's own claim, its alone (see the module docstring)
    mine = [item for item in find_leftovers() if item.instance == d.config.instance]
    assert {item.path for item in mine} >= left
    assert clean(mine) == {}
    assert not any(os.path.exists(t) for t in trees)
    assert not set(trees) & set(named(doctor(tmp_path)))


def test_control_a_running_daemons_trees_are_not_named_nor_removed(
    private_daemon: Callable[..., DaemonHandle], tmp_path: Path,
) -> None:
    d = private_daemon()
    trees = served(d)
    assert all(os.path.isdir(t) for t in trees)
    assert not set(trees) & set(named(doctor(tmp_path)))
    assert not [item for item in find_leftovers() if item.instance == d.config.instance]
    # even told to: the daemon holds its uid block's lock, so its trees are left to it
    forced = [Leftover(d.config.instance, "cgroup", t, d.config.uid_base, "") for t in trees]
    assert set(clean(forced)) == set(trees)
    assert all(os.path.isdir(t) for t in trees)
    d.assert_serving()
    assert d.proc.poll() is None
