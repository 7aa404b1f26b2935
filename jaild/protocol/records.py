"""Typed records: what the daemon reports about jobs, sessions, policies and its own use.

Theory of operation
-------------------
A value that crosses the client link as a *report* -- a job's result record
(``JobFinished.record``), a session as opened (``SessionOpened.record``), the
entries of ``JobList`` and ``PolicyList``, the totals of ``Stats`` -- is one of
the frozen, self-validating structs below, built with the same
:func:`~jaild.protocol.fields.field` checks as the messages that carry them. So:

* an illegal record cannot be built: the daemon's builders
  (:mod:`jaild.daemon.core.records`) raise :class:`LocalProtocolError` at once, where
  the bug is, instead of sending it (a run's record is built with
  :meth:`~jaild.protocol.fields.Struct.trusted` only from parts built checked and values
  seen to be as the checks want them; anything else goes through the checks);
* a record off the wire is checked field by field like any message: unknown or
  missing fields, wrong types and values outside the limits are a
  :class:`RemoteProtocolError` at the one receive boundary
  (:func:`jaild.protocol.messages.decode`);
* the code that takes a record off the wire or builds one -- the client library, the
  daemon's server, metrics, audit, accounting -- reads attributes
  (``record.usage.wall_s``), never string keys. The front ends (CLI, MCP server, code
  mode) use the client's public ``JobResult``, whose plain-map fields are this
  module's views and whose ``record`` is the typed record.

Two views
---------
:meth:`Struct.to_wire` always sends every field (nil where there is nothing),
so the wire shape is fixed per protocol version. :meth:`Report.to_dict` is the
*user's* view, the JSON that ``jaild run --json`` prints and the client library's
dict attributes hold: fields listed in a class's ``SPARSE`` are left out when they
are nil (or, for ``SPARSE_EMPTY``, when they are empty or zero); :class:`JobError`
and :class:`JobEntry` refine that rule, so that every view has exactly the shape
the maps of protocol version 2 had. The view is for people and JSON; code reads
the attributes.

``STATUSES`` is the closed set of job statuses; it lives here because it is part
of the wire's meaning (a record with any other status is malformed).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from jaild.errors import LocalProtocolError
from jaild.protocol.fields import (
    JOB_ID,
    LABEL,
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    MAX_REF,
    SESSION_ID,
    SNAPSHOT_ID,
    Struct,
    any_map,
    binary,
    boolean,
    describe,
    field,
    integer,
    limit_of,
    list_of,
    map_of,
    member_of,
    nested,
    number,
    one_of,
    optional,
    string,
    struct,
)

STATUSES = (
    "ok",
    "error",
    "timeout",
    "memory_limit",
    "output_limit",
    "killed",
    "policy_violation",
    "cancelled",
    "internal_error",
)
"""How a job can end (PROTOCOL.md section 10, table "statuses")."""

MAX_CALL_RECORDS = 1000
"""Tool calls listed in a result record; further calls are only counted (``tool_calls_omitted``)."""
MAX_OUTPUT_CHARS = 1 << 30
"""``stdout`` / ``stderr`` of a record (the policy's ``output_bytes`` caps them far lower)."""
MAX_RECORD_FILES = 1 << 16
"""Files listed in a record (the policy's ``[files] max_files`` is at most this)."""
MAX_SKIPPED_FILES = 1024
"""Entries of ``files_skipped`` (the daemon reports at most 100)."""
MAX_PATH_CHARS = 4096
"""A path or a reason in a record's file lists."""
MAX_SECONDS = float(1 << 40)
"""Durations and ages in records (about 35,000 years)."""

_seconds = number(0, MAX_SECONDS)
_count = integer(0, MAX_REF)
_short = string(64, min_len=1)
_policy_name = string(64, min_len=1)
MAX_PRINCIPAL_CHARS = 1024
"""The longest principal a record carries (a certificate's URI SAN or subject)."""
_pod_name = string(317, min_len=2, pattern=r"([a-z0-9][a-z0-9.-]*)?/[a-z0-9][a-z0-9.-]*")
"""A pod as "namespace/name" (a namespace is at most 63 characters, a name 253), or
"/<pod uid>" for a pod known by its uid alone (the daemon has no access to the API)."""
_job_id = string(64, min_len=1, pattern=JOB_ID)
_session_id = string(64, min_len=5, pattern=SESSION_ID)


_limit_number = number(0, 1 << 53)
_limit_text = string(64)


def _limit_value(path: str, v: Any) -> Any:
    """A number (a ``[limits]`` value) or a short string (``network``: the mode)."""
    if type(v) is str:
        return _limit_text(path, v)
    return _limit_number(path, v)


describe(_limit_value, f"{limit_of(_limit_number)}, or a string of {limit_of(_limit_text)}")
_limits_checked = map_of(_short, _limit_value, 64)
_LIMIT_MAX = 1 << 53


def _limits(path: str, v: Any) -> Any:
    """The effective limits: the policy's ``[limits]`` names (declared once, in the policy
    schema, so not repeated here as fields), plus ``network`` and ``tmp_mb``.

    ``map_of(_short, _limit_value, 64)``, with its common case -- ASCII names, numbers in
    range, short ASCII text -- checked in one pass: a record holds some twenty limits and
    every record is checked twice (built by the daemon, read by the client). Anything else
    goes through the full check, which accepts or refuses it with the precise reason."""
    if type(v) is dict and len(v) <= 64:
        for k, x in v.items():
            if type(k) is not str or not 0 < len(k) <= 64 or not k.isascii():
                break
            t = type(x)
            if t is str:
                if len(x) > 64 or not x.isascii():
                    break
            elif (t is not int and t is not float) or not 0 <= x <= _LIMIT_MAX:
                break
        else:
            return v
    return _limits_checked(path, v)


describe(_limits, limit_of(_limits_checked))


class Report(Struct):
    """Base of the record structs: adds the user's sparse view, :meth:`to_dict`."""

    __slots__ = ()
    SPARSE: ClassVar[frozenset[str]] = frozenset()
    """Fields left out of :meth:`to_dict` when nil."""
    SPARSE_EMPTY: ClassVar[frozenset[str]] = frozenset()
    """Fields left out of :meth:`to_dict` when nil, empty or zero."""

    def to_dict(self) -> dict[str, Any]:
        """The user's view (JSON-ready apart from bytes): like :meth:`to_wire`, recursively,
        without the ``SPARSE`` fields that hold nothing."""
        out: dict[str, Any] = {}
        for name, _ in self._checks:
            value = getattr(self, name)
            if value is None and name in self.SPARSE:
                continue
            if name in self.SPARSE_EMPTY and (value is None or not value):
                continue
            out[name] = _view(value)
        return out


def _view(value: Any) -> Any:
    if isinstance(value, Report):
        return value.to_dict()
    if isinstance(value, Struct):
        return value.to_wire()
    if type(value) is tuple:
        return [_view(v) for v in value]
    if type(value) is dict:
        return {k: _view(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- the job record


@struct
class JobError(Report):
    """Why a job did not end ``ok``: the user's exception, or the daemon's verdict."""

    SPARSE = frozenset({"signal", "syscall", "limit"})

    type: str = field(string(256, min_len=1))
    message: str = field(string(MAX_MESSAGE_CHARS))
    traceback: str = field(string(MAX_MESSAGE_CHARS), default="")
    lineno: int | None = field(optional(integer(0, 1 << 31)), default=None)
    signal: str | None = field(optional(string(32, min_len=1)), default=None)
    """The signal that killed the process (``killed``, ``policy_violation``)."""
    syscall: str | None = field(optional(string(64, min_len=1)), default=None)
    """The syscall the seccomp filter killed (``policy_violation``; nil if not found)."""
    limit: str | None = field(optional(_short), default=None)
    """The limit that was hit (``timeout``, ``memory_limit``, ``output_limit``)."""

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`Report.to_dict`; after a seccomp kill ``syscall`` is shown even when nil
        (the call was not found), as it always was."""
        out = Report.to_dict(self)
        if self.signal == "SIGSYS":
            out["syscall"] = self.syscall
        return out


@struct
class ToolCallEntry(Report):
    """One tool call of a job, as it ended."""

    SPARSE = frozenset({"error_type"})

    name: str = field(string(MAX_NAME_CHARS, min_len=1))
    duration_s: float = field(_seconds)
    """The host round trip (0 for a call the daemon refused)."""
    ok: bool = field(boolean())
    error_type: str | None = field(optional(string(256, min_len=1)), default=None)
    """Why it failed, when known: ``unknown_tool``, ``payload_too_large``, the host
    exception's type name, ..."""


@struct
class Usage(Report):
    """What a run consumed, from its code's start (``RunCode``) to its end."""

    wall_s: float = field(_seconds)
    cpu_user_s: float | None = field(optional(_seconds))
    """Nil if the host has no CPU accounting."""
    cpu_system_s: float | None = field(optional(_seconds))
    memory_peak_bytes: int | None = field(optional(_count))
    pids_peak: int | None = field(optional(_count))
    output_bytes: int = field(_count)
    tool_calls: int = field(_count)
    tool_time_s: float = field(_seconds)
    stream_paused_s: float = field(_seconds)
    stream_dropped_bytes: int = field(_count)


MAX_EGRESS_HOSTS = 256
"""Hosts listed in a record's ``egress`` (the first, in name order)."""


@struct
class EgressRecord(Report):
    """What a run's egress through the daemon's gateway used (``network.mode = "egress"``)."""

    requests: int = field(_count)
    """Requests and tunnels the gateway read, refused ones included, up to the quota."""
    bytes_out: int = field(_count)
    """Bytes from the jail towards hosts (heads and bodies, or a tunnel's bytes)."""
    bytes_in: int = field(_count)
    hosts: tuple[str, ...] = field(list_of(string(255, min_len=1), MAX_EGRESS_HOSTS))
    """The hosts it reached (connected to)."""
    refused: dict[str, int] = field(map_of(_short, _count, 32))
    """Refusals by kind: ``not_allowed``, ``private_address``, ``quota``, ``bad_request``,
    ``slow_request``, ``head_too_large``, ``misdirected``, ``unresolved``, ``unreachable``."""


MAX_JOB_LABELS = 256
_label = string(64, min_len=1, pattern=LABEL)


@struct
class FlowRefusal(Report):
    """A send the job's labels closed (PROTOCOL.md; docs/using/flow.md)."""

    sink: str = field(one_of("egress", "tool", "approval"))
    """``egress``: a gateway request refused; ``tool``: a call refused; ``approval``: a call
    sent for approval because of a label."""
    label: str = field(_label)
    """The label whose rule closed it (never a value)."""
    target: str = field(string(1024))
    """The host:port or the tool."""
    code: str = field(string(64, min_len=1))
    """``flow_denied``, ``integrity``, ``flow_approval``, ``flow_egress``, ``flow_cut``."""
    reason: str = field(string(1024), default="")
    """What the job was told: the rule, in words."""


REDACTION_FAILURES = ("exhausted", "failed")
"""``FlowRecord.redaction``: why a ``redact`` rule withheld."""


@struct
class FlowRecord(Report):
    """The labels a run's job holds and what they closed (policies with ``[flow]`` rules, or
    runs that received a labelled result)."""

    SPARSE = frozenset({"redaction"})

    labels: tuple[str, ...] = field(list_of(_label, MAX_JOB_LABELS))
    """Every label the job (a session: the session, so far) has received, sorted."""
    refusals: tuple[FlowRefusal, ...] = field(list_of(nested(FlowRefusal), MAX_CALL_RECORDS))
    withheld: tuple[str, ...] = field(list_of(one_of("result", "output", "downloads"), 3))
    """What the client did not get because of a label (its rule says ``withhold``)."""
    redacted: tuple[str, ...] = field(list_of(one_of("result", "output"), 2), default=())
    """What the client got redacted: every string of a reply carrying the label replaced by
    ``[redacted:LABEL]`` (its rule says ``redact``)."""
    redaction: str | None = field(optional(one_of(*REDACTION_FAILURES)), default=None)
    """Why what a ``redact`` rule covers was withheld instead (it is in ``withheld``):
    ``exhausted`` -- the job (a session: the session) received more labelled values than
    redaction keeps (or a restored state's labels came without them), so ``redact``
    withholds for the rest of it; ``failed`` -- this run's redaction could not finish (too
    deep, too much to scan, out of time). Nil: redaction, if any, was done."""


@struct
class FileEntry(Report):
    """A regular file the run created or changed in its working directory."""

    path: str = field(string(MAX_PATH_CHARS, min_len=1))
    size: int = field(integer(0, MAX_REF))
    sha256: str = field(string(64, min_len=64, pattern=r"[0-9a-f]{64}"))


@struct
class SkippedFile(Report):
    """An entry of the working directory that is not listed or not sent, and why."""

    path: str = field(string(MAX_PATH_CHARS))
    reason: str = field(string(MAX_PATH_CHARS))


@struct
class SessionRun(Report):
    """Where a session's run belongs."""

    id: str = field(_session_id)
    run: int | None = field(optional(_count))
    """The run's number in the session (nil: the code did not compile, nothing ran)."""
    closed: str | None = field(optional(_short))
    """The status of this run if it ended the session, else nil."""


@struct
class JobRecord(Report):
    """A job's result record (``JobFinished.record``; PROTOCOL.md section 10)."""

    SPARSE = frozenset({"session", "egress", "flow"})
    SPARSE_EMPTY = frozenset({"tool_calls_omitted", "files_skipped", "network_refused"})

    job_id: str = field(_job_id)
    policy: str = field(_policy_name)
    status: str = field(one_of(*STATUSES))
    stdout: str = field(string(MAX_OUTPUT_CHARS))
    stderr: str = field(string(MAX_OUTPUT_CHARS))
    error: JobError | None = field(optional(nested(JobError)))
    """Nil when ``status`` is ``ok``."""
    tool_calls: tuple[ToolCallEntry, ...] = field(
        list_of(nested(ToolCallEntry), MAX_CALL_RECORDS)
    )
    duration_s: float = field(_seconds)
    """Wall-clock seconds from the job's start (before the jail exists) to its end."""
    limits: dict[str, float | str] = field(_limits)
    usage: Usage | None = field(optional(nested(Usage)))
    """Nil when no code ran (it did not compile, or the job failed inside jaild)."""
    files: tuple[FileEntry, ...] = field(list_of(nested(FileEntry), MAX_RECORD_FILES))
    files_skipped: tuple[SkippedFile, ...] = field(
        list_of(nested(SkippedFile), MAX_SKIPPED_FILES)
    )
    tool_calls_omitted: int = field(_count)
    """Calls beyond the :data:`MAX_CALL_RECORDS` listed."""
    session: SessionRun | None = field(optional(nested(SessionRun)))
    """Set for a session's runs only."""
    egress: EgressRecord | None = field(optional(nested(EgressRecord)), default=None)
    """Set for the runs of ``network.mode = "egress"`` policies only."""
    flow: FlowRecord | None = field(optional(nested(FlowRecord)), default=None)
    """Set once the job holds a label or a flow rule refused something (docs/using/flow.md)."""
    network_refused: int | None = field(optional(_count), default=None)
    """Network attempts of the run that its policy refused softly (``network.mode = "none"``:
    sockets of AF_INET/AF_INET6, name lookups), as the jail's runtime counted them in the
    job's interpreter -- the jail's own word (``CodeFinished.network_refused``). Nil when the
    runtime did not report (the run was stopped before its code ended, or never ran)."""

    def _invariant(self) -> None:
        if (self.status == "ok") != (self.error is None):
            raise LocalProtocolError(
                f"field 'error': must be nil exactly when the status is ok "
                f"(status {self.status!r})"
            )

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@struct
class SessionInfo(Report):
    """A session as opened (``SessionOpened.record``)."""

    policy: str = field(_policy_name)
    idle_s: float = field(_seconds)
    """The session ends after this long without a run."""
    max_lifetime_s: float = field(_seconds)
    """... and this long after it opened, in any case."""
    limits: dict[str, float | str] = field(_limits)
    """The session's limits: the policy's, tightened by ``OpenSession.limits``."""


@struct
class ApprovalEntry(Report):
    """A tool call waiting for approval (``ApprovalList``; ``jaild approvals``)."""

    job_id: str = field(_job_id)
    call_id: int = field(_count)
    tool: str = field(string(MAX_NAME_CHARS, min_len=1))
    args: bytes = field(binary(1 << 20))
    """The call's arguments, packed (msgpack ``[args, kwargs]``), at most 1 MiB shown."""
    policy: str = field(_policy_name)
    owner: str = field(string(1024))
    """Whose run it is (``uid 1000``, ``principal NAME``, ``pod NS/NAME``)."""
    waiting_s: float = field(_seconds)
    parked: bool = field(boolean())
    """Its jail is gone; the run waits on disk (it survives a daemon restart)."""
    attached: bool = field(boolean())
    """A connection of its owner's waits to host its tools (else one must ``ResumeRun``)."""
    session: str | None = field(optional(_session_id), default=None)
    """The session whose run it is (None: a one-shot run)."""


class SnapshotKind(enum.StrEnum):
    """What a kept snapshot holds (``SnapshotEntry.kind``; its value is the word on the wire
    and in the store's files)."""

    SNAPSHOT = "snapshot"
    """One a client took (``Snapshot``): kept until it expires or is deleted."""
    PAUSE = "pause"
    """The state of a paused session: deleted when it resumes or ends."""
    PARKED = "parked"
    """A session's state before its run parked for approval: deleted when the run ends or
    is dropped."""


@struct
class SnapshotEntry(Report):
    """A snapshot the daemon keeps (``SnapshotTaken``, ``SnapshotList``; ``jaild snapshots``)."""

    id: str = field(string(37, min_len=37, pattern=SNAPSHOT_ID))
    policy: str = field(_policy_name)
    """The policy of the session it was taken from: restoring opens one under it."""
    bytes: int = field(_count)
    created: float = field(_seconds)
    """Unix time it was taken."""
    expires: float = field(_seconds)
    """Unix time the daemon deletes it."""
    session: str = field(_session_id)
    """The session it was taken from."""
    kind: SnapshotKind = field(member_of(SnapshotKind), default=SnapshotKind.SNAPSHOT)
    """``pause``: the state of a paused session (deleted when it resumes or ends);
    ``parked``: a session's state before its run parked for approval (deleted when the run
    ends or is dropped)."""
    sha256: str = field(string(64, min_len=64, pattern=r"[0-9a-f]{64}"), default="0" * 64)
    labels: tuple[str, ...] = field(list_of(_label, MAX_JOB_LABELS), default=())
    """The labels of the session's data (docs/using/flow.md): a session restored from it
    starts with them."""


# --------------------------------------------------------------------------- ps, policies, stats


@struct
class JobEntry(Report):
    """One running job or open session (an entry of ``JobList``; ``jaild ps``)."""

    JOB_ONLY: ClassVar[frozenset[str]] = frozenset({"session"})
    SESSION_ONLY: ClassVar[frozenset[str]] = frozenset(
        {"runs", "running", "idle_s", "expires_in_s"}
    )
    LIVE: ClassVar[frozenset[str]] = frozenset({"memory_bytes", "cpu_s", "pids"})

    id: str = field(_job_id)
    kind: str = field(one_of("job", "session"))
    policy: str = field(_policy_name)
    uid: int | None = field(optional(integer(0, (1 << 32) - 1)))
    """The owner's uid; nil for a network client (its ``principal`` says who)."""
    client_pid: int = field(integer(0, (1 << 32) - 1))
    state: str = field(one_of("starting", "running", "idle", "paused", "parked"))
    """``paused``: a session paused to disk, holding no jail (its next run restores it);
    ``parked``: paused with its run, which waits for an approval past the policy's
    ``approvals.park_after_s`` (it goes on once the call is decided)."""
    age_s: float = field(_seconds)
    session: str | None = field(optional(_session_id), default=None)
    """A job's session (jobs only; nil for a one-shot job)."""
    runs: int | None = field(optional(_count), default=None)
    """A session's runs so far (sessions only)."""
    running: bool | None = field(optional(boolean()), default=None)
    """A session is running a job now (sessions only)."""
    idle_s: float | None = field(optional(_seconds), default=None)
    expires_in_s: float | None = field(optional(_seconds), default=None)
    memory_bytes: int | None = field(optional(_count), default=None)
    """What the jail uses now (nil before its cgroup exists, or if unknown)."""
    cpu_s: float | None = field(optional(_seconds), default=None)
    pids: int | None = field(optional(_count), default=None)
    pod: str | None = field(optional(_pod_name), default=None)
    """The owner's pod ("namespace/name"), where pods are the tenants; else nil."""
    principal: str | None = field(optional(string(MAX_PRINCIPAL_CHARS, min_len=1)), default=None)
    """A network client's principal (what its certificate names); else nil."""

    def to_dict(self) -> dict[str, Any]:
        """The user's view: a job's fields or a session's, and the jail's use now once it
        has a cgroup (``pids`` is set), as ``jaild ps`` always showed them."""
        skip = self.SESSION_ONLY if self.kind == "job" else self.JOB_ONLY
        if self.pids is None:
            skip = skip | self.LIVE
        if self.pod is None:
            skip = skip | {"pod"}
        if self.principal is None:
            skip = skip | {"principal"}
        return {k: v for k, v in Report.to_dict(self).items() if k not in skip}


@struct
class PoolInfo(Report):
    """How a policy's jails are made, and its warm pool's state."""

    SPARSE = frozenset({"hits", "misses", "made", "failed", "recycled", "jails"})

    mode: str = field(_short)
    min: int = field(_count)
    max: int = field(_count)
    target: int = field(_count)
    ready: int = field(_count)
    hits: int | None = field(optional(_count), default=None)
    """Counters of the pool (nil when the policy has none)."""
    misses: int | None = field(optional(_count), default=None)
    made: int | None = field(optional(_count), default=None)
    failed: int | None = field(optional(_count), default=None)
    recycled: int | None = field(optional(_count), default=None)
    jails: tuple[str, ...] | None = field(optional(list_of(_job_id, 1 << 16)), default=None)
    """The ids of the ready jails (for root only)."""


@struct
class PolicyEntry(Report):
    """A policy the caller may use (an entry of ``PolicyList``; ``jaild policies``)."""

    name: str = field(_policy_name)
    description: str = field(string(MAX_OUTPUT_CHARS))
    """The operator's text (a policy file bounds it not; the frame does)."""
    limits: dict[str, float | str] = field(_limits)
    network: str = field(_short)
    egress: tuple[str, ...] = field(list_of(string(512, min_len=1), 1024))
    """``network.mode = "egress"``: the names its jobs may reach (``egress.allow``); else
    empty."""
    seccomp: dict[str, str] = field(map_of(_short, string(64), 8))
    """``profile`` and ``action``."""
    env: str = field(string(MAX_PATH_CHARS))
    """An environment's name, or the absolute path of a venv."""
    available: bool = field(boolean())
    problems: str = field(string(MAX_OUTPUT_CHARS))
    """Why the policy is not served (its failed self-test), else empty."""
    pool: PoolInfo = field(nested(PoolInfo))
    flow: tuple[str, ...] = field(list_of(string(1024), 256), default=())
    """Its information-flow rules in words (``[flow]``; empty: none), for a model to plan
    around (the MCP server and code mode put them in their prompts)."""


@struct
class UsageTotals(Report):
    """Usage summed over the jobs of a policy or a uid since the daemon started."""

    jobs: int = field(_count)
    statuses: dict[str, int] = field(map_of(one_of(*STATUSES), _count, len(STATUSES)))
    wall_s: float = field(_seconds)
    cpu_user_s: float = field(_seconds)
    cpu_system_s: float = field(_seconds)
    memory_peak_bytes: int = field(_count)
    """The largest peak of any one job."""
    pids_peak: int = field(_count)
    output_bytes: int = field(_count)
    tool_calls: int = field(_count)
    tool_time_s: float = field(_seconds)
    files_uploaded: int = field(_count)
    files_downloaded: int = field(_count)
    sessions: int = field(_count)


@struct
class RunningCounts(Report):
    """What the daemon serves now."""

    jobs: int = field(_count)
    sessions: int = field(_count)
    connections: int = field(_count)


@struct
class ApprovalCounts(Report):
    """Durable runs (policies with ``[approvals] park_after_s``) and their quotas: the
    caller's principal's, or every principal's for root on the daemon's host."""

    durable_runs: int = field(_count)
    """Runs journaling their tool replies now, live or parked."""
    parked_runs: int = field(_count)
    """Of which parked for approval (waiting on disk)."""
    journal_bytes: int = field(_count)
    """The bytes their journals hold on disk."""
    max_parked_runs: int = field(_count)
    """The daemon's quota per principal: runs parked at once
    (``limits.approvals_parked_max_count``)."""
    journal_quota_bytes: int = field(_count)
    """The daemon's quota per principal: journal bytes
    (``limits.approvals_journal_quota_mb``)."""


@struct
class DaemonStats(Report):
    """``Stats.stats`` (``jaild stats``): totals, what runs now, the pools, the metrics."""

    SPARSE: ClassVar[frozenset[str]] = frozenset({"approvals"})

    since: float = field(number(0, 1 << 40))
    """When the totals started (Unix time: the daemon's start)."""
    policies: dict[str, UsageTotals] = field(map_of(_policy_name, nested(UsageTotals), 4096))
    uids: dict[str, UsageTotals] = field(
        map_of(string(10, min_len=1, pattern=r"[0-9]+"), nested(UsageTotals), 1 << 16)
    )
    """By uid (decimal string); only the caller's own unless the caller is root."""
    pods: dict[str, UsageTotals] = field(map_of(_pod_name, nested(UsageTotals), 1 << 16))
    """By pod ("namespace/name"), where pods are the tenants (the daemon's
    ``access.identity = "kubernetes"``): only the caller's own pod unless the caller is root
    on the daemon's host; a pod's jobs are in no uid's totals."""
    principals: dict[str, UsageTotals] = field(
        map_of(string(MAX_PRINCIPAL_CHARS, min_len=1), nested(UsageTotals), 1 << 16)
    )
    """By network client's principal (what its certificate names): only the caller's own
    unless the caller is root on the daemon's host."""
    running: RunningCounts = field(nested(RunningCounts))
    pools: dict[str, PoolInfo] = field(map_of(_policy_name, nested(PoolInfo), 4096))
    metrics: dict[str, Any] = field(any_map())
    """The Prometheus metrics summed up (free-form:
    ``jaild.daemon.observe.metrics.Metrics.summary``)."""
    approvals: ApprovalCounts | None = field(optional(nested(ApprovalCounts)), default=None)
    """Durable runs, parked runs and their journals (nil from a daemon that does not send
    it)."""


RECORDS: tuple[type[Report], ...] = (
    JobRecord,
    JobError,
    ToolCallEntry,
    Usage,
    EgressRecord,
    FlowRecord,
    FlowRefusal,
    FileEntry,
    SkippedFile,
    SessionRun,
    SessionInfo,
    JobEntry,
    SnapshotEntry,
    ApprovalEntry,
    PolicyEntry,
    PoolInfo,
    DaemonStats,
    UsageTotals,
    RunningCounts,
    ApprovalCounts,
)
"""Every record struct; ``proto/PROTOCOL.md`` documents exactly these (section 10)."""

__all__ = [
    "MAX_CALL_RECORDS",
    "MAX_EGRESS_HOSTS",
    "RECORDS",
    "REDACTION_FAILURES",
    "STATUSES",
    "ApprovalCounts",
    "ApprovalEntry",
    "DaemonStats",
    "EgressRecord",
    "FileEntry",
    "FlowRecord",
    "FlowRefusal",
    "JobEntry",
    "JobError",
    "JobRecord",
    "PolicyEntry",
    "PoolInfo",
    "Report",
    "RunningCounts",
    "SessionInfo",
    "SessionRun",
    "SkippedFile",
    "SnapshotEntry",
    "SnapshotKind",
    "ToolCallEntry",
    "Usage",
    "UsageTotals",
]
