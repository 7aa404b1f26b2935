"""How a job ended: its status and error, decided from evidence the jailed code cannot forge.

Theory of operation
-------------------
:func:`classify` is pure: it reads an :class:`Evidence` and returns ``(status, error)``.
The order of its checks is the precedence:

1. the daemon's own kill reason (cancelled, timeout, CPU time of a session's run,
   output limit, jail start failure, channel abuse);
2. nsjail's own report that it could not launch the jail;
3. the job cgroup's OOM evidence;
4. the termination signal (nsjail's log on its private descriptor, or the zygote's
   wait status): SIGXCPU, or SIGKILL with the CPU time at the limit, is a timeout;
   SIGSYS is a policy violation (with the syscall from the kernel's audit record);
   any other signal is ``killed``;
5. only then the runtime's own report (``CodeFinished``), which decides between
   ``ok`` and ``error``. The exit code alone is never trusted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from jaild.protocol.messages import CodeFinished
from jaild.protocol.records import STATUSES

RLIMIT_CPU_REACHED = 0.5
"""A SIGKILL that nothing else explains (not the daemon's, no OOM) is the CPU limit once the
jail's rusage CPU time reaches this share of ``cpu_time_s``. The kernel sends RLIMIT_CPU's
SIGKILL when its *tick-sampled* CPU clock reaches the limit, and on a loaded host that clock
runs well ahead of the precise one rusage reports: under ``stress-ng --cpu 2`` on 2 cores,
processes were killed at 65 % of a 1 s limit and 80 % of a 2 s one (rusage), where an idle
host kills them within a tick of it."""

SOCKET_SYSCALLS = ("socket", "socketpair")
"""Killed only for their address family (:mod:`jaild.policy.seccomp`): the message says so."""

_EXITED = re.compile(r"pid=(\d+) \(\[STANDALONE MODE\]\) exited with status: (\d+)")
_SIGNALED = re.compile(r"pid=(\d+) \(\[STANDALONE MODE\]\) terminated with signal: (\w+) \((\d+)\)")
_LAUNCH_FAILED = ("Couldn't launch the child process", "Launching child process failed")


KillReason = Literal[
    "cancelled", "timeout", "cpu_time", "output_limit", "channel_error", "start_failed"
]
"""Why the daemon killed a jail (the machine's ``Kill``); the first one counts."""


@dataclass
class Evidence:
    kill_reason: KillReason | None = None
    kill_detail: str = ""
    log: str = ""
    jail_ready: bool = False
    oom: bool = False
    cpu_s: float = 0.0
    cpu_limit_s: float = 0.0
    wall_limit_s: float = 0.0
    output_limit: int = 0
    syscall: str | None = None
    claim: CodeFinished | None = None
    nsjail_returncode: int | None = None
    stderr_tail: str = ""
    termination: tuple[str, int, str, int] | None = None  # zygote jails: from the wait status

    @property
    def term(self) -> tuple[str, int, str, int] | None:
        """How the jail ended: the zygote's wait status, else what nsjail logged."""
        return self.termination or parse_termination(self.log)


def parse_termination(log: str) -> tuple[str, int, str, int] | None:
    """From nsjail's log: ("exited", code, "", pid) or ("signaled", signum, NAME, pid)."""
    for line in reversed(log.splitlines()):
        m = _EXITED.search(line)
        if m:
            return ("exited", int(m.group(2)), "", int(m.group(1)))
        m = _SIGNALED.search(line)
        if m:
            return ("signaled", int(m.group(3)), m.group(2), int(m.group(1)))
    return None


def _err(type_: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": type_, "message": message, "traceback": "", "lineno": None, **extra}


def _log_excerpt(log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.startswith(("[E]", "[F]", "[W]"))]
    return "\n".join(lines[-8:]) or "\n".join(log.splitlines()[-8:])


def _claimed(claim: CodeFinished) -> tuple[str, dict[str, Any] | None]:
    """The runtime's own report, once nothing stronger decided."""
    if claim.ok:
        return "ok", None
    err = claim.error
    if err is None:
        return "error", _err("Error", "the code failed without details")
    return "error", {
        "type": err.type,
        "message": err.message,
        "traceback": err.traceback,
        "lineno": err.lineno,
    }


def classify(ev: Evidence) -> tuple[str, dict[str, Any] | None]:
    """(status, error) from the evidence. Pure; the order is the precedence."""
    term = ev.term
    signaled = term is not None and term[0] == "signaled"
    signame = term[2] if signaled and term else ""
    if ev.kill_reason == "cancelled":
        return "cancelled", _err("Cancelled", ev.kill_detail or "the job was cancelled")
    if ev.kill_reason == "timeout":
        return "timeout", _err(
            "Timeout", f"wall-clock limit of {ev.wall_limit_s:g} s exceeded", limit="wall_time_s"
        )
    if ev.kill_reason == "cpu_time":  # a session's run, watched by the daemon
        return "timeout", _err("Timeout", ev.kill_detail, limit="cpu_time_s")
    if ev.kill_reason == "output_limit":
        return "output_limit", _err(
            "OutputLimit",
            f"stdout+stderr exceeded {ev.output_limit} bytes; output truncated there, job stopped",
            limit="output_bytes",
        )
    if ev.kill_reason == "start_failed":
        return "internal_error", _err("JailStartFailed", ev.kill_detail)
    if ev.kill_reason == "channel_error":
        return "error", _err("ChannelError", ev.kill_detail)
    if any(marker in ev.log for marker in _LAUNCH_FAILED):
        return "internal_error", _err(
            "JailStartFailed", "nsjail could not start the jail: " + _log_excerpt(ev.log)
        )
    if ev.oom and (signame == "SIGKILL" or ev.claim is None or not ev.claim.ok):
        return "memory_limit", _err(
            "MemoryLimit", "the job's cgroup memory limit was hit (OOM kill)", limit="memory_mb"
        )
    if signaled and (
        signame == "SIGXCPU"
        or (signame == "SIGKILL" and ev.cpu_s >= ev.cpu_limit_s * RLIMIT_CPU_REACHED)
    ):
        return "timeout", _err(
            "Timeout", f"CPU time limit of {ev.cpu_limit_s:g} s exceeded", limit="cpu_time_s"
        )
    if signame == "SIGSYS":
        what = f"syscall {ev.syscall}" if ev.syscall else "a syscall the policy does not allow"
        if ev.syscall in SOCKET_SYSCALLS:
            what += (
                ": a socket of an address family the policy does not allow (AF_NETLINK, "
                "AF_PACKET, AF_VSOCK, ...; a network's AF_INET and AF_INET6 are never killed: "
                "without a network they fail with PermissionError)"
            )
        return "policy_violation", _err(
            "PolicyViolation",
            f"the seccomp filter killed the process for {what}",
            syscall=ev.syscall,
            signal="SIGSYS",
        )
    if signaled:
        assert term is not None
        return "killed", _err(
            "Killed", f"the process was killed by {signame} ({term[1]})", signal=signame
        )
    if term is None and ev.claim is not None and ev.jail_ready:
        return _claimed(ev.claim)
    if term is None:
        if not ev.jail_ready:
            return "internal_error", _err(
                "JailStartFailed",
                "nsjail could not start the jail: " + (_log_excerpt(ev.log) or "no log output"),
            )
        return "internal_error", _err(
            "JailLost",
            f"nsjail ended without reporting the job (exit {ev.nsjail_returncode})"
            if ev.nsjail_returncode is not None
            else f"the jail's end was not reported: {ev.log or 'no details'}",
        )
    code = term[1]
    if not ev.jail_ready:
        why = ev.stderr_tail.strip().splitlines()[-1:] or [f"exit code {code}"]
        return "internal_error", _err(
            "RuntimeStartFailed", f"the in-jail runtime did not come up: {why[0]}"
        )
    if ev.claim is not None:
        return _claimed(ev.claim)
    return "error", _err(
        "ProcessExit", f"the process exited with code {code} before reporting a result"
    )


def pids_limit_note(
    error_type: str, message: str, pids_peak: int | None, pids_limit: int
) -> str | None:
    """What to add to a run's error when it is how the kernel refuses a process or thread at
    the job's ``limits.pids``, else None. Pure.

    At the limit the kernel refuses ``fork``/``clone`` with EAGAIN, which Python shows as a
    bare ``BlockingIOError: [Errno 11] Resource temporarily unavailable`` (``os.fork``,
    ``subprocess``, ``multiprocessing``) or ``RuntimeError: can't start new thread``. Either
    is taken for the limit's only when the job's pids cgroup peaked at the limit
    (``pids_peak``, the kernel's counter; None where the kernel has none: then no note) --
    a BlockingIOError of a non-blocking read, in a job that stayed under its limit, gets none.
    """
    refused = error_type == "BlockingIOError" or (
        error_type == "RuntimeError" and "can't start new thread" in message
    )
    if not refused or pids_peak is None or pids_peak < pids_limit:
        return None
    return (
        f"the job reached its process limit, limits.pids = {pids_limit} processes and threads "
        "together: there the kernel refuses a new process or thread with EAGAIN. Start fewer, "
        "e.g. a pool with fewer workers, or use a policy with a higher limits.pids"
    )


__all__ = [
    "RLIMIT_CPU_REACHED",
    "STATUSES",
    "Evidence",
    "classify",
    "parse_termination",
    "pids_limit_note",
]
