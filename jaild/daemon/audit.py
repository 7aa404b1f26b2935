"""The audit trail: one structured record per job and per refused request.

Every record goes to the daemon's log (stderr, hence journald under systemd) as
one ``audit: key=value ...`` line, and -- when the config names a file -- is
appended to it as one JSON object per line. The file is opened ``O_APPEND``
and created ``0640``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from jaild.protocol.records import JobRecord

log = logging.getLogger("jaild.daemon.audit")


def _show(v: Any) -> str:
    if isinstance(v, str) and v and all(c.isalnum() or c in "-_.:/@" for c in v):
        return v
    return json.dumps(v, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (from SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"uid={self.uid} pid={self.pid}"


class AuditLog:
    def __init__(self, path: str | None = None) -> None:
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
        """A job ended (however it ended)."""
        error, usage = record.error, record.usage
        self._emit(
            "job",
            {
                "job": record.job_id,
                "uid": peer.uid,
                "pid": peer.pid,
                "policy": record.policy,
                "status": record.status,
                "duration_s": record.duration_s,
                "tool_calls": len(record.tool_calls),
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
                "reason": f"{error.type}: {error.message[:200]}" if error else "",
            },
        )

    def session(self, peer: Peer, event: str, session_id: str, policy: str, **extra: Any) -> None:
        """A session opened or closed (``reason``: closed, idle, lifetime, killed, a status)."""
        self._emit(
            f"session_{event}",
            {"session": session_id, "uid": peer.uid, "pid": peer.pid, "policy": policy, **extra},
        )

    def tool_call(
        self, peer: Peer | None, job_id: str, tool: str, outcome: str, duration_s: float
    ) -> None:
        """A tool call ended (``outcome``: ok, or why not)."""
        self._emit(
            "tool_call",
            {
                "job": job_id,
                "uid": peer.uid if peer else None,
                "tool": tool,
                "outcome": outcome,
                "duration_s": round(duration_s, 6),
            },
        )

    def killed(self, peer: Peer, ident: str) -> None:
        """``jaild kill`` ended a job or session."""
        self._emit("kill", {"id": ident, "uid": peer.uid, "pid": peer.pid})

    def refused(self, peer: Peer, code: str, message: str, **extra: Any) -> None:
        """A request (or a connection) was refused."""
        self._emit(
            "refused",
            {"uid": peer.uid, "pid": peer.pid, "code": code, "message": message[:500], **extra},
        )

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
