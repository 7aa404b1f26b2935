"""Memory of a daemon and of what it runs, read from /proc.

Pooled jails are found among the daemon's descendants: the zygote is the topmost
process with "zygote" in its command line that is not nsjail or setpriv (the jails it
forks inherit its command line); each of its children is the root of one pooled jail,
whose PSS is the sum over that child's subtree. Everything else under the daemon
(nsjail, setpriv, jails of running jobs) is reported as "other descendants".
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

WRAPPERS = {"nsjail", "setpriv"}
"""Never the zygote, though their command lines may name it (e.g. its cgroup)."""


@dataclass
class ProcessMemory:
    pid: int
    name: str
    rss_kb: int
    pss_kb: int


@dataclass
class MemorySnapshot:
    """One look at a daemon and its descendants."""

    daemon: ProcessMemory
    zygotes: list[ProcessMemory] = field(default_factory=list)
    pooled_jails: list[ProcessMemory] = field(default_factory=list)
    """One entry per jail: ``pid`` is the jail's root, sizes are summed over its subtree."""
    others: list[ProcessMemory] = field(default_factory=list)

    @property
    def pss_per_pooled_jail_kb(self) -> float | None:
        if not self.pooled_jails:
            return None
        return sum(j.pss_kb for j in self.pooled_jails) / len(self.pooled_jails)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _parents() -> dict[int, int]:
    """pid -> ppid for every process (those that vanish while we look are left out)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def _cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()


def process_memory(pid: int) -> ProcessMemory:
    """RSS and PSS (from smaps_rollup) of one process; zeros if it is gone."""
    sizes = {"Rss:": 0, "Pss:": 0}
    for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
        key, _, rest = line.partition(" ")
        if key in sizes:
            with contextlib.suppress(ValueError):
                sizes[key] = int(rest.split()[0])
    return ProcessMemory(pid, _read(f"/proc/{pid}/comm").strip(), sizes["Rss:"], sizes["Pss:"])


def _subtree(root: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _summed(root: int, pids: list[int]) -> ProcessMemory:
    parts = [process_memory(p) for p in pids]
    return ProcessMemory(
        root, parts[0].name, sum(p.rss_kb for p in parts), sum(p.pss_kb for p in parts)
    )


def snapshot(daemon_pid: int) -> MemorySnapshot:
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    descendants = _subtree(daemon_pid, children)[1:]
    is_zygote = {
        pid: "zygote" in _cmdline(pid) and _read(f"/proc/{pid}/comm").strip() not in WRAPPERS
        for pid in descendants
    }
    zygotes = [p for p in descendants if is_zygote[p] and not is_zygote.get(parents[p], False)]
    result = MemorySnapshot(process_memory(daemon_pid))
    accounted: set[int] = set()
    for zygote in zygotes:
        result.zygotes.append(process_memory(zygote))
        accounted.add(zygote)
        for jail in children.get(zygote, ()):
            pids = _subtree(jail, children)
            accounted.update(pids)
            result.pooled_jails.append(_summed(jail, pids))
    result.others = [process_memory(p) for p in descendants if p not in accounted]
    return result
