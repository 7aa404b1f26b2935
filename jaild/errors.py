"""Every error jaild raises, and the one map from errors to exit statuses.

Two kinds live here:

* **Coded errors** (:class:`JaildError` and its subclasses). Each wire error
  code maps 1:1 to one class (``ERROR_CLASSES``); a peer that receives
  ``Error{code, message}`` rebuilds the same class with :func:`error_from_wire`.
  Two codes are local only (``local_protocol_error``, ``invalid_policy``).
* **Local errors**, which never cross a process boundary as an ``Error``: the
  daemon's startup and host failures, the jail's setup and hardening failures,
  refused file paths, tool failures as the jailed code sees them, and the front
  ends' own errors. They keep the builtin base their callers catch them by
  (``RuntimeError`` for "this host or process cannot go on", ``ValueError`` for
  "this input is refused"), and carry no wire code.

Messages say what happened, which limit or field was involved, and what to do
about it. Untrusted text (a path the jail chose) goes into a message through
:func:`display`.

Whose fault it is matters (h11's lesson):

* :class:`LocalProtocolError` -- *we* tried to send something illegal (a bug
  in our own code). It never goes on the wire.
* :class:`RemoteProtocolError` and its subclasses -- the *peer* sent garbage.
  The single receive boundary of the protocol turns every decoding failure
  into one of these, so callers never see a foreign exception.

This module imports nothing but the standard library: the in-jail runtime
uses it.
"""

from __future__ import annotations

from typing import ClassVar

MAX_DISPLAY_CHARS = 512
"""A refused path or reason is clipped to this many characters for display."""


def display(text: str, limit: int = MAX_DISPLAY_CHARS) -> str:
    """``text`` made safe to show on one line: undecodable bytes (surrogate escapes)
    as ``\\xNN``; control, format (such as right-to-left overrides), separator and
    other unprintable characters as ``\\xNN``/``\\uNNNN``; clipped to ``limit``."""
    if text.isprintable() and len(text) <= limit:
        return text
    out = []
    for c in text:
        o = ord(c)
        if c.isprintable():
            out.append(c)
        elif 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        elif o <= 0xFF:
            out.append(f"\\x{o:02x}")
        elif o <= 0xFFFF:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."



class JaildError(Exception):
    """Base of all jaild errors. ``code`` is the stable wire code."""

    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class InternalError(JaildError):
    """jaild itself failed (a bug, or the host cannot run jails)."""

    code = "internal_error"


class LocalProtocolError(JaildError):
    """We tried to send a message that is illegal here. Always a jaild bug; never sent."""

    code = "local_protocol_error"


class RemoteProtocolError(JaildError):
    """The peer sent bytes or a message that break the protocol."""

    code = "bad_frame"


class FrameTooLarge(RemoteProtocolError):
    """A frame header announced more bytes than the link allows (checked before buffering)."""

    code = "frame_too_large"


class UnexpectedMessage(RemoteProtocolError):
    """A well-formed message that is not allowed in the link's current state."""

    code = "unexpected_message"


class ReadTimeout(RemoteProtocolError):
    """The peer started a frame (or connected) and did not finish it in time."""

    code = "read_timeout"


class UnsupportedVersion(RemoteProtocolError):
    """The peer speaks a protocol version we do not."""

    code = "unsupported_version"


class BadRequest(JaildError):
    """A valid message whose content the daemon refuses (bad limit, oversize code, ...)."""

    code = "bad_request"


class UnknownPolicy(JaildError):
    """The daemon serves no policy of that name (``jaild policies`` lists those it does)."""

    code = "unknown_policy"


class UnknownJob(JaildError):
    """No job, session or waiting call of that id is yours (another principal's is unknown too)."""

    code = "unknown_job"


class PolicyUnavailable(JaildError):
    """The policy exists but failed its self-test at daemon start; the message says why."""

    code = "policy_unavailable"


class UnknownSession(JaildError):
    """No open session of that id on this connection."""

    code = "unknown_session"


class SessionClosed(JaildError):
    """The session ended (closed, expired, killed, or a run hit a limit).

    ``reason`` is why, as the session's ``closed`` says it: ``closed``, ``idle``,
    ``lifetime``, ``killed``, ``disconnected``, ``shutdown`` or the status of the run that
    ended it (``timeout``, ``memory_limit``, ...); None when the session was never open."""

    code = "session_closed"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class PermissionDenied(JaildError):
    """Who you are may not do this: connect, use the policy, approve the call; the
    message names the rule."""

    code = "permission_denied"


class SessionPaused(JaildError):
    """The session is paused to disk (its jail is gone): ``ResumeSession`` brings it back.
    The client library resumes it before its next run by itself."""

    code = "session_paused"


class UnknownSnapshot(JaildError):
    """No snapshot of this principal has that id (another principal's is unknown too)."""

    code = "unknown_snapshot"


class SnapshotFailed(JaildError):
    """A snapshot could not be taken or restored; the message names what stopped it."""

    code = "snapshot_failed"


class QuotaExceeded(JaildError):
    """The principal would exceed one of the daemon's quotas per principal: its snapshots'
    disk or count, or its runs parked for approval (their count, their journals' bytes). The
    message names the quota's key, the principal's use and the limit."""

    code = "quota_exceeded"


class Busy(JaildError):
    """The daemon is at its concurrency limit; retry later."""

    code = "busy"


class ShuttingDown(JaildError):
    """The daemon is stopping and takes no new work; another daemon (or this one, restarted) may."""

    code = "shutting_down"


class Starting(JaildError):
    """The daemon is still starting (its zygotes, self-tests or pools are not up yet) and a
    request that needs a jail waited for it as long as the daemon lets one wait
    (``limits.startup_wait_s``, also told in ``Welcome.starting``). The message names what
    the daemon is still doing and the bound; retry later."""

    code = "starting"


class PolicyError(JaildError):
    """A policy file is invalid. The message names file, key path and reason."""

    code = "invalid_policy"

    def __init__(self, path: str, key: str, reason: str) -> None:
        self.path = path
        self.key = key
        self.reason = reason
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {reason}")
        self.errors: list[PolicyError] = [self]
        """Every problem of the file (see :meth:`every`); this one alone otherwise."""

    @classmethod
    def every(cls, errors: list[PolicyError]) -> PolicyError:
        """All of a file's problems as one error: the first's path, key and reason, and a
        message of one ``file: key: reason`` line per problem."""
        first = errors[0]
        combined = cls(first.path, first.key, first.reason)
        combined.errors = list(errors)
        combined.message = "\n".join(e.message for e in errors)
        combined.args = (combined.message,)
        return combined


class DaemonUnavailable(JaildError):
    """The client could not reach a daemon at the socket it was given."""

    code = "daemon_unavailable"


class ConnectionLost(JaildError):
    """The connection to the daemon broke while requests were outstanding.

    ``reason`` says how it was found out: ``closed`` (the daemon closed it, or the
    client did), ``reset`` (the transport failed), ``timeout`` (the daemon answered no
    ping within the liveness bound: dead, frozen or partitioned away) or ``invalid``
    (it sent bytes that are not the protocol)."""

    code = "connection_lost"

    def __init__(self, message: str, reason: str = "closed") -> None:
        super().__init__(message)
        self.reason = reason


class NodeLost(ConnectionLost):
    """A fleet's node was lost with this job on it (:mod:`jaild.fleet`): the job's outcome
    is unknown -- it may have run, in part or whole. A job not marked idempotent is never
    run again; ``node`` names the endpoint."""

    code = "node_lost"

    def __init__(self, message: str, reason: str = "closed", node: str = "") -> None:
        super().__init__(message, reason)
        self.node = node


class SessionLost(ConnectionLost):
    """The connection that held a session was lost: the session, its jail and its state
    are gone (a session lives on one node and is never moved)."""

    code = "session_lost"

    def __init__(self, message: str, reason: str = "closed", node: str = "") -> None:
        super().__init__(message, reason)
        self.node = node


# ----------------------------------------------------------------------------- local errors
# None of these is sent as an ``Error``: they carry no wire code.


class StartupError(RuntimeError):
    """The daemon cannot start; the message lists every reason.

    A front end that starts a private daemon (:mod:`jaild.daemon.private`) turns it into
    :class:`DaemonUnavailable`; ``jaild serve`` and ``jaild doctor`` report it as it is.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MetricsAddressError(StartupError):
    """``daemon.metrics_address`` cannot be served (unparseable, unresolvable, in use).

    Raised at startup only.
    """


class TracingError(StartupError):
    """The ``OTEL_*`` environment asks for traces that cannot be exported: the OpenTelemetry
    SDK is not installed (``pip install 'jaild[otel]'``), an exporter is unknown, or an OTLP
    protocol other than ``http/protobuf`` is named. Raised at start-up: the daemon refuses to
    start, ``jaild codemode`` and ``jaild mcp`` to run (docs/using/tracing.md)."""


class CgroupError(RuntimeError):
    """The host's cgroups cannot be used as configured (the message says how to fix it)."""


class ZygoteError(RuntimeError):
    """A policy's zygote could not be started, or died."""


class SetupFailed(RuntimeError):
    """(In a zygote's child.) The jail could not be set up; no user code runs."""


class HardeningFailed(RuntimeError):
    """The jail is not as locked down as the policy requires; no user code may run."""


class SeccompSpecError(ValueError):
    """A seccomp spec is malformed (a daemon bug, or a hostile Harden)."""


class Unsplittable(ValueError):
    """A seccomp spec gives a call a zygote needs a verdict that a jail's own filter cannot
    rebuild (:mod:`jaild.runtime.zygote_filter`): its jails load it whole."""


class SyscallNameError(ValueError):
    """An entry of allow/deny is not a known syscall or group, or may never be allowed."""


class EgressRuleError(ValueError):
    """An egress allow-list entry (or a target) that is not a host name or address literal,
    with why (``jaild.policy.egress``)."""


class EgressRefusal(Exception):
    """(Inside the egress gateway.) A request the gateway answers itself: an HTTP
    ``status``, a ``kind`` for the job's usage and the audit, and a message a model can
    act on."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class SnapshotError(Exception):
    """(In the jail.) A snapshot could not be taken or restored; the message names what
    (the daemon answers the client :class:`SnapshotFailed` with it)."""


class RedactionFailed(Exception):
    """(In the daemon.) A run's redaction could not finish (too deep, too much work, out of
    time): what it was redacting is withheld (jaild.policy.redact)."""


class JournalDamaged(Exception):
    """(In the daemon.) A durable run's journal on disk is not what the daemon wrote: cut
    short, or bytes that do not decode as its entries. The message names the file, the
    byte offset and what was wrong; the run is stopped (or, at start, dropped) rather than
    replayed from it."""


class UploadError(ValueError):
    """An upload was refused: ``path`` (the jail path, or ``""``) and ``reason``."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"upload '{display(path)}': {reason}" if path else f"upload: {reason}")


class UnsafePath(ValueError):
    """A downloaded file was not written: ``path`` (as the jail named it) and ``reason``.
    Nothing of that call to :func:`jaild.transfer.save_files` was written, unless the tree
    changed under it while it wrote."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"refusing to save '{display(path)}': {reason}" if path else f"refusing: {reason}"
        )


class ToolError(Exception):
    """(In the jail.) A tool call failed on the host side (or was refused by the daemon).

    Attributes: ``tool`` (name), ``error_type`` (the host exception's type name,
    or a jaild reason such as ``payload_too_large``), ``message``.
    """

    def __init__(self, tool: str, error_type: str, message: str) -> None:
        super().__init__(f"{tool}: {error_type}: {message}")
        self.tool = tool
        self.error_type = error_type
        self.message = message


class UnknownToolError(ToolError, AttributeError, KeyError):
    """No tool of that name. Also an AttributeError/KeyError, so hasattr/`in` work."""

    def __str__(self) -> str:
        return str(self.args[0])


class ToolCallDenied(Exception):
    """(In the client.) The approval callback said no; the jail gets ``ToolError`` with
    ``error_type == "denied"`` and this message."""


class ProviderError(Exception):
    """A tool provider could not be loaded or started; the message names it and says why."""


class ConfigError(ProviderError, ValueError):
    """A provider source is invalid: ``file: key.path: reason``."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        super().__init__(f"{source}: {key}: {reason}" if key else f"{source}: {reason}")
        self.source = source
        self.key = key
        self.reason = reason


class McpToolError(Exception):
    """An MCP tool answered with ``isError``; the message is the tool's error text.

    In the jail it surfaces as ``ToolError`` with ``error_type == "McpToolError"``."""


class MissingExtra(ImportError):
    """A part of jaild that needs an extra the install lacks: ``jaild mcp`` without
    ``jaild[mcp]``. The message is the one line a front end prints, with the pip command
    (:func:`jaild.extras.require`)."""

    def __init__(self, what: str, extra: str) -> None:
        self.what = what
        self.extra = extra
        self.message = f"{what} needs jaild[{extra}]: pip install 'jaild[{extra}]'"
        super().__init__(self.message)


class McpServerError(Exception):
    """An MCP server could not answer a call (not connected, gone, protocol error)."""


class SentAndLost(Exception):
    """(Inside :mod:`jaild.fleet`.) A job's ``RunJob`` was sent to ``endpoint``, whose
    connection was then lost before the daemon's answer: the job may have started."""

    def __init__(self, error: ConnectionLost, endpoint: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.endpoint = endpoint


class PeerUnverified(Exception):
    """(Daemon side, pods as tenants.) The connecting process could not be tied to its
    cgroup; :attr:`reason` says why (it exited, its pid is not the one that holds the
    connection, ...). The client is refused ``permission_denied``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KubeAPIError(Exception):
    """(Daemon side.) The Kubernetes API answered with an error (``status``: its HTTP status
    or Status code), or cannot be reached."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class KubeAPIGone(KubeAPIError):
    """(Daemon side.) A watch's resourceVersion is too old (410 Gone): list again."""


class EnvError(Exception):
    """``jaild env`` could not do what was asked; the message says why and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def exit_code(self) -> int:
        """The command's exit status for this error (:data:`EXIT_CODES`)."""
        return exit_code_for(self)


class EnvUsageError(EnvError):
    """The command line itself is wrong (a bad name, a missing file, an unusable --python)."""


ERROR_CLASSES: dict[str, type[JaildError]] = {
    cls.code: cls
    for cls in (
        InternalError,
        RemoteProtocolError,
        FrameTooLarge,
        UnexpectedMessage,
        UnsupportedVersion,
        ReadTimeout,
        BadRequest,
        UnknownPolicy,
        PolicyUnavailable,
        UnknownJob,
        UnknownSession,
        SessionClosed,
        SessionPaused,
        UnknownSnapshot,
        SnapshotFailed,
        QuotaExceeded,
        PermissionDenied,
        Busy,
        ShuttingDown,
        Starting,
        DaemonUnavailable,
        ConnectionLost,
    )
}
"""Wire code -> class. ``invalid_policy`` is local only (its constructor takes three parts)."""


def error_from_wire(code: str, message: str) -> JaildError:
    """Rebuild the error a peer reported. Unknown codes become :class:`InternalError`."""
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return InternalError(f"{code}: {message}")
    return cls(message)


# ----------------------------------------------------------------------------- exit statuses

EXIT_FAILURE = 1
"""The command could not do what was asked (a job's own statuses are ``jaild run``'s)."""
EXIT_USAGE = 2
"""The command line, or a file it names, is wrong."""
EXIT_REFUSED = 65
"""The daemon answered and refused the request (unknown policy, looser limits, busy, ...)."""
EXIT_UNAVAILABLE = 69
"""No usable daemon: none at the socket, it went away, it is shutting down or still
starting, it speaks another protocol, or a private daemon could not start."""

EXIT_CODES: dict[type[Exception], int] = {
    JaildError: EXIT_REFUSED,
    DaemonUnavailable: EXIT_UNAVAILABLE,
    ConnectionLost: EXIT_UNAVAILABLE,
    ShuttingDown: EXIT_UNAVAILABLE,
    Starting: EXIT_UNAVAILABLE,
    RemoteProtocolError: EXIT_UNAVAILABLE,
    ProviderError: EXIT_FAILURE,
    ConfigError: EXIT_USAGE,
    EnvError: EXIT_FAILURE,
    EnvUsageError: EXIT_USAGE,
    MissingExtra: EXIT_FAILURE,
}
"""The one map from an error to the exit status of the command that met it, used by every
front end (``jaild run``, ``session``, ``mcp``, ``codemode``, ``env``). The most specific
class listed wins: ``UnknownPolicy`` is a ``JaildError`` (65), ``UnsupportedVersion`` a
``RemoteProtocolError`` (69)."""


def exit_code_for(error: BaseException) -> int:
    """The exit status for ``error``: its most specific class in :data:`EXIT_CODES`.

    Args:
        error: what the command met.
    Returns:
        The exit status; :data:`EXIT_FAILURE` for an error the map does not list.
    """
    for cls in type(error).__mro__:
        code = EXIT_CODES.get(cls)
        if code is not None:
            return code
    return EXIT_FAILURE


def error_line(error: JaildError) -> str:
    """How a front end shows ``error`` before exiting with :func:`exit_code_for`: its
    message, after its code unless the message says it all (no daemon at the socket)."""
    if isinstance(error, DaemonUnavailable):
        return error.message
    return f"{error.code}: {error.message}"


# ----------------------------------------------------------------------------- the reference

MET_OUTSIDE_THE_TREE: tuple[type[Exception], ...] = (
    ToolError, UnknownToolError, ToolCallDenied, UploadError, UnsafePath, ProviderError,
    ConfigError, MissingExtra, EnvError, EnvUsageError, StartupError,
)
"""What a user meets that is not a :class:`JaildError`: in the jail (a tool's failure), in
the client (a file to upload), in a front end (a provider, an extra, ``jaild env``) and at
the daemon's start."""


def reference_markdown() -> str:
    """Every error a user meets, as a Markdown table: its class, its wire code (if it
    crosses the wire), the exit status of a ``jaild`` command that meets it, and its meaning
    (the first line of its docstring). docs/using/errors.md holds it; a test keeps it in
    sync (``scripts/update_doc_references.py`` writes it)."""
    import re  # here: the in-jail runtime imports this module, and needs no regex

    def tree(cls: type[JaildError]) -> list[type[JaildError]]:
        found = [cls]
        for sub in cls.__subclasses__():
            found += tree(sub)
        return found

    rows = ["| exception | wire code | exit status | what it means |", "|---|---|---|---|"]
    for cls in (*tree(JaildError), *MET_OUTSIDE_THE_TREE):
        code = getattr(cls, "code", "") if cls in ERROR_CLASSES.values() else ""
        meaning = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        meaning = re.sub(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"``\1``", meaning)
        meaning = meaning.replace("|", "\\|").replace("``", "`")
        rows.append(f"| `{cls.__module__}.{cls.__qualname__}` | {f'`{code}`' if code else '--'} "
                    f"| {exit_code_for(cls.__new__(cls))} | {meaning} |")
    return "\n".join(rows) + "\n"
