"""Private jaild daemons for the bench, and what is measured through them.

Each variant runs in its own ``jaild serve`` subprocess, with a policy directory holding
one policy (``policies/default.toml`` plus the variant's ``[pool]`` section) and a daemon
config that allows the 500-job burst.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from baselines import CODE
from measure import BenchError, Deadlines, Latency, SleepBurst, Throughput, ToolCalls, timed
from procmem import MemorySnapshot, snapshot

from jaild import loops
from jaild.client import AsyncClient, Client, Job, JobResult
from jaild.errors import Busy, JaildError
from jaild.protocol import PROTOCOL_VERSION, encode, encode_frame
from jaild.protocol.messages import Hello

REPO = Path(__file__).resolve().parent.parent
BASE_POLICY = REPO / "policies" / "default.toml"
POOL_SECTION = re.compile(r"^\[pool\].*\n(?:(?!\[).*(?:\n|$))*", re.MULTILINE)
"""A ``[pool]`` table: its header line and every line up to the next table header."""
JAILD_CODE = f"{CODE}\nresult"  # jaild returns the value of a final expression
SLEEP_CODE = "import time\ntime.sleep(1)\nresult = 1\nresult"
DEADLINE_CODE = "import time\ntime.sleep(60)"
DAEMON_CONFIG = """\
[limits]
max_jobs = 1024
max_jobs_per_connection = 512
memory_overcommit = 16
"""
"""Room for section 5's burst: 500 jobs of the default policy's 256 MiB are 125 GiB of
limits, all root's, whose share is half of ``max_memory_mb`` x ``memory_overcommit``."""
TOOL_CODE = """\
import asyncio, time

sequential = []
for i in range({calls}):
    started = time.perf_counter()
    await tools.echo(i)
    sequential.append(time.perf_counter() - started)

slots = asyncio.Semaphore({window})

async def one(i):
    async with slots:
        return await tools.echo(i)

started = time.perf_counter()
await asyncio.gather(*(one(i) for i in range({calls})))
{{"sequential": sequential, "windowed_s": time.perf_counter() - started}}
"""
FAIRNESS_CONFIG = """\
[daemon]
socket_group = "nogroup"

[limits]
max_jobs = 16
"""
"""The fairness daemon: uid 65534 (group nogroup) may reach its socket; each uid's share
is the derived default, half of ``max_jobs``."""
HELLO = encode_frame(encode(Hello(protocol=PROTOCOL_VERSION, client="bench-wait")), 1 << 16)


@dataclass(frozen=True)
class Variant:
    """One way of making jails; ``mode`` None leaves the ``[pool]`` section out."""

    key: str
    label: str
    mode: str | None
    pool_min: int = 0
    pool_max: int = 0
    config: str = DAEMON_CONFIG
    """The daemon's config file (TOML)."""
    time_limit_s: int = 0
    """If set, the policy's ``wall_time_s`` and ``cpu_time_s``, in place of the shipped ones."""
    event_loop: str = "asyncio"
    """The daemon's ``daemon.event_loop`` and the bench's client loop (:mod:`jaild.loops`)."""
    cpus: str | None = None
    """If set, the daemon (and so its zygotes and jails) runs on these CPUs (``taskset -c``)."""
    env: tuple[tuple[str, str], ...] = ()
    """More of the daemon's environment (``OTEL_*``: the traced variant)."""

    def daemon_config(self) -> str:
        """The daemon's config file, with the event loop if it is not the default."""
        if self.event_loop == "asyncio":  # the default
            return self.config
        return f'[daemon]\nevent_loop = "{self.event_loop}"\n\n{self.config}'

    def policy(self) -> str:
        """The shipped default policy, its own ``[pool]`` section (if any) replaced, 128 tool
        calls in flight."""
        text = POOL_SECTION.sub("", BASE_POLICY.read_text())
        # section 3's windowed calls keep 100 in flight (the shipped default allows 64)
        text = re.sub(r"^tool_calls_in_flight = .*$", "tool_calls_in_flight = 128", text,
                      flags=re.MULTILINE)
        if self.time_limit_s:
            text = re.sub(r"^(wall_time_s|cpu_time_s) = .*$",
                          lambda m: f"{m.group(1)} = {self.time_limit_s}", text,
                          flags=re.MULTILINE)
        if self.mode is None:
            return text
        pool = f'mode = "{self.mode}"\nmin = {self.pool_min}\nmax = {self.pool_max}\n'
        return f"{text}\n[pool]\n{pool}"


def _check(r: JobResult, expected: object) -> None:
    if r.status != "ok" or r.result != expected:
        raise BenchError(f"job {r.status}, result {r.result!r}: {r.error}")


class PrivateDaemon:
    """``jaild serve`` on a private socket, serving one policy named after the variant."""

    def __init__(self, variant: Variant, entry: tuple[str, ...] = ("-m", "jaild")) -> None:
        self.variant = variant
        self.entry = entry
        """How Python starts the daemon (``bench/stages.py`` traces it)."""
        self.policy = variant.key
        self._tmp = Path(tempfile.mkdtemp(prefix=f"jaild-bench-{variant.key}-"))
        os.chmod(self._tmp, 0o755)  # the jailed uid must traverse to the runtime it binds
        self.socket = str(self._tmp / "jaild.sock")
        self._log = self._tmp / "jaild.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def __enter__(self) -> PrivateDaemon:
        policies = self._tmp / "policies"
        policies.mkdir()
        (policies / f"{self.policy}.toml").write_text(self.variant.policy())
        config = self._tmp / "jaild.toml"
        config.write_text(self.variant.daemon_config())
        with self._log.open("wb") as log:
            pinned = ["taskset", "-c", self.variant.cpus] if self.variant.cpus else []
            self._proc = subprocess.Popen(
                [*pinned, sys.executable, *self.entry, "serve", "--socket", self.socket,
                 "--policies", str(policies), "--config", str(config), "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                env={**os.environ, **dict(self.variant.env)},
            )
        try:
            self._wait_serving()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    def log_tail(self, chars: int = 1500) -> str:
        return self._log.read_text(errors="replace")[-chars:].strip()

    def _wait_serving(self, timeout_s: float = 600) -> None:
        """Until the daemon answers Hello (it accepts connections earlier, during its
        self-tests), then check that it serves the policy."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise BenchError(f"jaild exited with {self._proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"jaild did not serve within {timeout_s:.0f} s: {self.log_tail()}")
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.settimeout(max(0.1, deadline - time.monotonic()))
                    s.connect(self.socket)
                    s.sendall(HELLO)
                    if s.recv(4):
                        break
                except OSError:
                    pass
            time.sleep(0.05)
        with Client(self.socket) as c:
            for p in c.policies():
                if p["name"] == self.policy and p.get("available") is False:
                    raise BenchError(f"policy not served: {p.get('problems')}")

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)

    # ------------------------------------------------------------------ measurements

    def latency(self, runs: int, pause_s: float = 0.0, *, blocking: bool = False) -> Latency:
        """Sequential jobs, call to result: with ``AsyncClient`` (what an agent loop uses),
        or with the blocking ``Client``, which adds a hop to its event-loop thread and back."""
        if blocking:
            with Client(self.socket, event_loop=self.variant.event_loop) as c:
                return timed(
                    lambda: _check(c.run(JAILD_CODE, self.policy), 2), runs, pause_s=pause_s
                )
        return loops.run(self._latency(runs, pause_s), self.variant.event_loop)

    async def _latency(self, runs: int, pause_s: float, warmup: int = 2) -> Latency:
        samples = []
        async with AsyncClient(self.socket) as c:
            for i in range(warmup + runs):
                if pause_s:
                    await asyncio.sleep(pause_s)
                started = time.perf_counter()
                _check(await c.run(JAILD_CODE, self.policy), 2)
                if i >= warmup:
                    samples.append(time.perf_counter() - started)
        return Latency(samples)

    def throughput(self, concurrency: int, seconds: float) -> Throughput:
        return loops.run(self._throughput(concurrency, seconds), self.variant.event_loop)

    async def _throughput(self, concurrency: int, seconds: float) -> Throughput:
        failures: list[str] = []
        latency: list[float] = []
        async with AsyncClient(self.socket) as c:
            started = time.perf_counter()
            deadline = started + seconds

            async def worker() -> None:
                while time.perf_counter() < deadline:
                    job_started = time.perf_counter()
                    try:
                        _check(await c.run(JAILD_CODE, self.policy), 2)
                    except (BenchError, JaildError) as exc:
                        failures.append(f"{type(exc).__name__}: {exc}")
                    latency.append(time.perf_counter() - job_started)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return Throughput.since(started, concurrency, latency, failures)

    def tool_calls(self, calls: int, window: int) -> ToolCalls:
        """One job making ``calls`` sequential echo calls, timed inside the jail, then
        ``calls`` more with ``window`` in flight. The handler is async: it runs on the
        client's event loop, with no thread hop."""

        async def echo(value: int) -> int:
            return value

        code = TOOL_CODE.format(calls=calls, window=window)
        with Client(self.socket, event_loop=self.variant.event_loop) as c:
            r = c.run(code, self.policy, tools={"echo": echo})
        if r.status != "ok" or not isinstance(r.result, dict):
            raise BenchError(f"tool-call job {r.status}: {r.error}")
        return ToolCalls(r.result["sequential"], calls, r.result["windowed_s"], window)

    def sleep_burst(self, jobs: int, clients: int) -> SleepBurst:
        return loops.run(self._sleep_burst(jobs, clients), self.variant.event_loop)

    async def _sleep_burst(self, jobs: int, clients: int) -> SleepBurst:
        connections = [AsyncClient(self.socket) for _ in range(clients)]
        for c in connections:
            await c.connect()
        started = time.perf_counter()
        job_s: list[float] = []

        async def one(client: AsyncClient) -> JobResult:
            try:
                return await client.run(SLEEP_CODE, self.policy)
            finally:
                job_s.append(time.perf_counter() - started)

        try:
            results = await asyncio.gather(
                *(one(connections[i % clients]) for i in range(jobs)), return_exceptions=True
            )
            wall_s = time.perf_counter() - started
        finally:
            for c in connections:
                await c.close()
        statuses: dict[str, int] = {}
        first_failure = ""
        for r in results:
            if isinstance(r, BaseException):
                status, failure = type(r).__name__, str(r)
            else:
                status = r.status if r.result == 1 or r.status != "ok" else "wrong result"
                failure = f"{r.status}: {r.error}"
            statuses[status] = statuses.get(status, 0) + 1
            if status != "ok":
                first_failure = first_failure or failure
        return SleepBurst(
            jobs, clients, wall_s, jobs - statuses.get("ok", 0), job_s, statuses, first_failure
        )

    def deadlines(self, runs: int, limit_s: float) -> Deadlines:
        """``runs`` jobs, one after another, that sleep past a ``limit_s`` wall-clock limit."""
        overshoot: list[float] = []
        with Client(self.socket) as client:
            for _ in range(runs):
                r = client.run(DEADLINE_CODE, self.policy, timeout=limit_s)
                if r.status != "timeout" or (r.error or {}).get("limit") != "wall_time_s":
                    raise BenchError(f"job {r.status}, not a wall-clock timeout: {r.error}")
                overshoot.append(float(r.usage["wall_s"]) - limit_s)
        return Deadlines(overshoot, limit_s=limit_s)

    def settled_snapshot(self, pooled: int, timeout_s: float) -> MemorySnapshot:
        """The memory picture once ``pooled`` jails wait (or at ``timeout_s``, as it is)."""
        deadline = time.monotonic() + timeout_s
        while len(snapshot(self.pid).pooled_jails) < pooled and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        return snapshot(self.pid)

    @contextmanager
    def flooded(self, code: str, share: int, settle_s: float) -> Iterator[list[JobResult]]:
        """Root submits jobs running ``code`` until the daemon refuses one ``busy``: that must
        happen at ``share`` held (its per-uid share), else BenchError. The jobs are held,
        ``settle_s`` given to start, for the ``with`` body; then cancelled and waited for. The
        list yielded is empty in the body and holds the jobs' records after it."""
        held: list[Job] = []
        ended: list[JobResult] = []
        with Client(self.socket) as c:
            try:
                for _ in range(share + 1):
                    held.append(c.submit(code, self.policy))
            except Busy as exc:
                if len(held) != share:
                    raise BenchError(f"refused at {len(held)} held, not {share}: {exc}") from exc
            else:
                raise BenchError(f"{share + 1} jobs of one uid were all accepted")
            try:
                time.sleep(settle_s)
                for job in held:
                    if job.done:
                        raise BenchError(f"a flood job ended early: {job.result(1).status}")
                yield ended
            finally:
                for job in held:
                    job.cancel()
                ended += [job.result(300) for job in held]  # a liveness guard (slow hosts)


def cores_used(records: list[JobResult]) -> float:
    """The CPU the jobs used together, in cores: their CPU seconds over their mean wall time."""
    cpu = sum(float(r.usage.get("cpu_user_s", 0)) + float(r.usage.get("cpu_system_s", 0))
              for r in records)
    wall = sum(float(r.usage.get("wall_s", 0)) for r in records) / max(1, len(records))
    return cpu / wall if wall else 0.0
