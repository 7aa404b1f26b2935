"""What a fresh jail costs in CPU, for the whole machine, and where that CPU goes.

1. **CPU per job** of a flat-out run (:func:`measure.machine_cpu_s`, read around each run of section
   2): every process's and kernel thread's busy time from ``/proc/stat`` -- user, nice,
   system, irq, softirq; not idle, iowait or steal -- divided by the jobs the run finished.
   The bench's own client is in it (its threads or coroutines are part of any design).
2. **Where it goes** (:func:`breakdown`): ``perf record -a`` over one flat-out run, each
   sample put to who ran -- the daemon (all its threads), a zygote, a jail (a process the
   zygote forked, or any below it: found from the recording's fork events), nsjail, the
   jailed python of bare nsjail, the bench's client, a kernel thread -- and to user or kernel
   mode (the sampled instruction's address). Times are samples / frequency / jobs.

``perf`` is the kernel's profiler (Debian: ``apt-get install linux-perf``); without it the
breakdown is reported missing, saying so, and the rest of the run goes on.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from measure import BenchError, Throughput

PERF_START_S = 1.0
"""How long ``perf record`` is given to start before the run (it prints nothing when it is)."""
PERF_HZ = 997
"""Samples per second per CPU: a prime, so sampling does not beat with the jobs' rhythm."""
KERNEL_SPACE = 0xFFFF800000000000
"""Addresses at or above this are the kernel's (x86-64 and arm64, 48-bit)."""
_FORK = re.compile(r"PERF_RECORD_FORK\((\d+):\d+\):\((\d+):\d+\)")
KERNEL_THREADS = ("kworker", "ksoftirqd", "rcu", "migration", "kthreadd", "khugepaged",
                  "kcompactd", "kswapd", "cpuhp", "idle_inject")


@dataclass
class Breakdown:
    """One flat-out run's CPU by who ran it: category -> (user s, kernel s)."""

    jobs: int
    seconds: float
    cpus: int
    where: dict[str, tuple[float, float]] = field(default_factory=dict)

    def per_job_ms(self, category: str) -> tuple[float, float]:
        user, kernel = self.where.get(category, (0.0, 0.0))
        return user / self.jobs * 1e3, kernel / self.jobs * 1e3

    @property
    def busy_per_job_ms(self) -> float:
        return sum(u + k for u, k in self.where.values()) / self.jobs * 1e3


def perf_missing() -> str | None:
    """Why :func:`breakdown` cannot run here, or None."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian: apt-get install linux-perf)"
    return None


def breakdown(
    run: Callable[[], Throughput],
    roles: Callable[[], dict[int, str]],
    client_pid: int,
) -> tuple[Throughput, Breakdown]:
    """Record the whole machine with ``perf`` while ``run()`` goes flat out, then put each
    sample to its role. ``roles()`` (called while the run's processes are up,
    after it) names the long-lived processes by pid: ``daemon``, ``zygote``, ``nsjail``...;
    whatever a ``zygote`` forks, and below, is ``jail``; a ``python3`` not named otherwise
    (bare nsjail's jailed interpreter) is ``jailed python``."""
    why = perf_missing()
    if why:
        raise BenchError(why)
    with tempfile.TemporaryDirectory(prefix="jaild-bench-perf-") as tmp:
        data = os.path.join(tmp, "perf.data")
        perf = subprocess.Popen(
            ["perf", "record", "-a", "-F", str(PERF_HZ), "-o", data],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            time.sleep(PERF_START_S)  # it records from here (the lead-in is idle, or others')
            result = run()
            named = roles()
        finally:
            perf.send_signal(signal.SIGINT)
            _, err = perf.communicate(timeout=120)
        if perf.returncode not in (0, -signal.SIGINT):
            raise BenchError(f"perf record failed: {err.decode(errors='replace')[-300:]}")
        script = subprocess.run(
            ["perf", "script", "-i", data, "--show-task-events", "-F", "pid,tid,comm,ip"],
            capture_output=True, text=True, check=False,
        )
    if script.returncode != 0:
        raise BenchError(f"perf script failed: {script.stderr[-300:]}")
    where = _attribute(script.stdout, named, client_pid)
    cpus = os.cpu_count() or 1
    return result, Breakdown(result.jobs - result.failures, result.seconds, cpus, where)


def _attribute(
    script: str, named: dict[int, str], client_pid: int
) -> dict[str, tuple[float, float]]:
    parent: dict[int, int] = {}
    samples: collections.Counter[tuple[int, str, bool]] = collections.Counter()
    for line in script.splitlines():
        fork = _FORK.search(line)
        if fork:
            child, ppid = int(fork.group(1)), int(fork.group(2))
            if child != ppid:
                parent[child] = ppid
            continue
        if "PERF_RECORD" in line:
            continue
        parts = line.split()
        if len(parts) < 3:
            continue
        try:
            pid = int(parts[-2].split("/")[0])
            ip = int(parts[-1], 16)
        except ValueError:
            continue
        comm = " ".join(parts[:-2])
        samples[(pid, comm, ip >= KERNEL_SPACE)] += 1

    def role(pid: int, comm: str) -> str:
        if pid == 0:
            return "idle"
        if pid == client_pid:
            return "client (the bench)"
        seen = pid
        for _ in range(64):  # up the fork tree to a process with a name
            if seen in named:
                name = named[seen]
                return "jail" if name == "zygote" and seen != pid else name
            if seen not in parent:
                break
            seen = parent[seen]
        if comm.startswith(KERNEL_THREADS):
            return "kernel threads"
        if comm.startswith("nsjail"):
            return "nsjail"
        if comm.startswith("python3"):
            return "jailed python"
        return "other"

    where: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for (pid, comm, kernel), n in samples.items():
        where[role(pid, comm)][kernel] += n / PERF_HZ
    where.pop("idle", None)
    return {k: (v[0], v[1]) for k, v in where.items()}


def zygote_pids(daemon_pid: int) -> list[int]:
    """The daemon's zygotes: the processes nsjail started for it whose parent is an nsjail
    the daemon started (each zygote runs in an nsjail of its own)."""
    children = _children()
    out = []
    for nsjail in children.get(daemon_pid, []):
        out += children.get(nsjail, [])
    return out


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree[ppid].append(int(entry))
    return tree


BREAKDOWN_ROWS = ("client (the bench)", "daemon", "zygote", "jail", "nsjail", "jailed python",
                  "kernel threads", "other")
"""The breakdown table's rows, in order."""
