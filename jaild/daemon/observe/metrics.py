"""Daemon metrics: Prometheus series, and the plain summary ``jaild stats`` shows.

Theory of operation
-------------------
The daemon calls the hooks of one :class:`Metrics` as it works (a job audited, a request
refused, a tool call ended, the number of open sessions changed). Each hook updates
prometheus-client metrics in a registry of this instance's own -- never the process-wide
default one, so several instances (unit tests) never share or clash. Pool sizes are not
pushed: the ``pools`` callable given to :meth:`Metrics.start` is read when the registry is
collected (a scrape, or :meth:`Metrics.summary`); so are durable runs and their journals
(the callable given to :meth:`Metrics.approvals`). Tool calls are the one hook on a hot path
(a job may make thousands, each a round trip the jail waits for): :meth:`Metrics.tool_call`
only notes a call, and the noted calls are counted in batches of :data:`TOOL_CALL_BATCH`,
and before anyone reads a registry (its first collector flushes them), so what a scrape or
``jaild stats`` shows is never behind. In a batch, each call's labelled series come from a
cache (labelling a series takes longer than counting in it).

When ``daemon.metrics_address`` is set, :meth:`Metrics.start` binds that TCP address at
once (a bad or busy address raises :class:`MetricsAddressError` there, so the daemon
refuses to start) and serves ``GET /metrics`` from a small HTTP/1.1 server on the daemon's
own event loop (a reader on the listening socket; ``loop.sock_recv``/``sock_sendall`` per
connection). Serving on the loop, not from prometheus-client's threaded WSGI server, means
a scrape reads the daemon's state -- the pools above -- on the one thread that changes it,
and no thread ever runs beside the jails' launcher. The body is prometheus-client's own
exposition (text or OpenMetrics by ``Accept``, gzip by ``Accept-Encoding``). One request
per connection; the request head is bounded (16 KiB), so are its time (10 s) and the
connections at once (32); a failing ``accept`` (EMFILE) pauses accepting for a second.
The connections are tasks of one task group, held for the endpoint's life by a task
:meth:`Metrics.start` makes. :meth:`Metrics.stop` removes the reader and closes the
listening socket at once (it is synchronous: a port freed by a stopped daemon is free when
``stop`` returns) and cancels that task: its group cancels the open connections and waits
for them (:meth:`Metrics.wait_closed` waits for that).

Label cardinality: ``policy`` comes from the daemon's policy files, ``status`` and
``code`` from jaild's own fixed sets. Tool names and tool-call outcomes come from clients
(and an unknown tool's name from the jailed code itself), so they are bounded: the first
:data:`MAX_TOOLS_PER_POLICY` distinct tool names of a policy get their own label value,
later ones are counted as ``(other)``; a call of a tool the client did not offer is counted
as tool ``(unknown)`` (its name is untrusted and takes no slot); outcomes are bounded the
same way (:data:`MAX_OUTCOMES_PER_POLICY`). Label values are cut to
:data:`MAX_LABEL_CHARS`. Uids are never labels (the audit log and ``jaild stats`` have them).

Who sees tool names: a tool's name is its owner's (the client that offered it), and ``jaild
stats`` shows tool names to root only. Whoever reaches the endpoint sees what it exposes, so
by default it exposes tool calls per policy and outcome only (``jaild_tool_calls{policy,
outcome}``, ``jaild_tool_call_duration_seconds{policy}``); the per-tool series (label
``tool``, same names) are kept in a second, private registry, which only :meth:`Metrics.
summary` reads -- for root's ``jaild stats``. With ``daemon.metrics_tool_labels = true``
(``tool_labels``) the per-tool series are exposed instead of the per-policy ones.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import logging
import math
import platform
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from jaild.errors import MetricsAddressError
from jaild.protocol.records import JobRecord
from jaild.version import __version__

log = logging.getLogger("jaild.daemon.observe.metrics")

#: Latency buckets (seconds): 1 ms .. 60 s, about three per decade.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    math.inf,
)
MAX_TOOLS_PER_POLICY = 32  # distinct tool label values per policy; later names -> OTHER
MAX_OUTCOMES_PER_POLICY = 16  # distinct outcome label values per policy; later -> OTHER
MAX_LABEL_CHARS = 64
OTHER = "(other)"  # parentheses: no tool name (a Python identifier) can collide
UNKNOWN_TOOL = "(unknown)"
QUANTILES = (0.5, 0.95, 0.99)
TOOL_CALL_BATCH = 256  # tool calls noted before the series are updated (Metrics.tool_call)
_SERIES_CACHED = 4096  # (policy, tool, outcome) -> labelled children, then start afresh

MAX_REQUEST_HEAD_BYTES = 16384
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32

PoolsReader = Callable[[], dict[str, dict[str, Any]]]


def parse_address(text: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[v6addr]:port"`` for IPv6).

    Args:
        text: the configured address, e.g. ``"127.0.0.1:9464"``.
    Returns:
        ``(host, port)``.
    Raises:
        MetricsAddressError: not of that form, no host, or a port outside 0..65535 (0: one
            the kernel picks, logged when serving).
    """
    shape = (
        f'daemon.metrics_address: {text!r} is not "host:port" (e.g. "127.0.0.1:9464"; '
        f'"[::1]:9464" for IPv6; "0.0.0.0:9464" for every interface)'
    )
    text = text.strip()
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise MetricsAddressError(shape)
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon or ":" in host:
            raise MetricsAddressError(shape)
    if not host or not port_text.isdigit():
        raise MetricsAddressError(shape)
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise MetricsAddressError(
            f"daemon.metrics_address: port {port} of {text!r} is outside 0..65535"
        )
    return host, port


def _bind(text: str) -> socket.socket:
    """A listening, non-blocking TCP socket on the configured address."""
    host, port = parse_address(text)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise MetricsAddressError(
            f"daemon.metrics_address: cannot resolve host {host!r} of {text!r}: {exc.strerror}"
        ) from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)  # not inheritable: no jail gets it
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not a listener's port
        sock.bind(sockaddr)
        sock.listen(64)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            why = (
                f"port {port} on {host} is already in use (`ss -ltnp 'sport = :{port}'` shows "
                "by whom); stop that program or choose another daemon.metrics_address"
            )
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = f"no interface of this host has the address {host}"
        else:
            why = exc.strerror or str(exc)
        raise MetricsAddressError(
            f"daemon.metrics_address: cannot listen on {text!r}: {why}"
        ) from None
    return sock


class _BoundedLabel:
    """The first ``limit`` distinct values per key keep their name; later ones are OTHER."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: dict[str, set[str]] = {}

    def __call__(self, key: str, value: str) -> str:
        value = value[:MAX_LABEL_CHARS]
        seen = self._seen.setdefault(key, set())
        if value in seen:
            return value
        if len(seen) < self.limit:
            seen.add(value)
            return value
        return OTHER


class _NotedCalls(Collector):
    """Registered first: a collection of the registry flushes the tool calls noted so far
    (:meth:`Metrics.tool_call`) into their series before they are read. Exposes nothing."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        self._flush()
        return iter(())


class _PoolCollector(Collector):
    """Pool gauges and counters, read from the daemon's pool summaries at collection."""

    COUNTERS = (
        ("hits", "jaild_pool_hits", "Jobs that took a ready jail from the pool."),
        ("misses", "jaild_pool_misses", "Jobs that found the pool empty and waited for a jail."),
        ("made", "jaild_pool_jails_made", "Jails the pool started."),
        ("failed", "jaild_pool_jails_failed", "Jails the pool failed to start."),
        ("recycled", "jaild_pool_jails_recycled", "Pool jails discarded unused and replaced."),
    )

    def __init__(self) -> None:
        self.read: PoolsReader | None = None

    def pools(self) -> dict[str, dict[str, Any]]:
        if self.read is None:
            return {}
        try:
            return self.read()
        except Exception:  # a scrape must not take the daemon down, nor fail whole
            log.exception("metrics: reading the pool summaries failed")
            return {}

    def collect(self) -> Iterable[Metric]:
        pools = self.pools()
        ready = GaugeMetricFamily(
            "jaild_pool_ready_jails", "Warm jails ready in the policy's pool.", labels=["policy"]
        )
        target = GaugeMetricFamily(
            "jaild_pool_target_jails",
            "How many ready jails the policy's pool aims to keep.",
            labels=["policy"],
        )
        counters = [
            (key, CounterMetricFamily(name, text, labels=["policy"]))
            for key, name, text in self.COUNTERS
        ]
        for policy, summary in sorted(pools.items()):
            ready.add_metric([policy], float(summary.get("ready") or 0))
            target.add_metric([policy], float(summary.get("target") or 0))
            for key, family in counters:
                if isinstance(summary.get(key), (int, float)):
                    family.add_metric([policy], float(summary[key]))
        yield ready
        yield target
        for _, family in counters:
            yield family


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: linear within the bucket holding rank ``q``.

    ``buckets``: (upper bound, cumulative count), ascending, the last one +Inf.
    """
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # above the largest finite bucket: its bound, as Prometheus
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


class Metrics:
    """What the daemon reports as it works; exported over HTTP for Prometheus when asked.

    Args:
        address: ``"host:port"`` to serve ``/metrics`` on from :meth:`start`; None: no server.
        tool_labels: expose tool calls per tool (label ``tool``); else per policy only (the
            per-tool series are kept for :meth:`summary`). See the module docstring.
    """

    def __init__(self, address: str | None = None, *, tool_labels: bool = False) -> None:
        self.address = address or None
        self.tool_labels = tool_labels
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        per_tool = r if tool_labels else CollectorRegistry(auto_describe=True)
        self._pending_calls: list[tuple[str, str, str, float]] = []
        self._series: dict[tuple[str, str, str], tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
        for registry in {id(r): r, id(per_tool): per_tool}.values():
            # first in each registry: whoever collects it reads the calls noted so far
            registry.register(_NotedCalls(self.flush_tool_calls))
        self._jobs = Counter(
            "jaild_jobs", "Jobs finished, by policy and status.", ["policy", "status"], registry=r
        )
        self._duration = Histogram(
            "jaild_job_duration_seconds",
            "Whole-job latency, request to record (record duration_s).",
            ["policy"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._wall = Histogram(
            "jaild_job_wall_seconds",
            "Wall time of the job's code in the jail (usage.wall_s).",
            ["policy"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self._cpu = Counter(
            "jaild_job_cpu_seconds",
            "CPU time jobs used in their jails (cgroup), by policy and mode (user, system).",
            ["policy", "mode"],
            registry=r,
        )
        self._tool_calls = Counter(
            "jaild_tool_calls",
            f"Host tool calls, by policy, tool and outcome (tool names past the first "
            f"{MAX_TOOLS_PER_POLICY} of a policy are {OTHER}).",
            ["policy", "tool", "outcome"],
            registry=per_tool,
        )
        self._tool_latency = Histogram(
            "jaild_tool_call_duration_seconds",
            "Host tool call latency, by policy and tool.",
            ["policy", "tool"],
            buckets=LATENCY_BUCKETS_S,
            registry=per_tool,
        )
        self._policy_tool_calls: Counter | None = None
        self._policy_tool_latency: Histogram | None = None
        if not tool_labels:
            self._policy_tool_calls = Counter(
                "jaild_tool_calls",
                "Host tool calls, by policy and outcome (per tool: daemon.metrics_tool_labels).",
                ["policy", "outcome"],
                registry=r,
            )
            self._policy_tool_latency = Histogram(
                "jaild_tool_call_duration_seconds",
                "Host tool call latency, by policy (per tool: daemon.metrics_tool_labels).",
                ["policy"],
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            )
        self._refused = Counter(
            "jaild_refused_requests",
            "Requests and connections refused, by error code.",
            ["code"],
            registry=r,
        )
        self._tls_refused = Counter(
            "jaild_tls_refused_connections",
            "Network connections refused before the protocol began, by reason (no_certificate, "
            "unknown_ca, expired, not_yet_valid, protocol_version, not_tls, handshake_timeout, "
            "handshake_failed, principal, ca_removed, out_of_scope).",
            ["reason"],
            registry=r,
        )
        self._connections_lost = Counter(
            "jaild_connections_lost",
            "Client connections the daemon gave up on: nothing read from them within "
            "limits.liveness_timeout_s.",
            registry=r,
        )
        self._egress_requests = Counter(
            "jaild_egress_requests",
            "Requests and tunnels through egress gateways, by policy and outcome (ok, error, "
            "or why refused: not_allowed, private_address, quota, ...).",
            ["policy", "outcome"],
            registry=r,
        )
        self._egress_bytes = Counter(
            "jaild_egress_bytes",
            "Bytes through egress gateways, by policy and direction (out: towards hosts).",
            ["policy", "direction"],
            registry=r,
        )
        self._sessions = Gauge("jaild_sessions_open", "Sessions open now.", registry=r)
        self._durable_runs = Gauge(
            "jaild_durable_runs",
            "Runs under a policy with [approvals] park_after_s now, live or parked.",
            registry=r,
        )
        self._parked_runs = Gauge(
            "jaild_parked_runs", "Runs parked for approval now (waiting on disk).", registry=r
        )
        self._journal_bytes = Gauge(
            "jaild_approval_journal_bytes",
            "Bytes the durable runs' journals hold on disk now (every principal's).",
            registry=r,
        )
        self._start_time = Gauge(
            "jaild_start_time_seconds", "When the daemon started (Unix time).", registry=r
        )
        Info("jaild_build", "jaild's version and Python.", registry=r).info(
            {"version": __version__, "python": platform.python_version()}
        )
        self._pools = _PoolCollector()
        r.register(self._pools)
        ProcessCollector(registry=r)  # process_*: CPU, memory, open descriptors of the daemon
        self._tool_label = _BoundedLabel(MAX_TOOLS_PER_POLICY)
        self._outcome_label = _BoundedLabel(MAX_OUTCOMES_PER_POLICY)
        self._started = time.time()
        self._start_time.set(self._started)
        self._endpoint: _Endpoint | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def listening(self) -> tuple[str, int] | None:
        """The address the endpoint listens on, or None."""
        return self._endpoint.listening if self._endpoint is not None else None

    def start(self, pools: PoolsReader) -> None:
        """Begin serving (if an address was given). ``pools``: policy -> pool summary.

        Args:
            pools: returns each served policy's pool summary (``ready``, ``target``, and
                the pool's counters); called on the event loop at every collection.
        Raises:
            MetricsAddressError: the address is unparseable, unresolvable or cannot be
                bound (in use, not this host's); the message says which and what to do.
            RuntimeError: an address was given and no event loop is running.
        """
        self._pools.read = pools
        self._started = time.time()
        self._start_time.set(self._started)
        if self.address is None or self.listening is not None:
            return
        loop = asyncio.get_running_loop()
        self._endpoint = _Endpoint(loop, self.registry, _bind(self.address))
        bound = self._endpoint.listening
        assert bound is not None  # it was just bound
        host, port = bound[:2]
        shown = f"[{host}]" if ":" in host else host
        log.info("serving Prometheus metrics on http://%s:%d/metrics", shown, port)  # port 0:
        # the one the kernel chose

    def stop(self) -> None:
        """Stop serving: the listening socket is closed now; open connections are cancelled
        (each closes as its task ends, within a few turns of the loop: :meth:`wait_closed`)."""
        if self._endpoint is not None:
            self._endpoint.close()
        self._pools.read = None

    async def wait_closed(self) -> None:
        """After :meth:`stop`: wait until every connection has ended and is closed."""
        if self._endpoint is not None:
            await self._endpoint.wait_closed()

    # ------------------------------------------------------------------ hooks

    def job_finished(self, record: JobRecord, uid: int) -> None:
        """A job's record, as audited (``uid`` is not a label: see the module docstring)."""
        policy = record.policy
        self._jobs.labels(policy, record.status).inc()
        self._duration.labels(policy).observe(record.duration_s)
        usage = record.usage
        if usage is None:  # no code ran
            return
        self._wall.labels(policy).observe(usage.wall_s)
        for mode, seconds in (("user", usage.cpu_user_s), ("system", usage.cpu_system_s)):
            if seconds:
                self._cpu.labels(policy, mode).inc(seconds)

    def refused(self, code: str) -> None:
        """A request or connection was refused with this error code."""
        self._refused.labels(code[:MAX_LABEL_CHARS]).inc()

    def tls_refused(self, reason: str) -> None:
        """A network connection was refused before the protocol began (its TLS handshake,
        or its certificate's principal)."""
        self._tls_refused.labels(reason[:MAX_LABEL_CHARS]).inc()

    def connection_lost(self) -> None:
        """A silent client was given up on (liveness)."""
        self._connections_lost.inc()

    def tool_call(self, policy: str, tool: str, outcome: str, duration_s: float) -> None:
        """A tool call ended: ``outcome`` is ok, error, invalid_arguments, denied, timeout, ...

        Only noted here (a tool call's round trip is the hot path): the series are updated
        in batches of :data:`TOOL_CALL_BATCH`, at every job's end, and before any reading
        (:meth:`summary`, a scrape) -- see :meth:`flush_tool_calls`."""
        pending = self._pending_calls
        pending.append((policy, tool, outcome, duration_s))
        if len(pending) >= TOOL_CALL_BATCH:
            self.flush_tool_calls()

    def flush_tool_calls(self) -> None:
        """Count the tool calls noted since the last flush."""
        pending, self._pending_calls = self._pending_calls, []
        for policy, tool, outcome, duration_s in pending:
            calls, latency = self._call_series(policy, tool, outcome)
            for counter in calls:
                counter.inc()
            for histogram in latency:
                histogram.observe(max(0.0, duration_s))

    def _call_series(
        self, policy: str, tool: str, outcome: str
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The labelled children a call of ``tool`` ending ``outcome`` counts in: its
        labels are bounded once per distinct call (see the module docstring)."""
        if outcome == "unknown_tool":  # a name the jail made up: it takes no slot
            tool = UNKNOWN_TOOL
        key = (policy, tool, outcome)
        series = self._series.get(key)
        if series is not None:
            return series
        name = tool if tool == UNKNOWN_TOOL else self._tool_label(policy, tool)
        label = self._outcome_label(policy, outcome)
        calls: tuple[Any, ...] = (self._tool_calls.labels(policy, name, label),)
        latency: tuple[Any, ...] = (self._tool_latency.labels(policy, name),)
        if self._policy_tool_calls is not None and self._policy_tool_latency is not None:
            calls += (self._policy_tool_calls.labels(policy, label),)
            latency += (self._policy_tool_latency.labels(policy),)
        if len(self._series) >= _SERIES_CACHED:
            self._series.clear()
        self._series[key] = series = (calls, latency)
        return series

    def egress(self, policy: str, summary: dict[str, Any]) -> None:
        """A request through an egress gateway ended (its summary, as audited)."""
        outcome = summary.get("refused") or ("error" if "error" in summary else "ok")
        self._egress_requests.labels(policy, outcome).inc()
        for direction in ("out", "in"):
            n = summary.get(f"bytes_{direction}", 0)
            if n:
                self._egress_bytes.labels(policy, direction).inc(n)

    def sessions_open(self, count: int) -> None:
        """How many sessions are open now."""
        self._sessions.set(count)

    def approvals(self, usage: Callable[[], tuple[int, int, int]]) -> None:
        """Read ``usage()`` -- (durable runs, of which parked, their journals' bytes) -- when
        the registry is collected."""
        self._durable_runs.set_function(lambda: usage()[0])
        self._parked_runs.set_function(lambda: usage()[1])
        self._journal_bytes.set_function(lambda: usage()[2])

    # ------------------------------------------------------------------ summary

    def summary(self) -> dict[str, Any]:
        """For ``jaild stats``: what the metrics hold, as plain values.

        Returns:
            ``jobs`` {policy: {status: n}}; ``latency`` {policy: {"duration_s"|"wall_s":
            {count, sum_s, p50_s, p95_s, p99_s}}} (quantiles estimated from the histogram
            buckets, as Prometheus's ``histogram_quantile``; None when empty);
            ``cpu_s`` {policy: {user, system}}; ``tool_calls`` {policy: {tool: {outcome:
            n}}}; ``tool_latency`` {policy: {tool: {...as latency}}}; ``refused`` {code: n};
            ``sessions_open``; ``durable_runs``, ``parked_runs``, ``approval_journal_bytes``;
            ``pools`` {policy: {ready, target}}; ``started`` (Unix time);
            ``endpoint`` ("http://host:port/metrics" or None).
        """
        self.flush_tool_calls()
        samples = list(self._samples())
        jobs: dict[str, dict[str, int]] = {}
        cpu: dict[str, dict[str, float]] = {}
        tools: dict[str, dict[str, dict[str, int]]] = {}
        refused: dict[str, int] = {}
        sessions = 0
        gauges = {"jaild_durable_runs": 0, "jaild_parked_runs": 0,
                  "jaild_approval_journal_bytes": 0}
        for name, labels, value in samples:
            if name == "jaild_jobs_total":
                jobs.setdefault(labels["policy"], {})[labels["status"]] = int(value)
            elif name == "jaild_job_cpu_seconds_total":
                cpu.setdefault(labels["policy"], {})[labels["mode"]] = round(value, 6)
            elif name == "jaild_tool_calls_total":
                by_tool = tools.setdefault(labels["policy"], {})
                by_tool.setdefault(labels["tool"], {})[labels["outcome"]] = int(value)
            elif name == "jaild_refused_requests_total":
                refused[labels["code"]] = int(value)
            elif name == "jaild_sessions_open":
                sessions = int(value)
            elif name in gauges:
                gauges[name] = int(value)
        latency: dict[str, dict[str, dict[str, Any]]] = {}
        for key, family in (("duration_s", "jaild_job_duration_seconds"),
                            ("wall_s", "jaild_job_wall_seconds")):
            for (policy,), hist in _histograms(samples, family, ("policy",)).items():
                latency.setdefault(policy, {})[key] = hist
        tool_latency: dict[str, dict[str, dict[str, Any]]] = {}
        for (policy, tool), hist in _histograms(
            samples, "jaild_tool_call_duration_seconds", ("policy", "tool")
        ).items():
            tool_latency.setdefault(policy, {})[tool] = hist
        return {
            "jobs": _sorted(jobs),
            "latency": _sorted(latency),
            "cpu_s": _sorted(cpu),
            "tool_calls": _sorted(tools),
            "tool_latency": _sorted(tool_latency),
            "refused": _sorted(refused),
            "sessions_open": sessions,
            "durable_runs": gauges["jaild_durable_runs"],
            "parked_runs": gauges["jaild_parked_runs"],
            "approval_journal_bytes": gauges["jaild_approval_journal_bytes"],
            "pools": {
                name: {"ready": p.get("ready", 0), "target": p.get("target", 0)}
                for name, p in sorted(self._pools.pools().items())
            },
            "started": self._started,
            "endpoint": f"http://{self.address}/metrics" if self.listening else None,
        }

    def _samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        for metric in (self._jobs, self._cpu, self._tool_calls, self._refused, self._sessions,
                       self._durable_runs, self._parked_runs, self._journal_bytes,
                       self._duration, self._wall, self._tool_latency):
            for family in metric.collect():
                for s in family.samples:
                    yield s.name, s.labels, s.value


class _Endpoint:
    """``GET /metrics`` over HTTP/1.1 on the daemon's loop, from a bound socket (see the
    module docstring). Its connections are tasks of one task group, held by the task the
    endpoint starts with; :meth:`close` cancels that task, and so every connection."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, registry: CollectorRegistry, sock: socket.socket
    ) -> None:
        self._registry = registry
        self._sock: socket.socket | None = sock
        self._loop = loop
        self._resume: asyncio.TimerHandle | None = None
        self._connections: asyncio.TaskGroup | None = None
        self._open_connections = 0
        self._serving = self._loop.create_task(self._serve(sock), name="metrics endpoint")

    @property
    def listening(self) -> tuple[str, int] | None:
        if self._sock is None or self._sock.fileno() < 0:
            return None
        name = self._sock.getsockname()
        return str(name[0]), int(name[1])

    async def _serve(self, sock: socket.socket) -> None:
        """The endpoint's scope, until :meth:`close` cancels it: every connection is a task
        of its group, which cancels them and waits for them as it ends."""
        async with asyncio.TaskGroup() as connections:
            self._connections = connections
            self._loop.add_reader(sock.fileno(), self._accept)
            try:
                await self._loop.create_future()  # close() cancels this
            finally:
                self._connections = None

    def close(self) -> None:
        """Close the listening socket now; cancel the open connections."""
        if self._sock is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            if self._resume is not None:
                self._resume.cancel()
            self._sock.close()
        if not self._loop.is_closed():
            self._serving.cancel()  # its group cancels the connections; each closes its own
        self._sock = self._resume = None

    async def wait_closed(self) -> None:
        """After :meth:`close`: wait until every connection has ended and is closed."""
        await asyncio.wait([self._serving])

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: pause rather than spin
                log.warning("metrics: accepting a connection failed (%s); pausing 1 s", exc)
                self._loop.remove_reader(self._sock.fileno())
                self._resume = self._loop.call_later(1.0, self._resume_accepting)
                return
            if self._connections is None or self._open_connections >= MAX_CONNECTIONS:
                conn.close()
                continue
            conn.setblocking(False)
            self._open_connections += 1
            self._connections.create_task(self._serve_connection(conn))

    def _resume_accepting(self) -> None:
        self._resume = None
        if self._sock is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    async def _serve_connection(self, conn: socket.socket) -> None:
        """One request, one response, then close (HTTP/1.1 with ``Connection: close``)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = b""
                while b"\r\n\r\n" not in head:
                    if len(head) > MAX_REQUEST_HEAD_BYTES:
                        await loop.sock_sendall(conn, _response(
                            "431 Request Header Fields Too Large", _TEXT, b"request too large\n"
                        ))
                        return
                    data = await loop.sock_recv(conn, 4096)
                    if not data:
                        return
                    head += data
                status, headers, body = self._respond(head)
                if head.startswith(b"HEAD "):
                    headers = {**headers, "Content-Length": str(len(body))}
                    body = b""
                await loop.sock_sendall(conn, _response(status, headers, body))
        except (OSError, TimeoutError):
            pass  # the scraper went away or was too slow: just close
        except Exception:
            log.exception("metrics: answering a scrape failed")
        finally:
            conn.close()
            self._open_connections -= 1

    def _respond(self, head: bytes) -> tuple[str, dict[str, str], bytes]:
        """Status, headers and body for one request head."""
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "400 Bad Request", _TEXT, b"bad request\n"
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", {**_TEXT, "Allow": "GET, HEAD"}, b"GET /metrics\n"
        if target.split("?", 1)[0] != "/metrics":
            return "404 Not Found", _TEXT, b"jaild serves its metrics at /metrics\n"
        headers: dict[str, str] = {}
        for line in header_lines:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self._registry)
        out = {"Content-Type": content_type}
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            out["Content-Encoding"] = "gzip"
        return "200 OK", out, body


_TEXT = {"Content-Type": "text/plain; charset=utf-8"}


def _response(status: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items())]
    if "Content-Length" not in headers:
        lines.append(f"Content-Length: {len(body)}")
    lines += ["Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def _histograms(
    samples: list[tuple[str, dict[str, str], float]], family: str, keys: tuple[str, ...]
) -> dict[tuple[str, ...], dict[str, Any]]:
    """The histograms of ``family`` by label values: count, sum and QUANTILES."""
    buckets: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    sums: dict[tuple[str, ...], float] = {}
    for name, labels, value in samples:
        if name == family + "_bucket":
            buckets.setdefault(tuple(labels[k] for k in keys), []).append(
                (float(labels["le"]), value)
            )
        elif name == family + "_sum":
            sums[tuple(labels[k] for k in keys)] = value
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for key, series in buckets.items():
        series.sort()
        count = int(series[-1][1]) if series else 0
        hist: dict[str, Any] = {"count": count, "sum_s": round(sums.get(key, 0.0), 6)}
        for q in QUANTILES:
            estimate = _quantile(q, series)
            hist[f"p{round(q * 100)}_s"] = None if estimate is None else round(estimate, 6)
        out[key] = hist
    return out


def _sorted(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _sorted(v) if isinstance(v, dict) else v for k, v in sorted(d.items())}


__all__ = [
    "LATENCY_BUCKETS_S",
    "MAX_TOOLS_PER_POLICY",
    "TOOL_CALL_BATCH",
    "Metrics",
    "MetricsAddressError",
    "parse_address",
]
