"""What a record may say once a sink is closed: one decision per field. Pure.

Theory of operation
-------------------
A job whose labels withhold (or redact) its result or output from a caller must not hand
that caller the same data through the rest of its record. Every field of every record the
daemon sends -- to the client, and through the client to the MCP server's or code mode's
model; to the audit log, traces and metrics -- has a value that someone *chose*:

- the **daemon** (ids, the policy, limits, the status it classified, its own error words),
- the **kernel** (what the cgroup measured),
- the **client** or the **operator** (tool names it declared, labels, what its tools
  answered),
- or the **jail** (its output, its exception's type and line, which host it asked for, how
  many requests it made, how large the files it left are).

Each field of :data:`RECORD` (the :class:`~jaild.protocol.records.JobRecord`, its nested
structs), :data:`SNAPSHOT` (a snapshot's entry), :data:`JOB_ENTRY` (a ``jaild ps`` row) and
:data:`APPROVAL_ENTRY` (a call waiting for approval) says who chooses it and what happens to
it *when the record is closed* (:func:`close_record`, :func:`close_snapshot`,
:func:`close_live`):

==========  ==================================================================
``keep``    not the jail's choice, or already bounded to the few bits of the
            status (said in its ``why``)
``sink``    governed by its own sink rule (``result``, ``output``, ``downloads``)
``drop``    emptied (None, nothing, 0)
``fix``     a fixed word in place of the jail's
``bucket``  a count or size rounded up to a power of two (at most ~6 bits a
            field instead of 64)
``timing``  a time: kept -- the caller can time the job itself, so no record
            field can close this channel (docs/security.md)
``custom``  a rule of its own, written beside the decision
==========  ==================================================================

A record is closed for a caller when its ``flow`` withholds or redacts the result or the
output from that caller (:func:`closed`). The operator's sinks (the audit log, traces,
metrics) are given the record as an unreleased caller would see it (:func:`operator_view`),
so ``release_to`` opens the record to the callers it names, never to a log line.

``tests/unit/test_disclosure.py`` walks the record's type and fails on a field without a
decision here; adding a field to a record means deciding here what a closed sink does to it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from jaild.policy.flow import ClosedSend, Delivery, Disposition, FlowRules
from jaild.policy.schema import Policy, flow_rules
from jaild.protocol.fields import Struct
from jaild.protocol.records import (
    ApprovalEntry,
    EgressRecord,
    FlowRecord,
    FlowRefusal,
    JobEntry,
    JobError,
    JobRecord,
    SnapshotEntry,
    Usage,
)

WITHHELD = "(withheld)"
"""The fixed word for a jail-chosen string past a closed sink."""
UNKNOWN_TOOL = "(unknown)"
"""A call to a tool the job does not have, in every record and operator sink: the name is
the jail's, so it is never repeated (the jail's own exception names it, in its output)."""
OTHER_HOST = "(other)"
"""An egress host the policy names by a wildcard: which one is the jail's choice."""

DAEMON_ERROR_TYPES = frozenset({
    "Cancelled", "Timeout", "OutputLimit", "JailStartFailed", "ChannelError", "MemoryLimit",
    "PolicyViolation", "Killed", "JailLost", "RuntimeStartFailed", "ProcessExit",
    "InternalError", "Error",
})
"""``error.type`` words the daemon writes itself (:mod:`jaild.daemon.core.classify`); any
other is the name of the jail's exception."""


class Chooser(enum.Enum):
    """Who chooses a field's value."""

    DAEMON = "daemon"
    KERNEL = "kernel"  # measured by the host (cgroup, clocks) of what the jail did
    CLIENT = "client"  # the caller, its tools, or the operator's policy
    JAIL = "jail"


class Closed(enum.Enum):
    """What a closed sink does to a field (the module docstring's table)."""

    KEEP = "keep"
    SINK = "sink"
    DROP = "drop"
    FIX = "fix"
    BUCKET = "bucket"
    TIMING = "timing"
    CUSTOM = "custom"


@dataclass(frozen=True)
class Decision:
    """One field: who chooses it, what a closed sink does to it, and why."""

    chooser: Chooser
    closed: Closed
    why: str


def _d(chooser: str, closed: str, why: str) -> Decision:
    return Decision(Chooser(chooser), Closed(closed), why)


RECORD: Mapping[str, Decision] = {
    "job_id": _d("daemon", "keep", "the daemon's id"),
    "policy": _d("daemon", "keep", "the policy admission chose"),
    "status": _d("kernel", "keep", "one of a dozen words (at most 4 bits a job); the "
                 "caller needs it, and a job that ends early is seen ending anyway"),
    "stdout": _d("jail", "sink", "the output sink (withhold, redact)"),
    "stderr": _d("jail", "sink", "the output sink (withhold, redact)"),
    "error": _d("jail", "custom", "see its fields"),
    "error.type": _d("jail", "custom", "the daemon's own words kept; an exception's class "
                     "name (the jail's) becomes (withheld)"),
    "error.message": _d("jail", "sink", "the output sink: withheld with the output or the "
                        "result, redacted with the output"),
    "error.traceback": _d("jail", "sink", "as error.message"),
    "error.lineno": _d("jail", "drop", "the jail chooses the line (27 bits)"),
    "error.signal": _d("jail", "drop", "the jail may signal itself: which signal is its "
                       "choice; the status says it was killed"),
    "error.syscall": _d("jail", "drop", "which forbidden syscall is the jail's choice; the "
                        "status says policy_violation"),
    "error.limit": _d("daemon", "keep", "which limit the daemon enforced: one of a few, "
                      "as the status"),
    "tool_calls": _d("jail", "drop", "the order and choice of calls is the jail's (bits "
                     "per call); usage.tool_calls keeps their count, bucketed"),
    "tool_calls[].name": _d("jail", "custom", "a declared tool's name, or (unknown) for any "
                            "other (the broker never records the jail's own word)"),
    "tool_calls[].duration_s": _d("client", "timing", "the tool host's time"),
    "tool_calls[].ok": _d("client", "keep", "the tool host's or the broker's answer"),
    "tool_calls[].error_type": _d("client", "keep", "the tool host's or the broker's code"),
    "duration_s": _d("kernel", "timing", "the caller times the job itself"),
    "limits": _d("daemon", "keep", "the admitted limits"),
    "usage": _d("kernel", "custom", "see its fields"),
    "usage.wall_s": _d("kernel", "timing", "as duration_s"),
    "usage.cpu_user_s": _d("kernel", "timing", "CPU time follows wall time for a busy jail"),
    "usage.cpu_system_s": _d("kernel", "timing", "as cpu_user_s"),
    "usage.memory_peak_bytes": _d("jail", "bucket", "the jail chooses how much it uses"),
    "usage.pids_peak": _d("jail", "bucket", "the jail chooses how many processes"),
    "usage.output_bytes": _d("jail", "bucket", "the jail chooses how much it prints"),
    "usage.tool_calls": _d("jail", "bucket", "the jail chooses how many calls"),
    "usage.tool_time_s": _d("client", "timing", "the tool host's time"),
    "usage.stream_paused_s": _d("client", "timing", "the caller's own reading"),
    "usage.stream_dropped_bytes": _d("jail", "bucket", "as output_bytes"),
    "files": _d("jail", "sink", "the downloads sink (the listing goes with the files)"),
    "files[].path": _d("jail", "sink", "the downloads sink"),
    "files[].size": _d("jail", "sink", "the downloads sink"),
    "files[].sha256": _d("jail", "sink", "the downloads sink"),
    "files_skipped": _d("jail", "drop", "paths the jail wrote, skipped: nothing a closed "
                        "caller needs"),
    "files_skipped[].path": _d("jail", "drop", "as files_skipped"),
    "files_skipped[].reason": _d("jail", "drop", "as files_skipped"),
    "tool_calls_omitted": _d("jail", "drop", "as tool_calls (their count is in usage)"),
    "session": _d("daemon", "keep", "the session's id and run number"),
    "session.id": _d("daemon", "keep", "the daemon's id"),
    "session.run": _d("daemon", "keep", "the daemon's count of runs"),
    "session.closed": _d("kernel", "keep", "a status word, as status"),
    "egress": _d("jail", "custom", "the door's usage: see its fields"),
    "egress.requests": _d("jail", "bucket", "the jail chooses how many"),
    "egress.bytes_out": _d("jail", "bucket", "the jail chooses how much"),
    "egress.bytes_in": _d("jail", "bucket", "the jail chooses what it fetches"),
    "egress.hosts": _d("jail", "custom", "hosts the policy names literally kept; a host "
                       "matched by a wildcard becomes (other): which one is the jail's word"),
    "egress.refused": _d("jail", "custom", "reason codes (the daemon's) kept, counts "
                         "bucketed"),
    "flow": _d("client", "keep", "labels, what they closed"),
    "flow.labels": _d("client", "keep", "labels come from the policy and the tool hosts"),
    "flow.withheld": _d("daemon", "keep", "what the rules withheld"),
    "flow.redacted": _d("daemon", "keep", "what the rules redacted"),
    "flow.redaction": _d("daemon", "keep", "why a redact rule withheld: the daemon's word"),
    "flow.refusals": _d("jail", "custom", "one entry per distinct (sink, label, code, "
                        "target) once targets are closed, at most 16"),
    "flow.refusals[].sink": _d("daemon", "keep", "which sink refused"),
    "flow.refusals[].label": _d("client", "keep", "the label that closed it"),
    "flow.refusals[].target": _d("jail", "custom", "a declared tool's name kept; an egress "
                                 "target the policy does not name literally becomes "
                                 "(withheld)"),
    "flow.refusals[].code": _d("daemon", "keep", "the refusal's code"),
    "flow.refusals[].reason": _d("jail", "fix", "it quotes the target: a fixed sentence "
                                 "naming sink, label and code instead"),
    "network_refused": _d("jail", "bucket", "the jail chooses how many sockets it tries "
                          "(60 bits as a count)"),
}
"""Every field of a :class:`JobRecord`: who chooses it, what a closed sink does to it."""

SNAPSHOT: Mapping[str, Decision] = {
    "id": _d("daemon", "keep", "the store's id"),
    "policy": _d("daemon", "keep", "the session's policy"),
    "sha256": _d("jail", "drop", "a digest of the jail's state: 256 jail-chosen bits"),
    "bytes": _d("jail", "bucket", "the state's size is the jail's choice"),
    "created": _d("daemon", "keep", "the daemon's clock"),
    "expires": _d("daemon", "keep", "the daemon's clock and the policy"),
    "session": _d("daemon", "keep", "the daemon's id"),
    "kind": _d("daemon", "keep", "snapshot, pause or parked"),
    "labels": _d("client", "keep", "the labels the state carries"),
}
"""Every field of a :class:`SnapshotEntry` (snapshot, pause and fork replies, ``jaild
snapshots``): closed when the session's labels close its result or output."""

JOB_ENTRY: Mapping[str, Decision] = {
    "id": _d("daemon", "keep", "the daemon's id"),
    "kind": _d("daemon", "keep", "job or session"),
    "policy": _d("daemon", "keep", "the policy admission chose"),
    "uid": _d("daemon", "keep", "the owner's credentials"),
    "client_pid": _d("daemon", "keep", "the owner's credentials"),
    "state": _d("daemon", "keep", "the daemon's phase of it"),
    "age_s": _d("daemon", "timing", "the daemon's clock"),
    "session": _d("daemon", "keep", "the daemon's id"),
    "runs": _d("daemon", "keep", "runs the client started"),
    "running": _d("daemon", "keep", "whether the client's run is on"),
    "idle_s": _d("daemon", "timing", "the daemon's clock"),
    "expires_in_s": _d("daemon", "timing", "the daemon's clock"),
    "memory_bytes": _d("jail", "bucket", "polled live, the jail's memory would be a channel "
                       "of as many bits as the caller polls"),
    "cpu_s": _d("kernel", "timing", "CPU time follows wall time for a busy jail"),
    "pids": _d("jail", "bucket", "as memory_bytes"),
    "pod": _d("daemon", "keep", "the owner's pod"),
    "principal": _d("daemon", "keep", "the owner's certificate name"),
}
"""Every field of a :class:`JobEntry` (``jaild ps``): closed (:func:`close_live`) while the
job's or session's labels withhold or redact a run's result or output."""

APPROVAL_ENTRY: Mapping[str, Decision] = {
    "job_id": _d("daemon", "keep", "the daemon's id"),
    "call_id": _d("daemon", "keep", "the call's number"),
    "tool": _d("client", "keep", "a declared tool (the broker refuses any other first)"),
    "args": _d("jail", "sink", "the approvals sink: approve_tools and on_untrusted = "
               "'approve' send the call to the policy's approvers, arguments and all -- "
               "that is what they decide on (docs/using/flow.md: not closed)"),
    "policy": _d("daemon", "keep", "the run's policy"),
    "owner": _d("daemon", "keep", "the run's owner"),
    "waiting_s": _d("daemon", "timing", "the daemon's clock"),
    "parked": _d("daemon", "keep", "the daemon's state of it"),
    "attached": _d("daemon", "keep", "the daemon's state of it"),
    "session": _d("daemon", "keep", "the daemon's id"),
}
"""Every field of an :class:`ApprovalEntry` (``jaild approvals``): seen by approvers."""


# --------------------------------------------------------------------------- coarsening


def bucket(value: int | None) -> int | None:
    """``value`` rounded up to a power of two (0 stays 0, None stays None)."""
    if value is None or value <= 0:
        return value if value is None else 0
    return 1 << (int(value) - 1).bit_length()


def closed(record: JobRecord) -> bool:
    """Does the record's flow withhold or redact the result or the output?"""
    flow = record.flow
    return flow is not None and bool(
        {Delivery.RESULT, Delivery.OUTPUT} & {*flow.withheld, *flow.redacted})


def _error(error: JobError | None) -> JobError | None:
    if error is None:
        return None
    return dataclasses.replace(
        error,
        type=error.type if error.type in DAEMON_ERROR_TYPES else WITHHELD,
        lineno=None, signal=None, syscall=None,
    )


def _usage(usage: Usage | None) -> Usage | None:
    if usage is None:
        return None
    return dataclasses.replace(
        usage,
        memory_peak_bytes=bucket(usage.memory_peak_bytes),
        pids_peak=bucket(usage.pids_peak),
        output_bytes=bucket(usage.output_bytes) or 0,
        tool_calls=bucket(usage.tool_calls) or 0,
        stream_dropped_bytes=bucket(usage.stream_dropped_bytes) or 0,
    )


def _host(host: str, literal: frozenset[str]) -> str:
    return host if host in literal else OTHER_HOST


def _egress(egress: EgressRecord | None, literal: frozenset[str]) -> EgressRecord | None:
    if egress is None:
        return None
    return dataclasses.replace(
        egress,
        requests=bucket(egress.requests) or 0,
        bytes_out=bucket(egress.bytes_out) or 0,
        bytes_in=bucket(egress.bytes_in) or 0,
        hosts=tuple(sorted({_host(h, literal) for h in egress.hosts})),
        refused={code: bucket(n) or 0 for code, n in egress.refused.items()},
    )


MAX_CLOSED_REFUSALS = 16


def _target(refusal: FlowRefusal, literal: frozenset[str]) -> str:
    if refusal.sink == ClosedSend.EGRESS:
        host = refusal.target.rsplit(":", 1)[0]
        return refusal.target if host in literal else WITHHELD
    return refusal.target  # a declared tool: the broker refuses unknown ones before flow


def _flow(flow: FlowRecord | None, literal: frozenset[str]) -> FlowRecord | None:
    if flow is None:
        return None
    seen: dict[tuple[str, str, str, str], FlowRefusal] = {}
    for refusal in flow.refusals:
        target = _target(refusal, literal)
        key = (refusal.sink, refusal.label, refusal.code, target)
        if key not in seen and len(seen) < MAX_CLOSED_REFUSALS:
            seen[key] = FlowRefusal(
                sink=refusal.sink, label=refusal.label, target=target, code=refusal.code,
                reason=f"{refusal.sink} closed to a job holding label {refusal.label!r} "
                       f"({refusal.code})")
    return dataclasses.replace(flow, refusals=tuple(seen.values()))


def close_record(record: JobRecord, literal_hosts: Iterable[str] = ()) -> JobRecord:
    """``record`` as a closed sink may see it: every field as :data:`RECORD` decides
    (``literal_hosts``: the hosts the policy's egress rules name without a wildcard).
    The ``sink`` fields were already withheld or redacted by their own rules."""
    literal = frozenset(literal_hosts)
    return dataclasses.replace(
        record,
        error=_error(record.error),
        tool_calls=(),
        tool_calls_omitted=0,
        usage=_usage(record.usage),
        files_skipped=(),
        egress=_egress(record.egress, literal),
        flow=_flow(record.flow, literal),
        network_refused=bucket(record.network_refused),
    )


def caller_view(record: JobRecord, policy: Policy) -> JobRecord:
    """The record for its caller under ``policy``: closed if its flow closed the result or
    output. A record without a flow is returned as it is, at once (most jobs)."""
    if record.flow is None or not closed(record):
        return record
    return close_record(record, literal_hosts(policy))


def operator_view(record: JobRecord, policy: Policy) -> JobRecord:
    """The record for the audit log, traces and metrics: as a caller no ``release_to``
    spares would see it (the withholding itself is the caller's; these sinks get the
    closed fields whenever any caller's view would be closed)."""
    flow = record.flow
    if flow is None:
        return record
    if closed(record) or closes(flow_rules(policy), flow.labels):
        return close_record(record, literal_hosts(policy))
    return record


@functools.lru_cache(maxsize=64)
def literal_hosts(policy: Policy) -> frozenset[str]:
    """The hosts ``policy`` names without a wildcard (its egress allow-list and its flow
    sinks' ``egress``): naming one of them in a record says nothing the policy did not."""
    patterns = [*policy.egress.allow,
                *(host for sink in policy.flow.sink for host in (sink.egress or ()))]
    out = set()
    for pattern in patterns:
        if "*" in pattern:
            continue
        host, _, port = pattern.rpartition(":")
        out.add(host if host and port.isdigit() and "]" not in port else pattern)
    return frozenset(out)


def close_live(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A jail's live use (``jaild ps``) as :data:`JOB_ENTRY` decides for a closed job."""
    out = dict(usage)
    for key in ("memory_bytes", "pids"):
        if key in out:
            out[key] = bucket(out[key])
    return out


def closes(rules: FlowRules, labels: Iterable[str],
           released: frozenset[str] = frozenset()) -> bool:
    """Do ``labels`` withhold or redact the result or the output from a caller whom
    ``release_to`` spares the ``released`` labels (none: the operator's view, and ``jaild
    ps``)?"""
    held = frozenset(labels)
    if not held or not rules.sinks:
        return False
    closing = {*rules.withheld(held, released.__contains__),
               *rules.withheld(held, released.__contains__, Disposition.REDACT)}
    return bool({Delivery.RESULT, Delivery.OUTPUT} & closing)


def close_snapshot(entry: SnapshotEntry) -> SnapshotEntry:
    """A snapshot's entry as :data:`SNAPSHOT` decides for a closed caller."""
    return dataclasses.replace(entry, sha256="0" * 64, bytes=bucket(entry.bytes) or 0)


# --------------------------------------------------------------------------- the walk


def _structs_in(hint: Any) -> list[type[Struct]]:
    """The Struct classes a field's type names (``X | None``, ``tuple[X, ...]``)."""
    if isinstance(hint, type) and issubclass(hint, Struct):
        return [hint]
    out: list[type[Struct]] = []
    if typing.get_origin(hint) in (typing.Union, types.UnionType, tuple):
        for arg in typing.get_args(hint):
            out += _structs_in(arg)
    return out


def field_paths(cls: type[Struct], prefix: str = "") -> list[str]:
    """Every field path of ``cls``, nested structs included (``tool_calls[].name``)."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        path = prefix + f.name
        out.append(path)
        hint = hints[f.name]
        many = typing.get_origin(hint) is tuple
        for inner in _structs_in(hint):
            out += field_paths(inner, path + ("[]." if many else "."))
    return out


TABLES: Mapping[type[Struct], Mapping[str, Decision]] = {
    JobRecord: RECORD,
    SnapshotEntry: SNAPSHOT,
    JobEntry: JOB_ENTRY,
    ApprovalEntry: APPROVAL_ENTRY,
}
"""The records a closed sink is given, each with its table (the test walks them)."""

CUSTOM: Mapping[str, Callable[..., Any]] = {
    "error": _error,
    "error.type": _error,
    "usage": _usage,
    "tool_calls[].name": lambda name, tools: name if name in tools else UNKNOWN_TOOL,
    "egress": _egress,
    "egress.hosts": _host,
    "egress.refused": _egress,
    "flow.refusals": _flow,
    "flow.refusals[].target": _target,
}
"""Where each ``custom`` decision is carried out (the test checks each has one)."""

__all__ = [
    "APPROVAL_ENTRY",
    "CUSTOM",
    "DAEMON_ERROR_TYPES",
    "JOB_ENTRY",
    "OTHER_HOST",
    "RECORD",
    "SNAPSHOT",
    "TABLES",
    "UNKNOWN_TOOL",
    "WITHHELD",
    "Chooser",
    "Closed",
    "Decision",
    "bucket",
    "caller_view",
    "close_live",
    "close_record",
    "close_snapshot",
    "closed",
    "closes",
    "field_paths",
    "literal_hosts",
    "operator_view",
]
