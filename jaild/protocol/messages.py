"""The messages of jaild's two links, and the one boundary that decodes them.

Links
-----
* **client link** -- a client process <-> the daemon, over the daemon's Unix socket.
* **jail link** -- the daemon's job supervisor <-> the in-jail runtime, over a
  socketpair created per jail (never the job's stdout/stderr).

A message on the wire is a msgpack map ``{"type": <name>, <field>: <value>, ...}``
inside one frame (see :mod:`jaild.protocol.framing`). Names are imperatives for
requests (``RunJob``, ``CallTool``) and past tense for facts (``JobFinished``,
``ToolReturned``). The same name may exist on both links with different fields
(``CallTool`` carries ``job_id`` only on the client link: on the jail link the
job is whatever jail the channel belongs to, never a field a jail could forge).

Reports -- a job's result record, the entries of ``JobList`` and ``PolicyList``, the totals
of ``Stats`` -- are the typed structs of :mod:`jaild.protocol.records`, checked like any
message.

Tool arguments, tool results and job results travel as *packed* msgpack bytes
(``args``, ``value``, ``result``): the daemon routes them without decoding, and
their size is simply their length.

:func:`decode` is the only place bytes become messages; whatever the input, it
returns a message or raises :class:`RemoteProtocolError` -- nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import msgpack

from jaild.errors import LocalProtocolError, RemoteProtocolError
from jaild.protocol.fields import JOB_ID as JOB_ID
from jaild.protocol.fields import LABEL as LABEL
from jaild.protocol.fields import MAX_LABELS as MAX_LABELS
from jaild.protocol.fields import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS
from jaild.protocol.fields import MAX_NAME_CHARS as MAX_NAME_CHARS
from jaild.protocol.fields import MAX_REF as MAX_REF
from jaild.protocol.fields import SESSION_ID as SESSION_ID
from jaild.protocol.fields import SNAPSHOT_ID as SNAPSHOT_ID
from jaild.protocol.fields import TRACEPARENT as TRACEPARENT
from jaild.protocol.fields import (
    Struct,
    any_map,
    any_value,
    binary,
    boolean,
    field,
    integer,
    list_of,
    map_of,
    nested,
    number,
    one_of,
    optional,
    string,
    struct,
)
from jaild.protocol.records import (
    MAX_JOB_LABELS,
    ApprovalEntry,
    DaemonStats,
    JobEntry,
    JobRecord,
    PolicyEntry,
    SessionInfo,
    SnapshotEntry,
)

PROTOCOL_VERSION = 9

MAX_CODE_CHARS = 1 << 20
MAX_DESCRIPTION_CHARS = 8192
MAX_TOOLS = 512
MAX_PAYLOAD_BYTES = 64 << 20

TOOL_NAME = r"[A-Za-z_][A-Za-z0-9_.\-]*"
POLICY_NAME = r"[a-z0-9][a-z0-9_\-]{0,63}"

_name = string(MAX_NAME_CHARS, min_len=1)
_job_id = string(64, min_len=1, pattern=JOB_ID)
_ref = integer(0, MAX_REF)
_call_id = integer(0, MAX_REF)
_text = string(MAX_MESSAGE_CHARS)
_payload = binary(MAX_PAYLOAD_BYTES)
_session_id = string(64, min_len=5, pattern=SESSION_ID)
_snapshot_id = string(37, min_len=37, pattern=SNAPSHOT_ID)
_traceparent = string(55, min_len=55, pattern=TRACEPARENT)
"""The caller's trace context (W3C ``traceparent``): the daemon's spans for the request join
that trace. Untrusted: it names a parent, it reads nothing (docs/using/tracing.md)."""
_path = string(4096, min_len=1)
_files = map_of(_path, _payload, 1 << 16)
"""Files for the jail's working directory: relative path -> contents (checked by the daemon
against the policy's ``[files]`` limits; the in-jail runtime checks the paths again)."""
_patterns = list_of(string(4096, min_len=1), 256)

_held_labels = list_of(string(64, min_len=1, pattern=LABEL), MAX_JOB_LABELS)
"""``RunJob.labels``, ``OpenSession.labels``: every label a job can hold."""


class Message(Struct):
    """A top-level message. ``TYPE`` is its wire name."""

    __slots__ = ()
    TYPE: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        out = super().to_wire()
        out["type"] = self.TYPE
        return out


# --------------------------------------------------------------------------- structures


@struct
class ToolSpec(Struct):
    """A tool a job may call: its name, a description, and a JSON schema of its arguments."""

    name: str = field(string(MAX_NAME_CHARS, min_len=1, pattern=TOOL_NAME))
    description: str = field(string(MAX_DESCRIPTION_CHARS), default="")
    parameters: dict[str, Any] = field(any_map(), default_factory=dict)
    timeout_s: float | None = field(optional(number(0.001, 86400)), default=None)
    """This tool's call timeout (at most the policy's ``tool_call_timeout_s``)."""
    approval: bool = field(boolean(), default=False)
    """Each call waits for the client's approval callback before the handler runs."""
    labels: tuple[str, ...] = field(list_of(string(64, min_len=1, pattern=LABEL), MAX_LABELS),
                                    default=())
    """Labels every result of this tool carries (docs/using/flow.md)."""
    protected: bool = field(boolean(), default=False)
    """Its arguments must not depend on untrusted data: a job holding an untrusted label
    is refused (or sent for approval) by the policy's ``flow.on_untrusted``."""


@struct
class ErrorInfo(Struct):
    """An exception from user code (or a kill reason), as shown in the result record."""

    type: str = field(string(256, min_len=1))
    message: str = field(string(MAX_MESSAGE_CHARS))
    traceback: str = field(string(MAX_MESSAGE_CHARS), default="")
    lineno: int | None = field(optional(integer(0, 1 << 31)), default=None)


@struct
class NetworkRefusal(Struct):
    """What a jail without a network refuses softly, and the words its runtime gives for it
    (``Harden.network``; see :mod:`jaild.runtime.network`)."""

    families: tuple[int, ...] = field(list_of(integer(0, 1 << 16), 16))
    """The socket address families the seccomp filter refuses with EACCES (AF_INET and
    AF_INET6); name lookups are refused with them."""
    explanation: str = field(string(MAX_MESSAGE_CHARS, min_len=1))
    """Why, and how to get network access: the end of every refusal's message."""


_limits = map_of(string(64, min_len=1), number(0, 1 << 53), 32)

# --------------------------------------------------------------------------- client link


@struct
class Hello(Message):
    TYPE = "Hello"
    protocol: int = field(integer(0, 1 << 16))
    client: str = field(string(256), default="")


@struct
class Starting(Struct):
    """A daemon still starting (``Welcome.starting``): it answers at once, but a request
    that needs a jail waits until it is ready, for ``wait_s`` at most, and then gets
    ``Error{ref, "starting"}`` (PROTOCOL.md section 4)."""

    pending: str = field(string(1024, min_len=1))
    """What the daemon is still doing, in words (its zygotes, self-tests...)."""
    wait_s: float = field(number(0, 3600))
    """How long such a request waits at most (the daemon's ``limits.startup_wait_s``)."""


@struct
class Welcome(Message):
    TYPE = "Welcome"
    protocol: int = field(integer(0, 1 << 16))
    daemon: str = field(string(256), default="")
    node: str = field(string(253), default="")
    """The node whose state the daemon keeps (``access.node_name``, else
    ``$JAILD_NODE_NAME``, else the host name): a fleet routes a snapshot's restore and a
    parked run's resume to it. "" from a daemon that predates it."""
    starting: Starting | None = field(optional(nested(Starting)), default=None)
    """Nil: the daemon is ready. Else what it still does and how long a request that needs
    a jail waits for it."""


@struct
class Ping(Message):
    """Are you there? Either end of the client link may send it once ``Welcome`` has been
    said; the other answers ``Pong`` with the same ``seq`` at once. An end that has read
    nothing from its peer within its liveness bound takes the peer for lost (dead, frozen
    or partitioned away): see PROTOCOL.md section 8."""

    TYPE = "Ping"
    seq: int = field(_ref)


@struct
class Pong(Message):
    """The answer to ``Ping`` (its ``seq``)."""

    TYPE = "Pong"
    seq: int = field(_ref)


@struct
class JobDescription(Struct):
    """What a job runs: its code, the tools it may call, the files it gets and the files
    whose contents come back. Declared once, here: the client sends it in ``RunJob``,
    admission checks it, and the daemon hands the same value to the jail in ``RunCode``."""

    code: str = field(string(MAX_CODE_CHARS))
    filename: str = field(string(256, min_len=1), default="<job>")
    """The name the code's tracebacks and ``__file__`` show."""
    tools: tuple[ToolSpec, ...] = field(list_of(nested(ToolSpec), MAX_TOOLS), default=())
    files: dict[str, bytes] = field(_files, default_factory=dict)
    download: tuple[str, ...] = field(_patterns, default=())
    """Glob patterns (relative to the working directory) of files whose contents come back."""
    download_changed: bool = field(boolean(), default=False)
    """Also every file the run created or changed."""


@struct
class RunJob(Message):
    TYPE = "RunJob"
    ref: int = field(_ref)
    job: JobDescription = field(nested(JobDescription))
    policy: str = field(string(64, min_len=1))
    limits: dict[str, float] = field(_limits, default_factory=dict)
    session_id: str | None = field(optional(_session_id), default=None)
    traceparent: str | None = field(optional(_traceparent), default=None)
    labels: tuple[str, ...] = field(_held_labels, default=())
    """Labels the job holds from its first instruction (a session's run: added to the
    session's), as if a tool result had carried them: what a caller passes on of what it
    read -- a model that saw a labelled result writes the next job (docs/using/flow.md).
    Labels only close things, so a caller may add any."""


@struct
class OpenSession(Message):
    """Keep one jail for a series of runs (``RunJob`` with ``session_id``)."""

    TYPE = "OpenSession"
    ref: int = field(_ref)
    policy: str = field(string(64, min_len=1))
    tools: tuple[ToolSpec, ...] = field(list_of(nested(ToolSpec), MAX_TOOLS), default=())
    limits: dict[str, float] = field(_limits, default_factory=dict)
    idle_s: float | None = field(optional(number(0.001, 1 << 31)), default=None)
    max_lifetime_s: float | None = field(optional(number(0.001, 1 << 31)), default=None)
    traceparent: str | None = field(optional(_traceparent), default=None)
    from_snapshot: str | None = field(optional(_snapshot_id), default=None)
    """Open the session with this snapshot's state and files (restored in its fresh jail);
    the policy defaults to the snapshot's."""
    pause_after_s: float | None = field(optional(number(0.001, 1 << 31)), default=None)
    """Pause the session to disk after this long without a run (its jail is released; the
    next run restores it). None: the policy's ``session.pause_after_s``."""
    labels: tuple[str, ...] = field(_held_labels, default=())
    """Labels the session holds from its start (beside a snapshot's): as ``RunJob.labels``."""


@struct
class CloseSession(Message):
    TYPE = "CloseSession"
    session_id: str = field(_session_id)


@struct
class SnapshotSession(Message):
    """Take a snapshot of an idle session (its state and files); answered ``SnapshotTaken``."""

    TYPE = "SnapshotSession"
    ref: int = field(_ref)
    session_id: str = field(_session_id)
    ttl_s: float | None = field(optional(number(1, 1 << 31)), default=None)
    """How long the daemon keeps it (at most the policy's ``session.snapshot_ttl_s``)."""


@struct
class PauseSession(Message):
    """Pause an idle session to disk now: its jail ends; answered ``SessionPaused``."""

    TYPE = "PauseSession"
    ref: int = field(_ref)
    session_id: str = field(_session_id)


@struct
class ResumeSession(Message):
    """Bring a paused session back in a fresh jail; answered ``SessionOpened``."""

    TYPE = "ResumeSession"
    ref: int = field(_ref)
    session_id: str = field(_session_id)


@struct
class ListSnapshots(Message):
    """The caller's own snapshots (``jaild snapshots``); answered ``SnapshotList``."""

    TYPE = "ListSnapshots"
    ref: int = field(_ref)


@struct
class ApproveCall(Message):
    """Decide a tool call that waits for approval (``ApprovalPending``; ``jaild approvals``):
    of a running or a parked run, from any connection of a principal the policy's
    ``[approvals] approvers`` name (the run's owner always may). Answered
    ``ApprovalRecorded``."""

    TYPE = "ApproveCall"
    ref: int = field(_ref)
    job_id: str = field(_job_id)
    call_id: int = field(_call_id)
    allow: bool = field(boolean())
    reason: str = field(string(1024), default="")


@struct
class ResumeRun(Message):
    """Be the tool host of a parked run of this principal's (its tools, as ``RunJob``'s):
    answered ``JobAccepted``; once its call is decided the run continues in a fresh jail
    and its messages (``CallTool``, ``JobOutput``, ``JobFinished``) come here."""

    TYPE = "ResumeRun"
    ref: int = field(_ref)
    job_id: str = field(_job_id)
    tools: tuple[ToolSpec, ...] = field(list_of(nested(ToolSpec), MAX_TOOLS), default=())


@struct
class ListApprovals(Message):
    """Calls waiting for an approval the caller may give; answered ``ApprovalList``."""

    TYPE = "ListApprovals"
    ref: int = field(_ref)


@struct
class DeleteSnapshot(Message):
    """Delete one of the caller's snapshots; answered ``SnapshotDeleted``."""

    TYPE = "DeleteSnapshot"
    ref: int = field(_ref)
    snapshot_id: str = field(_snapshot_id)


@struct
class ListJobs(Message):
    """What runs now (``jaild ps``): every job and session the caller may see."""

    TYPE = "ListJobs"
    ref: int = field(_ref)


@struct
class Kill(Message):
    """End a job or session by id, from any connection of its owner (or root)."""

    TYPE = "Kill"
    ref: int = field(_ref)
    id: str = field(string(64, min_len=1, pattern=JOB_ID))


@struct
class GetStats(Message):
    TYPE = "GetStats"
    ref: int = field(_ref)


@struct
class CancelJob(Message):
    TYPE = "CancelJob"
    job_id: str = field(_job_id)


@struct
class ListPolicies(Message):
    TYPE = "ListPolicies"
    ref: int = field(_ref)


@struct
class ClientToolReturned(Message):
    TYPE = "ToolReturned"
    job_id: str = field(_job_id)
    call_id: int = field(_call_id)
    value: bytes = field(_payload)
    labels: tuple[str, ...] = field(list_of(string(64, min_len=1, pattern=LABEL), MAX_LABELS),
                                    default=())
    """Labels of this result (beside the tool's own and the policy's; docs/using/flow.md)."""


@struct
class ClientToolFailed(Message):
    TYPE = "ToolFailed"
    job_id: str = field(_job_id)
    call_id: int = field(_call_id)
    error_type: str = field(string(256, min_len=1))
    message: str = field(_text)


@struct
class JobAccepted(Message):
    TYPE = "JobAccepted"
    ref: int = field(_ref)
    job_id: str = field(_job_id)
    session_id: str | None = field(optional(_session_id), default=None)
    """A resumed parked run of a session (``ResumeRun``): once it goes on, the session is this
    connection's."""


@struct
class JobOutput(Message):
    TYPE = "JobOutput"
    job_id: str = field(_job_id)
    stream: str = field(one_of("stdout", "stderr"))
    data: bytes = field(_payload)


@struct
class ClientCallTool(Message):
    TYPE = "CallTool"
    job_id: str = field(_job_id)
    call_id: int = field(_call_id)
    name: str = field(_name)
    args: bytes = field(_payload)
    approval: bool = field(boolean(), default=False)
    """Ask the client's approval callback first; a denial answers ``ToolFailed`` (``denied``)."""


@struct
class JobFinished(Message):
    TYPE = "JobFinished"
    job_id: str = field(_job_id)
    record: JobRecord = field(nested(JobRecord))
    result: bytes | None = field(optional(_payload), default=None)
    files: dict[str, bytes] = field(_files, default_factory=dict)


@struct
class SessionOpened(Message):
    TYPE = "SessionOpened"
    ref: int = field(_ref)
    session_id: str = field(_session_id)
    record: SessionInfo = field(nested(SessionInfo))


@struct
class SessionClosed(Message):
    """The session is gone: closed by its client, expired, killed, or ended by a run."""

    TYPE = "SessionClosed"
    session_id: str = field(_session_id)
    reason: str = field(string(64, min_len=1))
    message: str = field(_text, default="")


@struct
class SnapshotTaken(Message):
    TYPE = "SnapshotTaken"
    ref: int = field(_ref)
    snapshot: SnapshotEntry = field(nested(SnapshotEntry))


@struct
class SessionPaused(Message):
    """The session is paused to disk: asked (``ref``), or after its ``pause_after_s`` idle
    (``ref`` 0). Its next run needs ``ResumeSession`` first."""

    TYPE = "SessionPaused"
    ref: int = field(_ref)
    session_id: str = field(_session_id)
    bytes: int = field(integer(0, 1 << 40))


@struct
class SnapshotList(Message):
    TYPE = "SnapshotList"
    ref: int = field(_ref)
    snapshots: tuple[SnapshotEntry, ...] = field(list_of(nested(SnapshotEntry), 1 << 16))


@struct
class SnapshotDeleted(Message):
    TYPE = "SnapshotDeleted"
    ref: int = field(_ref)
    snapshot_id: str = field(_snapshot_id)


@struct
class ApprovalPending(Message):
    """A call of this connection's run waits for approval (the policy's approvers decide:
    ``ApproveCall``). The client library asks its ``approve`` callback and answers."""

    TYPE = "ApprovalPending"
    job_id: str = field(_job_id)
    call_id: int = field(_call_id)
    name: str = field(_name)
    args: bytes = field(_payload)


@struct
class RunParked(Message):
    """The run waited longer than its policy's ``approvals.park_after_s``: its jail is gone
    and it is kept on disk until its call is decided. It goes on by itself on this
    connection, or on any of the owner's (``ResumeRun``) after this one ends."""

    TYPE = "RunParked"
    job_id: str = field(_job_id)
    call_id: int = field(_call_id)
    message: str = field(_text, default="")
    session_id: str | None = field(optional(_session_id), default=None)
    """A session's run: the session is paused with it (its runs wait until it goes on)."""


@struct
class ApprovalRecorded(Message):
    TYPE = "ApprovalRecorded"
    ref: int = field(_ref)
    job_id: str = field(_job_id)
    call_id: int = field(_call_id)
    allow: bool = field(boolean())


@struct
class ApprovalList(Message):
    TYPE = "ApprovalList"
    ref: int = field(_ref)
    approvals: tuple[ApprovalEntry, ...] = field(list_of(nested(ApprovalEntry), 1 << 16))


@struct
class JobList(Message):
    TYPE = "JobList"
    ref: int = field(_ref)
    jobs: tuple[JobEntry, ...] = field(list_of(nested(JobEntry), 1 << 16))


@struct
class Killed(Message):
    TYPE = "Killed"
    ref: int = field(_ref)
    id: str = field(string(64, min_len=1, pattern=JOB_ID))
    kind: str = field(one_of("job", "session"))


@struct
class Stats(Message):
    TYPE = "Stats"
    ref: int = field(_ref)
    stats: DaemonStats = field(nested(DaemonStats))


@struct
class PolicyList(Message):
    TYPE = "PolicyList"
    ref: int = field(_ref)
    policies: tuple[PolicyEntry, ...] = field(list_of(nested(PolicyEntry), 1024))


@struct
class Error(Message):
    TYPE = "Error"
    code: str = field(string(64, min_len=1))
    message: str = field(_text)
    ref: int | None = field(optional(_ref), default=None)
    job_id: str | None = field(optional(_job_id), default=None)


# --------------------------------------------------------------------------- jail link


@struct
class Harden(Message):
    """Supervisor -> jail, first frame: how the runtime must lock itself down."""

    TYPE = "Harden"
    protocol: int = field(integer(0, 1 << 16))
    seccomp: dict[str, Any] = field(any_map())
    file_limits: dict[str, int] = field(
        map_of(string(64, min_len=1), integer(0, 1 << 40), 16), default_factory=dict
    )
    """The policy's ``[files]`` limits, for every run of this jail."""
    network: NetworkRefusal | None = field(optional(nested(NetworkRefusal)), default=None)
    """Set when the policy has no network: the runtime refuses network attempts of the job's
    interpreter with a ``PermissionError`` that says why, and counts them."""


@struct
class JailReady(Message):
    """Jail -> supervisor: hardened; waiting for code."""

    TYPE = "JailReady"
    protocol: int = field(integer(0, 1 << 16))
    python: str = field(string(256), default="")
    seccomp_digest: str = field(string(128), default="")


@struct
class RunCode(Message):
    TYPE = "RunCode"
    job: JobDescription = field(nested(JobDescription))
    """The client's job as admitted (a session's run: with the session's tools)."""
    tool_payload_bytes: int = field(integer(0, MAX_PAYLOAD_BYTES))
    result_bytes: int = field(integer(0, MAX_PAYLOAD_BYTES))
    keep: bool = field(boolean(), default=False)
    """A session's jail: after ``CodeFinished`` wait for the next ``RunCode``, same namespace."""
    snapshot: bool = field(boolean(), default=False)
    """Run no code: answer ``CodeFinished`` whose result is the session's snapshot (its
    state and working directory, at most ``result_bytes``; :mod:`jaild.runtime.snapshot`)."""
    restore: bytes | None = field(optional(_payload), default=None)
    """Run no code: restore this snapshot into the (fresh) session first."""


@struct
class JailCallTool(Message):
    TYPE = "CallTool"
    call_id: int = field(_call_id)
    name: str = field(_name)
    args: bytes = field(_payload)


@struct
class JailToolReturned(Message):
    TYPE = "ToolReturned"
    call_id: int = field(_call_id)
    value: bytes = field(_payload)


@struct
class JailToolFailed(Message):
    TYPE = "ToolFailed"
    call_id: int = field(_call_id)
    error_type: str = field(string(256, min_len=1))
    message: str = field(_text)


@struct
class CodeFinished(Message):
    """Jail -> supervisor: the runtime's own account. The daemon decides the status."""

    TYPE = "CodeFinished"
    ok: bool = field(boolean())
    result: bytes | None = field(optional(_payload), default=None)
    error: ErrorInfo | None = field(optional(nested(ErrorInfo)), default=None)
    files: Any = field(any_value(8), default=None)
    """What the runtime collected from the working directory (nil: nothing to report);
    hostile until the daemon's :func:`jaild.runtime.files.validate_collected` has looked at
    it."""
    network_refused: int = field(_ref, default=0)
    """Network attempts of this run that the runtime refused (``Harden.network``): the jail's
    own count."""


# --------------------------------------------------------------------------- tables

Link = Literal["client", "jail"]
Direction = Literal["client->daemon", "daemon->client", "daemon->jail", "jail->daemon"]

MESSAGES: dict[Direction, dict[str, type[Message]]] = {
    "client->daemon": {
        m.TYPE: m
        for m in (
            Hello,
            RunJob,
            CancelJob,
            ListPolicies,
            ClientToolReturned,
            ClientToolFailed,
            OpenSession,
            CloseSession,
            ListJobs,
            Kill,
            GetStats,
            SnapshotSession,
            PauseSession,
            ResumeSession,
            ListSnapshots,
            DeleteSnapshot,
            ApproveCall,
            ResumeRun,
            ListApprovals,
            Ping,
            Pong,
        )
    },
    "daemon->client": {
        m.TYPE: m
        for m in (
            Welcome,
            JobAccepted,
            JobOutput,
            ClientCallTool,
            JobFinished,
            PolicyList,
            Error,
            SessionOpened,
            SessionClosed,
            JobList,
            Killed,
            Stats,
            SnapshotTaken,
            SessionPaused,
            SnapshotList,
            SnapshotDeleted,
            ApprovalPending,
            RunParked,
            ApprovalRecorded,
            ApprovalList,
            Ping,
            Pong,
        )
    },
    "daemon->jail": {m.TYPE: m for m in (Harden, RunCode, JailToolReturned, JailToolFailed)},
    "jail->daemon": {m.TYPE: m for m in (JailReady, JailCallTool, CodeFinished)},
}
"""Every message, by the direction it travels. ``proto/PROTOCOL.md`` documents exactly these."""


# --------------------------------------------------------------------------- frame sizes

FRAME_OVERHEAD = 4 * 2 * MAX_MESSAGE_CHARS + MAX_MESSAGE_CHARS
"""Room on the jail link beyond the payload limits: ``CodeFinished`` may carry a message and
a traceback of ``MAX_MESSAGE_CHARS`` each besides the result (UTF-8: up to 4 bytes a
character), plus the rest of the frame."""


def jail_link_max_frame(
    *,
    tool_payload_bytes: int,
    result_bytes: int,
    max_bytes: int,
    max_files: int,
    max_path_chars: int,
) -> int:
    """The supervisor's maximum frame size on a job's jail link (PROTOCOL.md section 2).

    Args:
        tool_payload_bytes, result_bytes: the job's limits of those names.
        max_bytes, max_files, max_path_chars: the policy's ``[files]`` limits (what
            ``CodeFinished.files`` may carry: contents, and a listing entry per file).
    """
    return (
        max(tool_payload_bytes, result_bytes)
        + FRAME_OVERHEAD
        + max_bytes
        + max_files * (max_path_chars + 256)
    )


# --------------------------------------------------------------------------- encode / decode


def safe_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` made fit for a string field: lone surrogates escaped, the tail kept if too long."""
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    marker = "...[truncated]...\n"
    return marker + text[-(limit - len(marker)) :]


def pack(value: Any) -> bytes:
    """Pack a plain value. Per object, what msgpack cannot carry is converted: sets become
    lists, numpy scalars and 0-d arrays the Python number (``bool``, ``int``, ``float``) or
    string they hold, anything else its ``repr``."""
    packed: bytes = msgpack.packb(
        value, use_bin_type=True, default=_repr_fallback, strict_types=False
    )
    return packed


_NOT_PLAIN = object()
_PLAIN_ITEMS = (bool, int, float, str, bytes)
_MSGPACK_INTS = range(-(1 << 63), 1 << 64)


def _numpy_item(obj: Any) -> Any:
    """``obj``'s plain value if it is a numpy scalar or 0-d array holding a bool, number or
    string (``np.int64(6)`` -> ``6``), else ``_NOT_PLAIN``. Duck-typed (``.ndim``, ``.item()``
    on a type of the ``numpy`` module): the protocol never imports numpy, which a jail's
    environment may not have. ``np.float64`` is a ``float`` and never comes here."""
    if getattr(type(obj), "__module__", None) != "numpy":
        return _NOT_PLAIN
    try:
        if obj.ndim != 0:
            return _NOT_PLAIN
        value = obj.item()
    except Exception:
        return _NOT_PLAIN
    if type(value) not in _PLAIN_ITEMS or (type(value) is int and value not in _MSGPACK_INTS):
        return _NOT_PLAIN  # complex, datetime, longdouble, an object array's object, ...
    return value


def _repr_fallback(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    value = _numpy_item(obj)
    if value is not _NOT_PLAIN:
        return value
    return repr(obj)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack(data: bytes) -> Any:
    """Unpack bytes from an untrusted peer. Raises RemoteProtocolError on any failure."""
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=False, ext_hook=_no_ext, timestamp=0, use_list=True
        )
    except Exception as exc:
        raise RemoteProtocolError(f"undecodable msgpack: {exc}") from None


def encode(msg: Message) -> bytes:
    """Message -> msgpack payload (unframed).

    A ``Harden`` is encoded once: the daemon builds one per policy and sends that very
    message, unchanged, as the first frame to every jail of the policy; its seccomp spec
    alone is some 5 KB of nested lists that took a fifth of a millisecond to pack each time.
    Later sends of the same object reuse the bytes (:data:`_ENCODED`)."""
    if type(msg) is Harden:
        known = _ENCODED.get(id(msg))
        if known is not None and known[0] is msg:
            return known[1]
        packed: bytes = msgpack.packb(msg.to_wire(), use_bin_type=True)
        if len(_ENCODED) >= _MAX_ENCODED:
            _ENCODED.clear()
        _ENCODED[id(msg)] = (msg, packed)
        return packed
    packed = msgpack.packb(msg.to_wire(), use_bin_type=True)
    return packed


_ENCODED: dict[int, tuple[Message, bytes]] = {}
"""``id(message)`` -> (the message, its payload): the ``Harden`` messages :func:`encode` has
seen, each kept alive here so that its id is not reused. A message is frozen; a ``Harden``'s
seccomp map is the compiler's and nobody changes it once the message is built."""
_MAX_ENCODED = 256
"""More than any daemon's policies (a reload builds new ones): then the memo starts over."""


_remembered: tuple[bytes, Direction, Message] | None = None


def remember(payload: bytes, direction: Direction) -> Message:
    """Decode ``payload`` (a message of ``direction``) now, and answer every later
    :func:`decode` of the same bytes in the same direction with that same message.

    A zygote remembers the ``Harden`` frame its jails will be sent
    (:class:`jaild.protocol.zygote_link.PrepareJails`): each forked jail then checks the
    frame it receives byte for byte against it instead of decoding and checking its fields
    again, and loads the filters its zygote built for that very message. Messages are
    frozen, so sharing one is safe. One payload is remembered at a time.
    """
    global _remembered
    msg = decode(payload, direction)
    _remembered = (bytes(payload), direction, msg)
    return msg


def decode(payload: bytes, direction: Direction) -> Message:
    """msgpack payload -> Message of ``direction``, or RemoteProtocolError. Never anything else."""
    known = _remembered
    if known is not None and known[1] == direction and payload == known[0]:
        return known[2]
    return decode_from(payload, MESSAGES[direction], direction)


def decode_from(payload: bytes, table: Mapping[str, type[Message]], direction: str) -> Message:
    """msgpack payload -> one of the messages in ``table`` (by wire name; ``direction`` names
    the table in errors), or RemoteProtocolError. Never anything else. Every link decodes here."""
    data = unpack(payload)
    if type(data) is not dict:
        raise RemoteProtocolError(f"a message must be a map, got {type(data).__name__}")
    kind = data.pop("type", None)
    if type(kind) is not str or kind not in table:
        raise RemoteProtocolError(
            f"unknown message type {kind!r} for {direction}; expected one of {sorted(table)}"
        )
    try:
        return table[kind].from_wire(data)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"invalid {kind}: {exc.message}") from None
    except (TypeError, ValueError, RecursionError, MemoryError) as exc:
        raise RemoteProtocolError(f"invalid {kind}: {exc}") from None
