"""The daemon's own CPU per job: what its Python (and the kernel on its behalf) spends.

A private daemon (:class:`jaildrun.PrivateDaemon`) per variant -- warm (zygote, pool of 4-8,
20 ms between jobs so the pool refills, as the benchmark's warm row) and cold (zygote, pool
0) -- runs ``runs`` trivial jobs one after another from one ``AsyncClient``. Around the timed
jobs the daemon process's own user and system time is read from ``/proc/PID/stat``
(``utime + stime``: every thread of the daemon, living or ended; not its children, so neither
the zygote nor the jails it forks), and the context switches of its main thread (the event
loop's: each voluntary one is a sleep and a wake-up) from ``/proc/PID/status``. The whole is
repeated ``rounds`` times on the same daemon; each round is one figure, the table shows the
range.

With ``--strace`` a further round is run with ``strace -f -c`` attached to the daemon (its
threads, not the zygote's forks): the system calls per job and the commonest ones. strace
slows the daemon; its figures are counts, not times.

With ``--base REV`` a second daemon runs that revision's package (a temporary worktree put
first on its ``sys.path``, as ``bench/ab.py`` does); the two take turns job by job.

Usage: python bench/daemon_cpu.py [--runs N] [--rounds R] [--base REV] [--strace]
[--only warm|cold] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from pathlib import Path

from ab import base_entry, worktree
from jaildrun import REPO, PrivateDaemon, Variant
from measure import BenchError

from jaild.client import AsyncClient

CODE = "result = 1 + 1\nresult"
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
WARM_PAUSE_S = 0.020
"""Between warm jobs, so the pool refills (the benchmark's warm row)."""
VARIANTS = {
    "warm": (Variant("dcpu_warm", "warm (zygote, pool 4-8)", "zygote", 4, 8), WARM_PAUSE_S),
    "cold": (Variant("dcpu_cold", "cold (zygote, pool 0)", "zygote"), 0.0),
}


@dataclass(frozen=True)
class Sample:
    """The daemon's counters at one moment."""

    user_s: float
    """utime of the whole process (all its threads), not its children."""
    system_s: float
    """stime, likewise: the kernel's work on the daemon's behalf (its system calls)."""
    switches: int
    """Voluntary + involuntary context switches of its main thread."""
    main_s: float
    """utime + stime of its main thread (the event loop's) alone."""


def sample(pid: int) -> Sample:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    status = Path(f"/proc/{pid}/status").read_text()
    switches = sum(int(n) for n in re.findall(r"ctxt_switches:\s+(\d+)", status))
    main = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    main_fields = main[main.rindex(")") + 2:].split()
    main_s = (int(main_fields[11]) + int(main_fields[12])) / TICKS_PER_S
    return Sample(utime / TICKS_PER_S, stime / TICKS_PER_S, switches, main_s)


async def _jobs(daemon: PrivateDaemon, client: AsyncClient, runs: int, pause_s: float) -> None:
    for _ in range(runs):
        if pause_s:
            await asyncio.sleep(pause_s)
        r = await client.run(CODE, daemon.policy)
        if r.status != "ok" or r.result != 2:
            raise BenchError(f"job {r.status}, result {r.result!r}: {r.error}")


@dataclass
class Round:
    user_ms: float
    """The daemon's user CPU per job."""
    system_ms: float
    """Its system CPU per job."""
    switches: float
    """Its main thread's context switches per job."""
    main_ms: float
    """Its main thread's CPU per job (the rest: worker threads')."""


async def _rounds(ends: dict[str, PrivateDaemon], runs: int, rounds: int,
                  pause_s: float) -> dict[str, list[Round]]:
    """``rounds`` rounds of ``runs`` jobs on each daemon of ``ends``. Within a round the
    daemons take turns job by job, in a new shuffled (seeded) order each time, so that
    each sees the same moments of the machine; each daemon's counters are read at the
    round's start and end (what it does between its jobs, such as refilling its pool, is
    in its figure). Keyed as ``ends``."""
    out: dict[str, list[Round]] = {key: [] for key in ends}
    order = random.Random(0)
    async with AsyncExitStack() as stack:
        clients = {key: await stack.enter_async_context(daemon.async_client())
                   for key, daemon in ends.items()}
        for key, daemon in ends.items():  # warm up: imports, caches, the pool
            await _jobs(daemon, clients[key], 20, pause_s)
        turns = list(ends.items())
        for _ in range(rounds):
            before = {key: sample(daemon.pid) for key, daemon in ends.items()}
            for _ in range(runs):
                order.shuffle(turns)
                for key, daemon in turns:
                    await _jobs(daemon, clients[key], 1, pause_s)
            for key, daemon in ends.items():
                start, end = before[key], sample(daemon.pid)
                out[key].append(Round((end.user_s - start.user_s) / runs * 1e3,
                                      (end.system_s - start.system_s) / runs * 1e3,
                                      (end.switches - start.switches) / runs,
                                      (end.main_s - start.main_s) / runs * 1e3))
    return out


_STRACE_LINE = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def strace_round(daemon: PrivateDaemon, runs: int, pause_s: float) -> tuple[float, list[str]]:
    """System calls per job of the daemon under ``strace -f -c``, and the top ones."""
    if shutil.which("strace") is None:
        raise BenchError("strace is not installed")
    with tempfile.NamedTemporaryFile(prefix="jaild-dcpu-strace-", suffix=".txt") as out:
        tracer = subprocess.Popen(["strace", "-f", "-c", "-o", out.name, "-p", str(daemon.pid)],
                                  stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)  # strace prints nothing once attached
            asyncio.run(_traced_jobs(daemon, runs, pause_s))
        finally:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=60)
        text = Path(out.name).read_text()
    calls: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = _STRACE_LINE.match(line)
        if m and m.group(2) != "total":
            calls.append((int(m.group(1)), m.group(2)))
    calls.sort(reverse=True)
    total = sum(n for n, _ in calls)
    return total / runs, [f"{name} {n / runs:.1f}" for n, name in calls[:10]]


def profile_round(daemon: PrivateDaemon, runs: int, pause_s: float, out: Path) -> None:
    """``py-spy record`` of the daemon (``--gil``: only the thread that holds the GIL, so on-CPU
    Python) over ``runs`` jobs, as collapsed stacks into ``out``."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        raise BenchError(f"{spy} is missing: pip install the [bench] extra")
    profiler = subprocess.Popen([str(spy), "record", "--gil", "--rate", "997", "--format",
                                 "raw", "--output", str(out), "--pid", str(daemon.pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        asyncio.run(_traced_jobs(daemon, runs, pause_s))
    finally:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(timeout=60)


async def _traced_jobs(daemon: PrivateDaemon, runs: int, pause_s: float) -> None:
    async with daemon.async_client() as client:
        await _jobs(daemon, client, runs, pause_s)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _range(values: list[float]) -> str:
    return f"{_median(values):.2f} [{min(values):.2f}..{max(values):.2f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=300, help="jobs per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per variant")
    p.add_argument("--base", metavar="REV",
                   help="also a daemon of this git revision, taking turns job by job")
    p.add_argument("--strace", action="store_true", help="also count system calls per job")
    p.add_argument("--only", choices=sorted(VARIANTS), help="one variant only")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="also record a round with py-spy: DIR/<variant>.txt (collapsed stacks)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaild-dcpu-") as tmp:
        tree = Path(tmp) / "base"
        try:
            base = worktree(args.base, tree) if args.base else None
            return _measure(args, base, tree)
        finally:
            if args.base:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tree)], check=False, capture_output=True)


def _measure(args: argparse.Namespace, base: str | None, tree: Path) -> int:
    lines = ["| variant | daemon | daemon CPU per job (ms): median [min..max] | of it user | "
             "of it system | of it the main thread | main-thread context switches per job | "
             "system calls per job (strace) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for key, (variant, pause_s) in VARIANTS.items():
        if args.only and key != args.only:
            continue
        daemons = {"this": PrivateDaemon(variant)}
        if base is not None:
            other = dataclasses.replace(variant, key=f"{variant.key}_base",
                                        env=(("PYTHONPATH", str(tree)),))
            daemons[base] = PrivateDaemon(other, base_entry(tree))
        with ExitStack() as stack:
            ends = {end: stack.enter_context(d) for end, d in daemons.items()}
            rounds = asyncio.run(_rounds(ends, args.runs, args.rounds, pause_s))
            syscalls = dict.fromkeys(ends, "-")
            for end, daemon in ends.items():
                if args.strace:
                    per_job, top = strace_round(daemon, args.runs, pause_s)
                    syscalls[end] = f"{per_job:.0f}"
                    notes.append(f"{key}, {end}: " + ", ".join(top))
                if args.profile:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    profile_round(daemon, args.runs, pause_s, args.profile / f"{key}-{end}.txt")
        for end, got in rounds.items():
            lines.append(f"| {variant.label} | {end} | "
                         f"{_range([r.user_ms + r.system_ms for r in got])} | "
                         f"{_range([r.user_ms for r in got])} | "
                         f"{_range([r.system_ms for r in got])} | "
                         f"{_range([r.main_ms for r in got])} | "
                         f"{_median([r.switches for r in got]):.1f} | {syscalls[end]} |")
    print(f"{args.rounds} rounds of {args.runs} jobs (`{CODE.splitlines()[0]}`) per daemon, "
          "taking turns job by job:\n")
    print("\n".join(lines))
    for note in notes:
        print(f"\ncommonest system calls per job, {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
