"""The hostile suite's daemon, and the leak check that runs after every hostile test.

After the whole suite: no jailed process alive, no job cgroup left, the daemon's
descriptor count back where it started, the host's mount table unchanged, no new
temporary directories -- asserted, not eyeballed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonHandle, start_daemon


def jail_processes(d: DaemonHandle) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid_line = next(ln for ln in Path(f"/proc/{entry}/status").read_text().splitlines()
                                if ln.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if d.config.uid_base <= int(uid_line.split()[1]) < d.config.uid_base + 65536:
                out.append(int(entry))
    return out


def job_cgroups(d: DaemonHandle) -> list[str]:
    found = []
    for controller in ("memory", "pids", "cpu"):
        root = Path("/sys/fs/cgroup") / controller / d.config.subtree
        if root.is_dir():
            found += [f"{controller}/{p.name}" for p in root.iterdir() if p.is_dir()]
    return found


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def tmp_entries() -> set[str]:
    return {p for p in os.listdir("/tmp") if p.startswith(("nsjail", "jaild"))}


@pytest.fixture(scope="package")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    d = start_daemon(tmp_path_factory.mktemp("hostile"))
    d.assert_serving()  # warm: everything the daemon opens lazily is open now
    baseline_fds = fd_count(d.proc.pid)
    mounts = Path("/proc/self/mountinfo").read_text()
    tmp_before = tmp_entries()
    yield d
    d.assert_serving()
    assert jail_processes(d) == [], "jailed processes outlived their jobs"
    assert job_cgroups(d) == [], "job cgroups were left behind"
    deadline = time.monotonic() + 5  # connections the tests just closed may still be closing
    while fd_count(d.proc.pid) != baseline_fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fd_count(d.proc.pid) == baseline_fds, "the daemon leaked file descriptors"
    assert Path("/proc/self/mountinfo").read_text() == mounts, "the host mount table changed"
    assert tmp_entries() <= tmp_before, f"new temporary entries: {tmp_entries() - tmp_before}"
    assert d.stop() == 0
