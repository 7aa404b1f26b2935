"""The records every measurement produces, their statistics, and the timing loops.

All times are seconds. ``p99`` is the nearest-rank percentile: with fewer than 100
samples it is the largest one, which the report states next to each figure (``n``).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class BenchError(Exception):
    """A measurement could not be made; the report shows the message in its place."""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in (0, 100]."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class Latency:
    """Sequential timings of one kind of job, call to result in hand."""

    samples_s: list[float]
    note: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def p99_s(self) -> float:
        return percentile(self.samples_s, 99)


@dataclass
class Throughput:
    """Jobs completed flat out by ``concurrency`` clients in ``seconds``, and how long each
    job took, call to result."""

    concurrency: int
    jobs: int
    failures: int
    seconds: float
    latency_s: list[float]
    first_failure: str = ""
    cpu_s: float | None = None
    """The whole machine's busy CPU over the run (:func:`machine_cpu_s`)."""

    @classmethod
    def since(
        cls, started: float, concurrency: int, latency: list[float], failures: list[str],
        cpu_started: float | None = None,
    ) -> Throughput:
        """The record of a run that began at ``started`` (``time.perf_counter()``), the
        machine's busy CPU then being ``cpu_started`` (:func:`machine_cpu_s`)."""
        return cls(
            concurrency,
            len(latency),
            len(failures),
            time.perf_counter() - started,
            latency,
            failures[0] if failures else "",
            None if cpu_started is None else machine_cpu_s() - cpu_started,
        )

    @property
    def cpu_per_job_s(self) -> float | None:
        """The machine's CPU per finished job over the run: every process and kernel thread,
        the bench's client included."""
        done = self.jobs - self.failures
        return None if self.cpu_s is None or not done else self.cpu_s / done

    @property
    def jobs_per_s(self) -> float:
        return (self.jobs - self.failures) / self.seconds

    @property
    def median_s(self) -> float:
        return statistics.median(self.latency_s)

    @property
    def p99_s(self) -> float:
        return percentile(self.latency_s, 99)


@dataclass
class ToolCalls:
    """Round trips of one echo call: sequential (one at a time) and windowed (many in flight)."""

    sequential_s: list[float]
    windowed_calls: int
    windowed_s: float
    window: int

    @classmethod
    def combined(cls, parts: list[ToolCalls]) -> ToolCalls:
        """Several jobs of the same measurement as one: their sequential calls together, their
        windowed calls and times summed."""
        return cls([s for p in parts for s in p.sequential_s],
                   sum(p.windowed_calls for p in parts), sum(p.windowed_s for p in parts),
                   parts[0].window)

    @property
    def median_s(self) -> float:
        return statistics.median(self.sequential_s)

    @property
    def p99_s(self) -> float:
        return percentile(self.sequential_s, 99)

    @property
    def sequential_per_s(self) -> float:
        return len(self.sequential_s) / sum(self.sequential_s)

    @property
    def windowed_per_s(self) -> float:
        return self.windowed_calls / self.windowed_s


@dataclass
class SleepBurst:
    """Many concurrent jobs that each sleep: all must come back ``ok``. ``job_s``: each job's
    time from the burst's start to its result."""

    jobs: int
    clients: int
    wall_s: float
    failures: int
    job_s: list[float]
    statuses: dict[str, int] = field(default_factory=dict)
    first_failure: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.job_s)

    @property
    def p99_s(self) -> float:
        return percentile(self.job_s, 99)


@dataclass
class Deadlines(Latency):
    """Jobs cut by their wall-clock limit: ``samples_s`` is how far past it each one ended by
    the daemon's own record, ``usage.wall_s`` (from its code's start to the jail's end) minus
    the limit."""

    limit_s: float = 0.0


def timed(fn: Callable[[], object], runs: int, *, warmup: int = 2, pause_s: float = 0.0) -> Latency:
    """Time ``runs`` sequential calls of ``fn`` after ``warmup`` untimed ones.

    ``pause_s`` is slept (untimed) before each call, e.g. so a pool can refill.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        if pause_s:
            time.sleep(pause_s)
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return Latency(samples)


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all CPUs, every process and kernel
    thread): user, nice, system, irq and softirq time of ``/proc/stat``'s ``cpu`` line. Steal
    (a hypervisor's other guests) and idle are not this machine's work."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def flat_out_threads(fn: Callable[[], None], concurrency: int, seconds: float) -> Throughput:
    """``concurrency`` threads call ``fn`` back to back for ``seconds``; jobs in flight at the
    deadline still count, and the clock stops when the last one ends."""
    lock = threading.Lock()
    failures: list[str] = []
    latency: list[float] = []
    cpu_started = machine_cpu_s()
    started = time.perf_counter()
    deadline = started + seconds

    def worker() -> None:
        while time.perf_counter() < deadline:
            job_started = time.perf_counter()
            try:
                fn()
            except Exception as exc:
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}")
            with lock:
                latency.append(time.perf_counter() - job_started)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Throughput.since(started, concurrency, latency, failures, cpu_started)
