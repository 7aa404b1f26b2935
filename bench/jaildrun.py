"""Private jaild daemons for the bench, and what is measured through them.

Each variant runs in its own ``jaild serve`` subprocess, with a policy directory holding
one policy (``policies/default.toml`` plus the variant's ``[pool]`` section) and a daemon
config that allows the 500-job burst. A variant with ``tls`` also listens on mutual TLS on
loopback (its own throwaway certificates, ``bench/certs.py``): the measurements that take a
``transport`` reach the same daemon over its Unix socket or over TLS.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from baselines import CODE
from certs import Pki, make_pki
from measure import (
    BenchError,
    Deadlines,
    Latency,
    SleepBurst,
    Throughput,
    ToolCalls,
    machine_cpu_s,
    timed,
)
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
TLS_LISTEN = "tls://127.0.0.1:0"
"""A ``tls`` variant's listener: loopback, a port the kernel picks (read back from ``/proc``)."""
Transport = Literal["unix", "tls"]
"""How the bench's client reaches a daemon: its Unix socket, or its mutual-TLS listener."""


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
    tls: bool = False
    """Also listen on mutual TLS (:data:`TLS_LISTEN`), beside the Unix socket."""
    liveness_timeout_s: float | None = None
    """If set, the daemon's ``limits.liveness_timeout_s`` and the bench's clients'
    ``liveness_timeout_s`` (0: off at both ends); None leaves both at their default (30 s)."""
    base: Path = BASE_POLICY
    """The shipped policy the variant's is made from (``policies/data.toml``: numpy, pandas)."""
    keep_pool: bool = False
    """Keep the shipped policy's own ``[pool]`` section (``mode`` None only)."""
    zygote_seccomp: str = "split"
    """The daemon's ``daemon.zygote_seccomp`` (``"whole"``: each jail loads its filters whole)."""
    clone_into_cgroup: bool = True
    """The daemon's ``daemon.clone_into_cgroup`` (False: a forked jail is moved into its cgroup
    after its fork; no effect on cgroup v1)."""

    def daemon_config(self, pki: Pki | None = None) -> str:
        """The daemon's config file: ``config``, with the event loop if it is not the
        default, the TLS listener and its certificates (``pki``, for a ``tls`` variant) and
        the liveness bound if set."""
        daemon = []
        if self.event_loop != "asyncio":  # the default
            daemon.append(f'event_loop = "{self.event_loop}"')
        if self.zygote_seccomp != "split":  # the default
            daemon.append(f'zygote_seccomp = "{self.zygote_seccomp}"')
        if not self.clone_into_cgroup:  # the default is true
            daemon.append("clone_into_cgroup = false")
        tls = ""
        if pki is not None:
            daemon.append(f'listen = ["{TLS_LISTEN}"]')
            tls = (f'\n[tls]\ncert = "{pki.server_cert}"\nkey = "{pki.server_key}"\n'
                   f'client_ca = "{pki.ca}"\n')
        text = self.config
        if self.liveness_timeout_s is not None:
            line = f"liveness_timeout_s = {self.liveness_timeout_s:g}\n"
            text, found = re.subn(r"^\[limits\]\n", lambda m: m.group(0) + line, text,
                                  count=1, flags=re.MULTILINE)
            if not found:
                text += f"\n[limits]\n{line}"
        head = "[daemon]\n" + "".join(f"{d}\n" for d in daemon) + "\n" if daemon else ""
        return head + text + tls

    def policy(self) -> str:
        """The shipped default policy, its own ``[pool]`` section (if any) replaced, 128 tool
        calls in flight."""
        text = self.base.read_text()
        if not (self.keep_pool and self.mode is None):
            text = POOL_SECTION.sub("", text)
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
        self.pki: Pki | None = None
        """A ``tls`` variant's certificates (made at start, in its directory)."""
        self.tls_address = ""
        """A ``tls`` variant's listener, ``tls://127.0.0.1:PORT``, once it serves."""

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def __enter__(self) -> PrivateDaemon:
        policies = self._tmp / "policies"
        policies.mkdir()
        (policies / f"{self.policy}.toml").write_text(self.variant.policy())
        if self.variant.tls:
            self.pki = make_pki(self._tmp / "pki")
        config = self._tmp / "jaild.toml"
        config.write_text(self.variant.daemon_config(self.pki))
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
            if self.variant.tls:
                self.tls_address = self._wait_tls_listener()
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
        """Until the daemon answers Hello and is ready (it answers Hello earlier, during its
        self-tests, saying it is starting), then check that it serves the policy."""
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
        while True:  # it answers Hello while starting: measure only once it is ready
            with Client(self.socket) as c:
                if c.starting is None:
                    policies = c.policies()
                    break
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"jaild was not ready within {timeout_s:.0f} s: "
                                 f"{self.log_tail()}")
            time.sleep(0.05)
        for p in policies:
            if p["name"] == self.policy and p.get("available") is False:
                raise BenchError(f"policy not served: {p.get('problems')}")

    def _wait_tls_listener(self, timeout_s: float = 60) -> str:
        """The TLS listener's address: the daemon's one TCP socket listening on loopback,
        read from ``/proc`` (the daemon logs it only at level info, which the bench's daemons
        are not started with)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ports = _loopback_listeners(self.pid)
            if len(ports) > 1:
                raise BenchError(f"jaild listens on several loopback ports: {ports}")
            if ports:
                return f"tls://127.0.0.1:{ports[0]}"
            if time.monotonic() > deadline:
                raise BenchError(f"jaild's TLS listener did not appear within {timeout_s:.0f} "
                                 f"s: {self.log_tail()}")
            time.sleep(0.05)

    def _connection(self, transport: Transport) -> tuple[str, dict[str, Any]]:
        """Where a client reaches this daemon over ``transport``, and the client's keywords
        for it (certificates, liveness)."""
        options: dict[str, Any] = {}
        if self.variant.liveness_timeout_s is not None:
            options["liveness_timeout_s"] = self.variant.liveness_timeout_s
        if transport == "unix":
            return self.socket, options
        if self.pki is None or not self.tls_address:
            raise BenchError(f"the {self.variant.key} daemon has no TLS listener")
        return self.tls_address, {**options, "cert": self.pki.client_cert,
                                  "key": self.pki.client_key, "ca": self.pki.ca}

    def async_client(self, transport: Transport = "unix") -> AsyncClient:
        """A client of this daemon over ``transport`` (not connected yet)."""
        address, options = self._connection(transport)
        return AsyncClient(address, **options)

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
        latency = alternating_latency({"": (self, "unix")}, runs, pause_s,
                                      self.variant.event_loop)
        return latency[""]

    def throughput(self, concurrency: int, seconds: float) -> Throughput:
        return loops.run(self._throughput(concurrency, seconds), self.variant.event_loop)

    async def _throughput(self, concurrency: int, seconds: float) -> Throughput:
        failures: list[str] = []
        latency: list[float] = []
        async with AsyncClient(self.socket) as c:
            cpu_started = machine_cpu_s()
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
            return Throughput.since(started, concurrency, latency, failures, cpu_started)

    def jail_pages(self, runs: int) -> int:
        """The pages a trivial job's jail has copied (its minor faults: copy-on-write of its
        zygote's memory, mostly) by its code's last line: the median of ``runs`` jobs."""
        code = "import resource\nresource.getrusage(resource.RUSAGE_SELF).ru_minflt"
        faults = []
        with Client(self.socket, event_loop=self.variant.event_loop) as c:
            for _ in range(runs):
                r = c.run(code, self.policy)
                if r.status != "ok" or not isinstance(r.result, int):
                    raise BenchError(f"job {r.status}: {r.error}")
                faults.append(r.result)
        return sorted(faults)[len(faults) // 2]

    def tool_calls(self, calls: int, window: int, transport: Transport = "unix") -> ToolCalls:
        """One job making ``calls`` sequential echo calls, timed inside the jail, then
        ``calls`` more with ``window`` in flight. The handler is async: it runs on the
        client's event loop, with no thread hop."""

        async def echo(value: int) -> int:
            return value

        code = TOOL_CODE.format(calls=calls, window=window)
        address, options = self._connection(transport)
        with Client(address, event_loop=self.variant.event_loop, **options) as c:
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

    def filled(self, pooled: int, timeout_s: float) -> None:
        """Until ``pooled`` jails wait in the pool (or ``timeout_s``: a liveness guard)."""
        deadline = time.monotonic() + timeout_s
        while len(snapshot(self.pid).pooled_jails) < pooled and time.monotonic() < deadline:
            time.sleep(0.2)

    def settled_snapshot(self, pooled: int, timeout_s: float) -> MemorySnapshot:
        """The memory picture once ``pooled`` jails wait (or at ``timeout_s``, as it is)."""
        self.filled(pooled, timeout_s)
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


def alternating_latency(ends: dict[str, tuple[PrivateDaemon, Transport]], runs: int,
                        pause_s: float = 0.0, event_loop: str = "asyncio",
                        warmup: int = 2) -> dict[str, Latency]:
    """Sequential jobs, call to result, with ``AsyncClient`` (what an agent loop uses): one
    client per end (a daemon and the transport to it), all connected at once, taking turns
    job by job -- so that ends compared side by side see the same moments of the machine,
    not one its quiet minute and the other its busy one. Each round goes through the ends in
    a new order (shuffled, seeded): no end always comes first, or always just after a job on
    its own daemon. ``pause_s`` is slept (untimed) before each job; ``warmup`` rounds are not
    timed. Keyed as ``ends``."""
    return loops.run(_alternating(ends, runs, pause_s, warmup), event_loop)


async def _alternating(ends: dict[str, tuple[PrivateDaemon, Transport]], runs: int,
                       pause_s: float, warmup: int) -> dict[str, Latency]:
    samples: dict[str, list[float]] = {key: [] for key in ends}
    order = random.Random(0)
    async with AsyncExitStack() as stack:
        clients = {key: await stack.enter_async_context(daemon.async_client(transport))
                   for key, (daemon, transport) in ends.items()}
        turns = list(clients.items())
        for i in range(warmup + runs):
            order.shuffle(turns)
            for key, c in turns:
                if pause_s:
                    await asyncio.sleep(pause_s)
                started = time.perf_counter()
                _check(await c.run(JAILD_CODE, ends[key][0].policy), 2)
                if i >= warmup:
                    samples[key].append(time.perf_counter() - started)
    return {key: Latency(s) for key, s in samples.items()}


def alternating_tool_calls(daemon: PrivateDaemon, transports: list[Transport], calls: int,
                           window: int) -> dict[Transport, ToolCalls]:
    """:meth:`PrivateDaemon.tool_calls` over each transport in turn, then again in the reverse
    order (A B B A: a drift of the machine over the four jobs weighs on both alike); each
    transport's two jobs together."""
    parts: dict[Transport, list[ToolCalls]] = {t: [] for t in transports}
    for transport in [*transports, *reversed(transports)]:
        parts[transport].append(daemon.tool_calls(calls, window, transport))
    return {t: ToolCalls.combined(p) for t, p in parts.items()}


def _loopback_listeners(pid: int) -> list[int]:
    """The ports of the TCP sockets process ``pid`` holds that listen on 127.0.0.1."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    ports = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()  # sl local_address rem_address st ... uid timeout inode
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes and local.startswith("0100007F:"):  # LISTEN
            ports.append(int(local.split(":")[1], 16))
    return ports


def cores_used(records: list[JobResult]) -> float:
    """The CPU the jobs used together, in cores: their CPU seconds over their mean wall time."""
    cpu = sum(float(r.usage.get("cpu_user_s", 0)) + float(r.usage.get("cpu_system_s", 0))
              for r in records)
    wall = sum(float(r.usage.get("wall_s", 0)) for r in records) / max(1, len(records))
    return cpu / wall if wall else 0.0
