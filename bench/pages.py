"""Pages copied per fresh jail: how many of its zygote's pages a trivial job's jail writes.

A jail forked from its policy's zygote shares the zygote's memory copy-on-write: every page
it writes -- a reference count, an allocator pool, a frame -- is copied at its first write,
at ~4 us of kernel CPU a page on this VM (``bench/floors.py``). This script starts a private
daemon (``bench/jaildrun.py``) with the default policy as the benchmark ships it, twice:

* **cold**: a zygote and no pool, so each job's jail is forked for it;
* **warm**: a pool of pre-forked jails (each runs a throwaway warm-up job while it waits).

and trivial jobs on each, one at a time, of two kinds:

* the benchmark's own (``PrivateDaemon.jail_pages``): its one line reads the jail's minor
  faults (``getrusage``: in a forked jail, copy-on-write faults nearly all, the rest first
  touches of fresh memory and of file pages not mapped yet);
* a probe that reads them too, then its memory's private dirty pages by mapping
  (``/proc/self/smaps``: which of the heap, anonymous memory -- pymalloc's arenas, mostly
  --, the stack, and the writable data of the python executable and of each extension
  module got written). Private dirty is approximate: a page the zygote wrote since the
  fork is private to the jail without the jail having copied it, and reading ``smaps``
  writes a few pages of its own.

For the warm variant it also reads each pooled jail's minor faults while it waits for its
job (``/proc/PID/stat``, from the host): what a warm job copies on its own clock is the
difference; the rest, mostly the jail's throwaway warm-up job, was copied before the job
existed (still CPU of the machine's, not of the job's latency).

Usage: python bench/pages.py [--daemons N] [--runs N] [--out FILE.md]

Each variant runs on ``--daemons`` daemons one after another (each zygote's layout differs
with its hash seed: daemons differ by some pages where one daemon's jails agree within a
few), ``--runs`` jobs of each kind on each. It prints a Markdown table (medians over all the
variant's jobs, and the spread of the daemons' medians) and writes it to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from jaildrun import PrivateDaemon, Variant
from measure import BenchError

from jaild.client import Client

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
TRIVIAL = "import resource\nresource.getrusage(resource.RUSAGE_SELF).ru_minflt"
"""The benchmark's trivial job (``PrivateDaemon.jail_pages``): its jail's minor faults."""
PROBE = """\
import resource
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
dirty = {}
name = "?"
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split(None, 1)[0]
        if head[-1:] != ":" or "-" in head:
            parts = line.split()
            name = parts[5] if len(parts) > 5 else "[anon]"
            if name.startswith("/"):
                name = name.rsplit("/", 1)[1]
        elif head == "Private_Dirty:":
            kb = int(line.split()[1])
            if kb:
                dirty[name] = dirty.get(name, 0) + kb
[faults, dirty]
"""
"""A trivial job: its minor faults, then its private dirty kB by mapping name."""
GROUPS = (
    ("[anon]", "anonymous memory (pymalloc arenas, mmap'd malloc)"),
    ("[heap]", "the heap (glibc malloc)"),
    ("[stack]", "the stack"),
    ("libpython", "libpython's data and bss"),
    ("python", "the python executable's data and bss"),
    (".so", "extension modules' and libraries' data"),
    ("", "everything else"),
)


def _group(name: str) -> str:
    for key, _ in GROUPS:
        if key == "[anon]" and name == "[anon]":
            return key
        if key in ("[heap]", "[stack]") and name == key:
            return key
        if key == "libpython" and name.startswith("libpython"):
            return key
        if key == "python" and name.startswith("python"):
            return key
        if key == ".so" and ".so" in name:
            return key
    return ""


def _minflt(pid: int) -> int | None:
    """A process's minor faults (``/proc/PID/stat``, field 10), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[7])  # after pid and comm: state is [0]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def zygotes(daemon_pid: int) -> list[int]:
    """The daemon's zygotes: the processes under it running :mod:`jaild.runtime.zygote`."""
    found = []
    todo = _children(daemon_pid)
    while todo:
        pid = todo.pop()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if b"jaild.runtime.zygote" in cmdline and "python" in exe:  # not its nsjail
            found.append(pid)
        else:
            todo += _children(pid)
    return found


def _zygote_faults(daemon_pid: int) -> int:
    return sum(_minflt(z) or 0 for z in zygotes(daemon_pid))


def _pooled_faults(daemon_pid: int) -> list[int]:
    """Minor faults of each jail now waiting in the pool (its zygote's children)."""
    faults = []
    for zygote in zygotes(daemon_pid):
        for pid in _children(zygote):
            value = _minflt(pid)
            if value is not None:
                faults.append(value)
    return faults


class Pages:
    """One variant's jobs: the trivial job's faults, the probe's, its private dirty kB by
    group, and (warm) the pooled jails' faults as they waited."""

    def __init__(self) -> None:
        self.trivial: list[int] = []
        self.faults: list[int] = []
        self.dirty: dict[str, list[int]] = {key: [] for key, _ in GROUPS}
        self.waiting: list[int] = []
        self.zygote_faults = 0
        """The zygotes' own minor faults over the counted jobs: each page a zygote writes
        while a jail still shares it is copied on the zygote's side."""
        self.jobs = 0
        self.daemon_medians: list[int] = []
        """Each daemon's median of the trivial job's pages: a zygote's layout differs with
        its hash seed, so daemons differ by some pages where one daemon's jails agree."""

    def add(self, result: object) -> None:
        if not (isinstance(result, list) and len(result) == 2 and isinstance(result[0], int)
                and isinstance(result[1], dict)):
            raise BenchError(f"the probe returned {result!r}")
        self.faults.append(result[0])
        sums = dict.fromkeys(self.dirty, 0)
        for name, kb in result[1].items():
            sums[_group(str(name))] += int(kb)
        for key, kb in sums.items():
            self.dirty[key].append(kb)


def measure(daemon: PrivateDaemon, runs: int, pooled: bool, pages: Pages) -> None:
    """``runs`` trivial jobs and ``runs`` probes on ``daemon``, added to ``pages``."""
    zygote_before = 0
    trivial = len(pages.trivial)
    with Client(daemon.socket) as c:
        for i in range(2 * (runs + 1)):
            if i == 2:
                zygote_before = _zygote_faults(daemon.pid)
            probe = i % 2 == 1
            if pooled:
                time.sleep(0.3)  # the pool refills, and its jails finish their warm-up
                waiting = _pooled_faults(daemon.pid)
            r = c.run(PROBE if probe else TRIVIAL, daemon.policy)
            if r.status != "ok":
                raise BenchError(f"job {r.status}: {r.error}")
            if i < 2:
                continue  # the first jobs of a daemon warm its own caches: not counted
            if probe:
                pages.add(r.result)
            elif isinstance(r.result, int):
                pages.trivial.append(r.result)
                if pooled and waiting:
                    pages.waiting.append(int(statistics.median(waiting)))
            else:
                raise BenchError(f"the trivial job returned {r.result!r}")
    pages.zygote_faults += _zygote_faults(daemon.pid) - zygote_before
    pages.jobs += 2 * runs
    pages.daemon_medians.append(int(statistics.median(pages.trivial[trivial:])))


def table(results: dict[str, Pages]) -> str:
    names = list(results)
    lines = ["| pages (median) | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    def med(xs: list[int]) -> int:
        return int(statistics.median(xs)) if xs else 0

    row("**the trivial job's jail, by its code's line** (minor faults)",
        [f"**{med(p.trivial)}**" for p in results.values()])
    row("the same, each daemon's median: least to most",
        [f"{min(p.daemon_medians)} to {max(p.daemon_medians)}" for p in results.values()])
    row("of which before the job reached its jail (a pooled jail, waiting)",
        [str(med(p.waiting)) if p.waiting else "" for p in results.values()])
    row("on the job's own clock",
        [str(med(p.trivial) - med(p.waiting)) if p.waiting else str(med(p.trivial))
         for p in results.values()])
    row("the zygote's own, per job it forked a jail for",
        [f"{p.zygote_faults / max(1, p.jobs):.0f}" for p in results.values()])
    row("the probe's jail, by its first line (minor faults)",
        [str(med(p.faults)) for p in results.values()])
    for key, label in GROUPS:
        row(f"the probe's private dirty pages: {label}",
            [str(med(p.dirty[key]) // PAGE_KB) for p in results.values()])
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--daemons", type=int, default=5, help="daemons per variant, one after another")
    p.add_argument("--runs", type=int, default=10, help="jobs of each kind per daemon")
    p.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = p.parse_args()
    results: dict[str, Pages] = {}
    for variant, pooled in (
        (Variant("pages_cold", "cold", "zygote", 0, 0), False),
        (Variant("pages_warm", "warm", "zygote", 1, 1), True),
    ):
        pages = results[variant.label] = Pages()
        for _ in range(args.daemons):
            with PrivateDaemon(variant) as daemon:
                measure(daemon, args.runs, pooled, pages)
    text = (f"Pages a trivial job's jail copied from its zygote ({args.daemons} daemons of each "
            f"variant, {args.runs} jobs of each kind on each, one at a time):\n\n"
            + table(results) + "\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
