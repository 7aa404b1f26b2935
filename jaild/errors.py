"""Every error jaild can report, with its stable wire code.

Each wire error code maps 1:1 to one class here (``ERROR_CLASSES``); a peer
that receives ``Error{code, message}`` rebuilds the same class with
:func:`error_from_wire`. Messages say what happened, which limit or field was
involved, and what to do about it.

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
    code = "unknown_policy"


class UnknownJob(JaildError):
    code = "unknown_job"


class PolicyUnavailable(JaildError):
    """The policy exists but failed its self-test at daemon start; the message says why."""

    code = "policy_unavailable"


class UnknownSession(JaildError):
    code = "unknown_session"


class SessionClosed(JaildError):
    """The session ended (closed, expired, killed, or a run hit a limit)."""

    code = "session_closed"


class PermissionDenied(JaildError):
    code = "permission_denied"


class Busy(JaildError):
    """The daemon is at its concurrency limit; retry later."""

    code = "busy"


class ShuttingDown(JaildError):
    code = "shutting_down"


class PolicyError(JaildError):
    """A policy file is invalid. The message names file, key path and reason."""

    code = "invalid_policy"

    def __init__(self, path: str, key: str, reason: str) -> None:
        self.path = path
        self.key = key
        self.reason = reason
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {reason}")


class DaemonUnavailable(JaildError):
    """The client could not reach a daemon at the socket it was given."""

    code = "daemon_unavailable"


class ConnectionLost(JaildError):
    """The connection to the daemon broke while requests were outstanding."""

    code = "connection_lost"


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
        PermissionDenied,
        Busy,
        ShuttingDown,
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
