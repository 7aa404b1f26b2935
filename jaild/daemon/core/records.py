"""The one place the daemon builds result records. Pure: explicit values in, structs out.

Every :class:`~jaild.protocol.records.JobRecord` the daemon sends is made here -- a run's
(:func:`job_record`) or one that failed inside jaild (:func:`internal_error_record`) --
from values its caller measured.
Nothing here does IO or reads a clock: the job reads its cgroup and its timers and passes
the numbers in, so every rule of the record's shape (rounding, what a field holds when
nothing ran, how long a message may be) is here once, and testable without root.

Text that comes from elsewhere (an nsjail log, an exception's message, the jail's output)
is made fit for the wire on the way in (:func:`~jaild.protocol.messages.safe_text`): a record
never fails to build because a message was too long or held a lone surrogate.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from jaild.daemon.core.classify import pids_limit_note
from jaild.policy.flow import Delivery, Disposition, FlowRules
from jaild.policy.schema import Limits, Policy
from jaild.protocol.fields import JOB_ID
from jaild.protocol.messages import safe_text
from jaild.protocol.records import (
    MAX_CALL_RECORDS,
    MAX_EGRESS_HOSTS,
    MAX_OUTPUT_CHARS,
    MAX_RECORD_FILES,
    MAX_SKIPPED_FILES,
    STATUSES,
    EgressRecord,
    FileEntry,
    FlowRecord,
    JobError,
    JobRecord,
    SessionRun,
    SkippedFile,
    ToolCallEntry,
    Usage,
)

INTERNAL_MESSAGE_CHARS = 4096
"""An exception inside jaild is reported with at most this much of its message."""
PRECISION = 6
"""Seconds in a record are rounded to microseconds."""


@functools.lru_cache(maxsize=1024)
def _limit_fields(limits: Limits) -> dict[str, float]:
    """A ``Limits`` as a map, once per distinct value (``dataclasses.asdict`` costs ~10 us
    a record; nearly every job has its policy's limits). Only ever copied, never changed."""
    return dataclasses.asdict(limits)


def limits_map(policy: Policy, limits: Limits) -> dict[str, float | str]:
    """The ``limits`` of a record: the job's limits plus the policy's network mode and /tmp.
    Checked as the record's field (once per distinct value); a fresh map each call."""
    return dict(_checked_limits(limits, policy.network.mode, policy.filesystem.tmp_mb))


_LIMITS_CHECK = dict(JobRecord._checks)["limits"]


@functools.lru_cache(maxsize=1024)
def _checked_limits(limits: Limits, network: str, tmp_mb: int) -> dict[str, float | str]:
    """:func:`limits_map`'s value, its check (``JobRecord.limits``'s) run once per distinct
    value: a record built with it (:meth:`~jaild.protocol.fields.Struct.trusted`) need not
    run it again. Only ever copied, never changed."""
    checked: dict[str, float | str] = _LIMITS_CHECK(
        "limits", {**_limit_fields(limits), "network": network, "tmp_mb": tmp_mb})
    return checked


def job_error(
    type_: str,
    message: str,
    *,
    traceback: str = "",
    lineno: int | None = None,
    signal: str | None = None,
    syscall: str | None = None,
    limit: str | None = None,
) -> JobError:
    """A record's ``error``; ``message`` and ``traceback`` are cut to fit (the tail is kept)."""
    return JobError(
        type=safe_text(type_, 256) or "Error",
        message=safe_text(message),
        traceback=safe_text(traceback),
        lineno=lineno if lineno is None or 0 <= lineno <= 1 << 31 else None,
        signal=safe_text(signal, 32) if signal else None,
        syscall=safe_text(syscall, 64) if syscall else None,
        limit=limit,
    )


def job_error_of(error: JobError | Mapping[str, Any] | None) -> JobError | None:
    """A record's ``error`` from the ``(status, error)`` of the job's classification, which
    may give it as a map with :class:`JobError`'s field names."""
    if error is None or isinstance(error, JobError):
        return error
    return job_error(
        str(error["type"]),
        str(error["message"]),
        traceback=str(error.get("traceback") or ""),
        lineno=error.get("lineno"),
        signal=error.get("signal"),
        syscall=error.get("syscall"),
        limit=error.get("limit"),
    )


def tool_call(
    name: str, duration_s: float, ok: bool, error_type: str | None = None
) -> ToolCallEntry:
    """One entry of a record's ``tool_calls``."""
    return ToolCallEntry(
        name=name, duration_s=round(max(0.0, duration_s), PRECISION), ok=ok, error_type=error_type
    )


def _seconds(value: float) -> float:
    return round(max(0.0, value), PRECISION)


def run_usage(
    *,
    code_started: float | None,
    code_ended: float,
    cpu_base: tuple[float, float] | None,
    cpu_end: tuple[float, float] | None,
    memory_peak_bytes: int | None,
    pids_peak: int | None,
    output_bytes: int,
    tool_calls: int,
    tool_time_s: float,
    stream_paused_s: float,
    stream_dropped_bytes: int,
) -> Usage:
    """A run's ``usage``.

    Args:
        code_started, code_ended: the monotonic clock at ``RunCode`` and at the code's end
            (``code_started`` None: the code never started; wall time 0).
        cpu_base, cpu_end: the cgroup's (user, system) CPU seconds at those two moments
            (None where the host has no CPU accounting; then the CPU times are nil).
        memory_peak_bytes, pids_peak: the cgroup's peaks (None: no cgroup).
        output_bytes, tool_calls, tool_time_s, stream_paused_s, stream_dropped_bytes: the
            run's counters.
    """
    user = system = None
    if cpu_base is not None and cpu_end is not None:
        user = _seconds(cpu_end[0] - cpu_base[0])
        system = _seconds(cpu_end[1] - cpu_base[1])
    return Usage(
        wall_s=_seconds(code_ended - code_started) if code_started else 0.0,
        cpu_user_s=user,
        cpu_system_s=system,
        memory_peak_bytes=memory_peak_bytes,
        pids_peak=pids_peak,
        output_bytes=output_bytes,
        tool_calls=tool_calls,
        tool_time_s=_seconds(tool_time_s),
        stream_paused_s=_seconds(stream_paused_s),
        stream_dropped_bytes=stream_dropped_bytes,
    )


def job_record(
    *,
    job_id: str,
    policy: Policy,
    limits: Limits,
    status: str,
    error: JobError | Mapping[str, Any] | None,
    stdout: bytes | bytearray,
    stderr: bytes | bytearray,
    tool_calls: Iterable[ToolCallEntry | Mapping[str, Any]],
    tool_calls_omitted: int,
    duration_s: float,
    usage: Usage,
    files: Iterable[Mapping[str, Any]] = (),
    files_skipped: Iterable[Mapping[str, Any]] = (),
    egress: Mapping[str, Any] | None = None,
    network_refused: int | None = None,
    flow: Mapping[str, Any] | None = None,
) -> JobRecord:
    """The record of a run that reached its jail.

    ``tool_calls`` beyond :data:`MAX_CALL_RECORDS` are counted in ``tool_calls_omitted``;
    ``files`` and ``files_skipped`` are the daemon's checked listing
    (:func:`jaild.runtime.files.validate_collected`); ``network_refused`` is the runtime's
    count (``CodeFinished.network_refused``), None when it did not report.
    """
    calls = [c if isinstance(c, ToolCallEntry) else tool_call(**c) for c in tool_calls]
    omitted = tool_calls_omitted + max(0, len(calls) - MAX_CALL_RECORDS)
    job_err = job_error_of(error)
    if job_err is not None and status == "error":
        job_err = _with_pids_note(job_err, usage.pids_peak, limits.pids)
    listed = tuple(FileEntry(path=f["path"], size=f["size"], sha256=f["sha256"]) for f in files)
    skipped = tuple(SkippedFile(path=s["path"], reason=s["reason"]) for s in files_skipped)
    # Built unchecked (Struct.trusted) from what is checked already -- its parts are structs
    # built checked (usage, error, calls, files, egress, flow), the limits map was checked
    # once for its value, the output is decoded with "replace" (no lone surrogate), the
    # duration is a _seconds() of the monotonic clock, network_refused the jail's checked
    # count -- once the rest is seen to be as the checks want it; else built checked.
    trusted = (type(usage) is Usage and type(status) is str and status in STATUSES
               and _ids(job_id, policy.name)
               and type(tool_calls_omitted) is int and tool_calls_omitted >= 0
               and len(stdout) + len(stderr) <= MAX_OUTPUT_CHARS
               and len(listed) <= MAX_RECORD_FILES and len(skipped) <= MAX_SKIPPED_FILES)
    return (JobRecord.trusted if trusted else JobRecord)(
        job_id=job_id,
        policy=policy.name,
        status=status,
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        error=job_err,
        tool_calls=tuple(calls[:MAX_CALL_RECORDS]),
        duration_s=_seconds(duration_s),
        limits=limits_map(policy, limits),
        usage=usage,
        files=listed,
        files_skipped=skipped,
        tool_calls_omitted=omitted,
        session=None,
        egress=egress_record(egress) if egress is not None else None,
        network_refused=network_refused,
        flow=None if flow is None else FlowRecord.from_wire(dict(flow)),
    )


_JOB_ID = re.compile(JOB_ID)


def _ids(job_id: str, policy: str) -> bool:
    """A record's ``job_id`` and ``policy`` as its checks want them (the daemon's own job
    id; the name of a policy it loaded)."""
    return (type(job_id) is str and len(job_id) <= 64 and _JOB_ID.fullmatch(job_id) is not None
            and type(policy) is str and 1 <= len(policy) <= 64 and policy.isascii())


def _with_pids_note(error: JobError, pids_peak: int | None, pids_limit: int) -> JobError:
    """``error`` with a word on the process limit when it is the kernel refusing a process or
    thread there (:func:`jaild.daemon.core.classify.pids_limit_note`): added to the message and,
    as Python shows an exception's notes, under the traceback."""
    note = pids_limit_note(error.type, error.message, pids_peak, pids_limit)
    if note is None:
        return error
    traceback = error.traceback.rstrip("\n") + "\n" + note + "\n" if error.traceback else ""
    return dataclasses.replace(
        error,
        message=safe_text(f"{error.message} ({note})"),
        traceback=safe_text(traceback),
    )


def egress_record(usage: Mapping[str, Any]) -> EgressRecord:
    """A run's egress usage (``EgressUsage.to_wire()`` of its door) as its record's part."""
    return EgressRecord(
        requests=usage["requests"],
        bytes_out=usage["bytes_out"],
        bytes_in=usage["bytes_in"],
        hosts=tuple(sorted(usage["hosts"])[:MAX_EGRESS_HOSTS]),
        refused=dict(usage["refused"]),
    )


def _not_run(
    job_id: str, policy: Policy, limits: Limits, status: str, error: JobError
) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        policy=policy.name,
        status=status,
        stdout="",
        stderr="",
        error=error,
        tool_calls=(),
        duration_s=0.0,
        limits=limits_map(policy, limits),
        usage=None,
        files=(),
        files_skipped=(),
        tool_calls_omitted=0,
        session=None,
    )


def internal_error_record(
    job_id: str, policy: Policy, limits: Limits, exc: BaseException
) -> JobRecord:
    """The record of a job that failed inside jaild (a bug): reported, never silent."""
    error = job_error("InternalError", str(exc)[:INTERNAL_MESSAGE_CHARS])
    return _not_run(job_id, policy, limits, "internal_error", error)


def with_session(
    record: JobRecord, session_id: str, run: int | None, closed: str | None
) -> JobRecord:
    """``record`` as a run of session ``session_id`` (``run``: its number, None if nothing
    ran; ``closed``: the status that ended the session, None if it goes on)."""
    return dataclasses.replace(record, session=SessionRun(id=session_id, run=run, closed=closed))


# -- what a run's labels decide at its end (docs/using/flow.md)

WITHHELD_ERROR = "(withheld: the job holds a label whose rule withholds its output)"


@dataclasses.dataclass(frozen=True)
class FlowEnd:
    """What the information-flow rules decide at a run's end, for its caller: the record's
    ``flow`` (None: no label held and nothing refused), what is withheld, and what is to be
    redacted (off the event loop, by the driver) because it is not withheld."""

    record: dict[str, Any] | None
    withheld: frozenset[str] = frozenset()
    redact: tuple[str, ...] = ()


def flow_sinks(rules: FlowRules, labels: frozenset[str], released: frozenset[str],
               exhausted: bool, how: Disposition = Disposition.WITHHOLD) -> dict[str, str]:
    """What ``labels`` withhold (``how = "redact"``: redact) from a caller whose
    ``[[flow.sink]] release_to`` spares ``released``: result, output, downloads, each with
    the label that says so. Once the jail's redaction is ``exhausted`` (its broker kept too
    many values to redact), what they redact is withheld instead."""

    def sinks(how: Disposition) -> dict[str, str]:
        if not labels or not rules.sinks:
            return {}
        return rules.withheld(labels, lambda label: label in released, how)

    out = sinks(how)
    if exhausted:
        if how is Disposition.REDACT:
            return {}
        if how is Disposition.WITHHOLD:
            out = {**sinks(Disposition.REDACT), **out}
    return out


def flow_at_end(rules: FlowRules, labels: frozenset[str], released: frozenset[str], *,
                exhausted: bool, refusals: Iterable[Any], snapshot: bool) -> FlowEnd:
    """The end-of-run decision (see :class:`FlowEnd`). A snapshot's result is the session's
    state: it stays in the daemon, so no rule withholds or redacts it."""
    refused = list(refusals)
    if not labels and not refused:
        return FlowEnd(None)
    withheld = sorted(flow_sinks(rules, labels, released, exhausted))
    redacted = sorted(flow_sinks(rules, labels, released, exhausted, Disposition.REDACT))
    if snapshot:
        withheld = [w for w in withheld if w != Delivery.RESULT]
        redacted = [r for r in redacted if r != Delivery.RESULT]
    flow: dict[str, Any] = {"labels": sorted(labels), "refusals": refused,
                            "withheld": withheld, "redacted": redacted}
    if exhausted and flow_sinks(rules, labels, released, False, Disposition.REDACT):
        flow["redaction"] = "exhausted"
    return FlowEnd(flow, frozenset(withheld), tuple(r for r in redacted if r not in withheld))


def withheld_error(error: dict[str, Any] | None,
                   withheld: frozenset[str]) -> dict[str, Any] | None:
    """A run's error as its caller may see it: its message and traceback are output too, so
    they go when the output or the result is withheld."""
    if error is not None and (Delivery.OUTPUT in withheld or Delivery.RESULT in withheld):
        return {**error, "message": WITHHELD_ERROR, "traceback": ""}
    return error


__all__ = [
    "WITHHELD_ERROR",
    "FlowEnd",
    "flow_at_end",
    "flow_sinks",
    "internal_error_record",
    "job_error",
    "job_error_of",
    "job_record",
    "limits_map",
    "run_usage",
    "tool_call",
    "with_session",
    "withheld_error",
]
