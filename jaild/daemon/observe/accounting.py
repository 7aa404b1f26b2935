"""Usage totals the daemon keeps: per policy, per uid and per pod (``jaild stats``).

Every finished job's record carries ``usage`` (see :func:`jaild.daemon.core.records.run_usage`); the
daemon adds each record here as it audits it, so the totals and the audit trail
agree. Totals live in memory for the daemon's life.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from jaild.daemon.core.peer import Principal, PrincipalKind
from jaild.protocol.records import JobRecord, UsageTotals


@dataclass
class Totals:
    jobs: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    memory_peak_bytes: int = 0  # the largest peak of any one job
    pids_peak: int = 0
    output_bytes: int = 0
    tool_calls: int = 0
    tool_time_s: float = 0.0
    files_uploaded: int = 0
    files_downloaded: int = 0
    sessions: int = 0

    def add(self, record: JobRecord, uploaded: int = 0, downloaded: int = 0) -> None:
        self.jobs += 1
        self.statuses[record.status] += 1
        self.files_uploaded += uploaded
        self.files_downloaded += downloaded
        usage = record.usage
        if usage is None:  # no code ran
            return
        self.wall_s += usage.wall_s
        self.cpu_user_s += usage.cpu_user_s or 0.0
        self.cpu_system_s += usage.cpu_system_s or 0.0
        self.memory_peak_bytes = max(self.memory_peak_bytes, usage.memory_peak_bytes or 0)
        self.pids_peak = max(self.pids_peak, usage.pids_peak or 0)
        self.output_bytes += usage.output_bytes
        self.tool_calls += usage.tool_calls
        self.tool_time_s += usage.tool_time_s

    def to_wire(self) -> UsageTotals:
        return UsageTotals(
            jobs=self.jobs,
            statuses=dict(self.statuses),
            wall_s=round(self.wall_s, 3),
            cpu_user_s=round(self.cpu_user_s, 3),
            cpu_system_s=round(self.cpu_system_s, 3),
            memory_peak_bytes=self.memory_peak_bytes,
            pids_peak=self.pids_peak,
            output_bytes=self.output_bytes,
            tool_calls=self.tool_calls,
            tool_time_s=round(self.tool_time_s, 3),
            files_uploaded=self.files_uploaded,
            files_downloaded=self.files_downloaded,
            sessions=self.sessions,
        )


@dataclass
class Accounting:
    by_policy: dict[str, Totals] = field(default_factory=dict)
    by_uid: dict[int, Totals] = field(default_factory=dict)
    by_pod: dict[str, Totals] = field(default_factory=dict)  # "namespace/name"
    by_principal: dict[str, Totals] = field(default_factory=dict)  # network clients'
    since: float = field(default_factory=time.time)

    def _of(self, who: Principal) -> Totals:
        if who.kind is PrincipalKind.POD:
            return self.by_pod.setdefault(f"{who.pod}", Totals())
        if who.kind is PrincipalKind.CERT:
            return self.by_principal.setdefault(who.name, Totals())
        return self.by_uid.setdefault(who.uid, Totals())

    def job(
        self, who: Principal, record: JobRecord, uploaded: int = 0, downloaded: int = 0
    ) -> None:
        policy = record.policy
        self.by_policy.setdefault(policy, Totals()).add(record, uploaded, downloaded)
        self._of(who).add(record, uploaded, downloaded)

    def session(self, who: Principal, policy: str) -> None:
        self.by_policy.setdefault(policy, Totals()).sessions += 1
        self._of(who).sessions += 1

    def to_wire(self, who: Principal | None) -> dict[str, Any]:
        # the start of a DaemonStats: the server adds what runs now, the pools, the metrics
        """Everything for ``who`` None (root on the host); otherwise the policy totals and
        the principal's own: its uid's, its pod's, or its certificate's."""
        pod = who.pod if who is not None else None
        mine = who.name if who is not None and who.kind is PrincipalKind.CERT else None
        return {
            "since": self.since,
            "policies": {name: t.to_wire() for name, t in sorted(self.by_policy.items())},
            "uids": {
                str(u): t.to_wire()
                for u, t in sorted(self.by_uid.items())
                if who is None or (who.kind is PrincipalKind.UID and u == who.uid)
            },
            "pods": {
                name: t.to_wire()
                for name, t in sorted(self.by_pod.items())
                if who is None or name == pod
            },
            "principals": {
                name: t.to_wire()
                for name, t in sorted(self.by_principal.items())
                if who is None or name == mine
            },
        }
