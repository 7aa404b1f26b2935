"""The audit trail: one structured record per job and per refused request.

Every record goes to the daemon's log (stderr, hence journald under systemd) as
one ``audit: key=value ...`` line, and -- when the config names a file -- is
appended to it as one JSON object per line. The file is opened ``O_APPEND``
and created ``0640``.

Theory of operation: bounded, and nothing lost
----------------------------------------------
Whoever is refused decides how often: a local user the allow-list refuses can
connect in a loop, and a jail can call an unknown tool in a loop. So those two
kinds of record are rate-limited, and what is not written individually is counted
and written as one summary record -- the totals are exact, only the detail is cut:

* ``refused`` (connections and requests), per uid: the first
  :data:`REFUSALS_PER_WINDOW` in each :data:`REFUSAL_WINDOW_S`-second window are
  written; the rest are counted by code, and one ``refused_summary`` record
  (``uid``, ``audited``, ``suppressed: {code: n}``) is written once the uid's window
  is over (at the next refusal of any uid, or when the daemon stops).
* ``tool_call`` records of calls the broker refused (:data:`~jaild.daemon.core.broker.REFUSALS`),
  per job: the first :data:`REFUSED_CALLS_PER_JOB` are written; at the job's end a
  ``tool_calls_refused`` record gives the total per error type (``refused``), how many
  were written (``audited``) and how many were only counted (``suppressed``). Every
  call counts against the job's ``limits.tool_calls`` too, and the job record's
  ``tool_calls`` is every call the job made, refused ones included.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaild.daemon.core.broker import REFUSALS
from jaild.daemon.core.peer import Peer, PrincipalKind, Tenant
from jaild.protocol.records import JobRecord

log = logging.getLogger("jaild.daemon.observe.audit")

EGRESS_FIELDS = (
    "policy", "method", "host", "port", "status", "bytes_out", "bytes_in", "intercepted",
    "refused", "error",
)
"""What an ``egress`` record holds of a request's summary (nothing else can reach it)."""


def _show(v: Any) -> str:
    if isinstance(v, str) and v and all(c.isalnum() or c in "-_.:/@" for c in v):
        return v
    return json.dumps(v, separators=(",", ":"), default=str)


REFUSALS_PER_WINDOW = 20
"""Refusals of one uid written individually per window; the rest are summarised."""
REFUSAL_WINDOW_S = 60.0
REFUSED_CALLS_PER_JOB = 20
"""Refused tool calls of one job written individually; the rest are summarised."""
_JOBS_TRACKED = 4096  # jobs with refused calls whose end has not been audited yet


@dataclass
class _Window:
    """One uid's refusals in its current window."""

    start: float
    written: int = 0
    suppressed: Counter[str] = field(default_factory=Counter)


def _flow(record: JobRecord) -> dict[str, Any]:
    """A job's information flow, for its audit event: label names and what they closed
    (never a value)."""
    flow = record.flow
    assert flow is not None
    out: dict[str, Any] = {"labels": list(flow.labels)}
    if flow.refusals:
        out["flow_refused"] = [f"{r.sink}:{r.code}:{r.label}:{r.target}" for r in flow.refusals]
    if flow.withheld:
        out["withheld"] = list(flow.withheld)
    return out


def _who(peer: Peer | None) -> dict[str, Any]:
    """Whose record: the client's uid, and its pod where pods are the tenants."""
    if peer is None:
        return {"uid": None}
    who = peer.principal
    if who.kind is PrincipalKind.CERT:
        return {"uid": None, "principal": who.name, "address": peer.address}
    if who.kind is not PrincipalKind.POD:
        return {"uid": peer.uid}
    return {
        "uid": peer.uid, "pod": who.pod, "pod_uid": who.pod_uid,
        "service_account": who.service_account,
    }


@dataclass
class _CallRefusals:
    """One job's refused tool calls so far."""

    uid: int | None
    written: int = 0
    totals: Counter[str] = field(default_factory=Counter)


class AuditLog:
    """The audit trail (see the module docstring). ``clock``: monotonic seconds."""

    def __init__(
        self, path: str | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._windows: dict[Tenant, _Window] = {}  # by principal
        self._calls: dict[str, _CallRefusals] = {}
        self._fd = -1
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "event": event, **fields}
        if log.isEnabledFor(logging.INFO):
            text = " ".join(f"{k}={_show(v)}" for k, v in record.items() if k != "ts")
            log.info("audit: %s", text)
        if self._fd >= 0:
            try:
                os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())
            except OSError as exc:
                log.error("cannot write the audit file: %s", exc)

    def job(self, peer: Peer, record: JobRecord) -> None:
        """A job ended (however it ended): its refused calls' summary, then its record."""
        error, usage = record.error, record.usage
        self._calls_summary(record.job_id)
        self._emit(
            "job",
            {
                "job": record.job_id,
                **_who(peer),
                "pid": peer.pid,
                "policy": record.policy,
                "status": record.status,
                "duration_s": record.duration_s,
                "tool_calls": len(record.tool_calls) + record.tool_calls_omitted,
                "tools": dict(Counter(c.name for c in record.tool_calls)),
                **(
                    {
                        "cpu_user_s": usage.cpu_user_s,
                        "cpu_system_s": usage.cpu_system_s,
                        "memory_peak_bytes": usage.memory_peak_bytes,
                        "tool_time_s": usage.tool_time_s,
                    }
                    if usage is not None
                    else {}
                ),
                **({"session": record.session.id} if record.session else {}),
                **({"network_refused": record.network_refused} if record.network_refused else {}),
                **(_flow(record) if record.flow is not None else {}),
                "reason": f"{error.type}: {error.message[:200]}" if error else "",
            },
        )

    def session(self, peer: Peer, event: str, session_id: str, policy: str, **extra: Any) -> None:
        """A session opened or closed (``reason``: closed, idle, lifetime, killed, a status)."""
        self._emit(
            f"session_{event}",
            {"session": session_id, **_who(peer), "pid": peer.pid, "policy": policy, **extra},
        )

    def tool_call(
        self, peer: Peer | None, job_id: str, tool: str, outcome: str, duration_s: float
    ) -> None:
        """A tool call ended (``outcome``: ok, or why not). Refused calls past
        :data:`REFUSED_CALLS_PER_JOB` are only counted, for the job's summary."""
        if outcome in REFUSALS:
            seen = self._calls.get(job_id)
            if seen is None:
                if len(self._calls) >= _JOBS_TRACKED:  # jobs whose end was never audited
                    self._calls_summary(next(iter(self._calls)))
                seen = self._calls[job_id] = _CallRefusals(peer.uid if peer else None)
            seen.totals[outcome] += 1
            if seen.written >= REFUSED_CALLS_PER_JOB:
                return
            seen.written += 1
        self._emit(
            "tool_call",
            {
                "job": job_id,
                **_who(peer),
                "tool": tool,
                "outcome": outcome,
                "duration_s": round(duration_s, 6),
            },
        )

    def egress(self, peer: Peer | None, job_id: str, summary: dict[str, Any]) -> None:
        """One request (or tunnel) through a job's egress gateway: host, port, method,
        status, bytes each way, why refused -- never a header or a header's value (a
        run's records past its quota are only counted, in its record)."""
        self._emit(
            "egress",
            {
                "job": job_id,
                **_who(peer),
                **{k: summary[k] for k in EGRESS_FIELDS if k in summary},
            },
        )

    def killed(self, peer: Peer, ident: str) -> None:
        """``jaild kill`` ended a job or session."""
        self._emit("kill", {"id": ident, **_who(peer), "pid": peer.pid})

    def connection_lost(self, peer: Peer, why: str) -> None:
        """A client was given up on: silent past ``limits.liveness_timeout_s``."""
        self._emit("connection_lost", {**_who(peer), "pid": peer.pid, "reason": why})

    def _calls_summary(self, job_id: str) -> None:
        seen = self._calls.pop(job_id, None)
        if seen is None or seen.written == sum(seen.totals.values()):
            return  # every refused call of the job has its own record
        self._emit(
            "tool_calls_refused",
            {
                "job": job_id,
                "uid": seen.uid,
                "refused": dict(seen.totals),
                "audited": seen.written,
                "suppressed": sum(seen.totals.values()) - seen.written,
            },
        )

    def refused(self, peer: Peer, code: str, message: str, **extra: Any) -> bool:
        """A request (or a connection) was refused. False if the record was only counted
        (the uid is past :data:`REFUSALS_PER_WINDOW` in this window)."""
        now = self._clock()
        for uid in [u for u, w in self._windows.items() if now - w.start >= REFUSAL_WINDOW_S]:
            self._refusals_summary(uid)  # that uid's window is over
        key = peer.principal.key
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(now)
        if window.written >= REFUSALS_PER_WINDOW:
            window.suppressed[code] += 1
            return False
        window.written += 1
        self._emit(
            "refused",
            {**_who(peer), "pid": peer.pid, "code": code, "message": message[:500], **extra},
        )
        return True

    def _refusals_summary(self, uid: Tenant) -> None:
        window = self._windows.pop(uid, None)
        if window is None or not window.suppressed:
            return
        self._emit(
            "refused_summary",
            {
                **({"uid": uid} if isinstance(uid, int) else {"pod_uid": uid[len("pod-"):]}),
                "window_s": round(self._clock() - window.start, 3),
                "audited": window.written,
                "suppressed": dict(window.suppressed),
            },
        )

    def flush(self) -> None:
        """Write every pending summary (the daemon stops)."""
        for uid in list(self._windows):
            self._refusals_summary(uid)
        for job_id in list(self._calls):
            self._calls_summary(job_id)

    def close(self) -> None:
        self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
