"""Sans-IO connection state machine for both links.

Theory of operation
-------------------
A :class:`Connection` is one end of one link. It owns a frame decoder and a
state, and it has three verbs (after h11):

* ``receive_data(bytes)`` -- feed whatever the socket gave you (``b""`` = EOF);
* ``next_event()`` -- the next :class:`Message`, ``NEED_DATA``, or ``CLOSED``;
* ``send(message) -> bytes`` -- the framed bytes to write.

It never touches a socket: the daemon, the clients and the in-jail runtime wrap
it in their own IO (asyncio streams, blocking sockets, a reader thread).

Which message may travel in which state is the data table ``TRANSITIONS``
below: ``(role, state) -> {(verb, message type): next state}``. Anything not in
the table is illegal -- when *received* that is the peer's fault
(:class:`UnexpectedMessage`, a :class:`RemoteProtocolError`); when *sent* it is
ours (:class:`LocalProtocolError`). After a remote protocol error the
connection is broken: every further ``next_event`` raises the same error, so a
caller cannot accidentally keep parsing a desynchronised stream. The daemon end
may still send ``Error`` (state ``closed``) to tell the client why.

The version handshake happens in the first message each way (``Hello`` /
``Welcome`` on the client link, ``Harden`` / ``JailReady`` on the jail link):
a version other than :data:`PROTOCOL_VERSION` raises :class:`UnsupportedVersion`.

Until the handshake's first message has arrived, the daemon end accepts only frames of
at most :data:`HANDSHAKE_FRAME_BYTES` (64 KiB; a ``Hello`` is under 300 bytes): a peer
that has not said who it speaks to -- or that the daemon will refuse -- cannot make it
buffer a large frame. Past ``Hello`` the link's ``max_frame_bytes`` applies.
"""

from __future__ import annotations

import enum
from typing import Final

from jaild.errors import (
    FrameTooLarge,
    LocalProtocolError,
    RemoteProtocolError,
    UnexpectedMessage,
    UnsupportedVersion,
)
from jaild.protocol.framing import FrameDecoder, encode_frame
from jaild.protocol.messages import (
    MESSAGES,
    PROTOCOL_VERSION,
    Direction,
    Harden,
    Hello,
    JailReady,
    Message,
    Welcome,
    decode,
    encode,
)


class Role(enum.Enum):
    # Members are singletons compared by identity: hashed as objects, in C, not by their
    # name in Python (Enum's own __hash__) -- every frame looks up (role, state) twice.
    __hash__ = object.__hash__

    CLIENT = "client"  # client end of the client link
    DAEMON = "daemon"  # daemon end of the client link
    SUPERVISOR = "supervisor"  # daemon end of the jail link
    JAIL = "jail"  # runtime end of the jail link


class State(enum.Enum):
    __hash__ = object.__hash__  # as Role's

    # client link
    SEND_HELLO = "send-hello"
    AWAIT_WELCOME = "await-welcome"
    AWAIT_HELLO = "await-hello"
    SEND_WELCOME = "send-welcome"
    READY = "ready"
    # jail link
    SEND_HARDEN = "send-harden"
    AWAIT_READY = "await-ready"
    AWAIT_HARDEN = "await-harden"
    HARDENING = "hardening"
    AWAIT_CODE = "await-code"
    RUNNING = "running"
    FINISHED = "finished"
    # both
    CLOSED = "closed"


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"


NEED_DATA: Final = _Sentinel.NEED_DATA
CLOSED: Final = _Sentinel.CLOSED

SEND, RECV = "send", "recv"

# (role, state) -> {(verb, message type): next state}. Absent = illegal.
TRANSITIONS: dict[tuple[Role, State], dict[tuple[str, str], State]] = {
    # ---- client link, client end
    (Role.CLIENT, State.SEND_HELLO): {
        (SEND, "Hello"): State.AWAIT_WELCOME,
        # a refusal at the door, decided on accepting: it may arrive before Hello is sent
        (RECV, "Error"): State.CLOSED,
    },
    (Role.CLIENT, State.AWAIT_WELCOME): {
        (RECV, "Welcome"): State.READY,
        (RECV, "Error"): State.CLOSED,
    },
    (Role.CLIENT, State.READY): {
        (SEND, "OpenSession"): State.READY,
        (SEND, "CloseSession"): State.READY,
        (SEND, "ListJobs"): State.READY,
        (SEND, "Kill"): State.READY,
        (SEND, "GetStats"): State.READY,
        (RECV, "SessionOpened"): State.READY,
        (RECV, "SessionClosed"): State.READY,
        (RECV, "JobList"): State.READY,
        (RECV, "Killed"): State.READY,
        (RECV, "Stats"): State.READY,
        (SEND, "SnapshotSession"): State.READY,
        (SEND, "PauseSession"): State.READY,
        (SEND, "ResumeSession"): State.READY,
        (SEND, "ListSnapshots"): State.READY,
        (SEND, "DeleteSnapshot"): State.READY,
        (RECV, "SnapshotTaken"): State.READY,
        (RECV, "SessionPaused"): State.READY,
        (RECV, "SnapshotList"): State.READY,
        (RECV, "SnapshotDeleted"): State.READY,
        (SEND, "ApproveCall"): State.READY,
        (SEND, "ResumeRun"): State.READY,
        (SEND, "ListApprovals"): State.READY,
        (RECV, "ApprovalPending"): State.READY,
        (RECV, "RunParked"): State.READY,
        (RECV, "ApprovalRecorded"): State.READY,
        (RECV, "ApprovalList"): State.READY,
        (SEND, "RunJob"): State.READY,
        (SEND, "CancelJob"): State.READY,
        (SEND, "ListPolicies"): State.READY,
        (SEND, "ToolReturned"): State.READY,
        (SEND, "ToolFailed"): State.READY,
        (RECV, "JobAccepted"): State.READY,
        (RECV, "JobOutput"): State.READY,
        (RECV, "CallTool"): State.READY,
        (RECV, "JobFinished"): State.READY,
        (RECV, "PolicyList"): State.READY,
        (RECV, "Error"): State.READY,
        (SEND, "Ping"): State.READY,
        (RECV, "Ping"): State.READY,
        (SEND, "Pong"): State.READY,
        (RECV, "Pong"): State.READY,
    },
    # ---- client link, daemon end
    (Role.DAEMON, State.AWAIT_HELLO): {
        (RECV, "Hello"): State.SEND_WELCOME,
        (SEND, "Error"): State.AWAIT_HELLO,
    },
    # Welcome is the first thing the daemon says (or an Error refusing the client)
    (Role.DAEMON, State.SEND_WELCOME): {
        (SEND, "Welcome"): State.READY,
        (SEND, "Error"): State.SEND_WELCOME,
    },
    (Role.DAEMON, State.READY): {
        (RECV, "OpenSession"): State.READY,
        (RECV, "CloseSession"): State.READY,
        (RECV, "ListJobs"): State.READY,
        (RECV, "Kill"): State.READY,
        (RECV, "GetStats"): State.READY,
        (SEND, "SessionOpened"): State.READY,
        (SEND, "SessionClosed"): State.READY,
        (SEND, "JobList"): State.READY,
        (SEND, "Killed"): State.READY,
        (SEND, "Stats"): State.READY,
        (RECV, "SnapshotSession"): State.READY,
        (RECV, "PauseSession"): State.READY,
        (RECV, "ResumeSession"): State.READY,
        (RECV, "ListSnapshots"): State.READY,
        (RECV, "DeleteSnapshot"): State.READY,
        (SEND, "SnapshotTaken"): State.READY,
        (SEND, "SessionPaused"): State.READY,
        (SEND, "SnapshotList"): State.READY,
        (SEND, "SnapshotDeleted"): State.READY,
        (RECV, "ApproveCall"): State.READY,
        (RECV, "ResumeRun"): State.READY,
        (RECV, "ListApprovals"): State.READY,
        (SEND, "ApprovalPending"): State.READY,
        (SEND, "RunParked"): State.READY,
        (SEND, "ApprovalRecorded"): State.READY,
        (SEND, "ApprovalList"): State.READY,
        (RECV, "RunJob"): State.READY,
        (RECV, "CancelJob"): State.READY,
        (RECV, "ListPolicies"): State.READY,
        (RECV, "ToolReturned"): State.READY,
        (RECV, "ToolFailed"): State.READY,
        (SEND, "JobAccepted"): State.READY,
        (SEND, "JobOutput"): State.READY,
        (SEND, "CallTool"): State.READY,
        (SEND, "JobFinished"): State.READY,
        (SEND, "PolicyList"): State.READY,
        (SEND, "Error"): State.READY,
        (SEND, "Ping"): State.READY,
        (RECV, "Ping"): State.READY,
        (SEND, "Pong"): State.READY,
        (RECV, "Pong"): State.READY,
    },
    # after the client broke the protocol the daemon still owes it an Error saying why
    (Role.DAEMON, State.CLOSED): {(SEND, "Error"): State.CLOSED},
    # ---- jail link, supervisor (daemon) end
    (Role.SUPERVISOR, State.SEND_HARDEN): {(SEND, "Harden"): State.AWAIT_READY},
    (Role.SUPERVISOR, State.AWAIT_READY): {(RECV, "JailReady"): State.AWAIT_CODE},
    (Role.SUPERVISOR, State.AWAIT_CODE): {(SEND, "RunCode"): State.RUNNING},
    (Role.SUPERVISOR, State.RUNNING): {
        (RECV, "CallTool"): State.RUNNING,
        (RECV, "CodeFinished"): State.FINISHED,
        (SEND, "ToolReturned"): State.RUNNING,
        (SEND, "ToolFailed"): State.RUNNING,
    },
    # a session's jail: the next run's code
    (Role.SUPERVISOR, State.FINISHED): {(SEND, "RunCode"): State.RUNNING},
    # ---- jail link, runtime end
    (Role.JAIL, State.AWAIT_HARDEN): {(RECV, "Harden"): State.HARDENING},
    (Role.JAIL, State.HARDENING): {(SEND, "JailReady"): State.AWAIT_CODE},
    (Role.JAIL, State.AWAIT_CODE): {(RECV, "RunCode"): State.RUNNING},
    (Role.JAIL, State.RUNNING): {
        (SEND, "CallTool"): State.RUNNING,
        (SEND, "CodeFinished"): State.FINISHED,
        (RECV, "ToolReturned"): State.RUNNING,
        (RECV, "ToolFailed"): State.RUNNING,
    },
    (Role.JAIL, State.FINISHED): {
        # replies to calls still in flight when the code finished are harmless
        (RECV, "ToolReturned"): State.FINISHED,
        (RECV, "ToolFailed"): State.FINISHED,
        (RECV, "RunCode"): State.RUNNING,  # a session's next run
    },
}

INITIAL_STATE = {
    Role.CLIENT: State.SEND_HELLO,
    Role.DAEMON: State.AWAIT_HELLO,
    Role.SUPERVISOR: State.SEND_HARDEN,
    Role.JAIL: State.AWAIT_HARDEN,
}



def reachable_states(role: Role) -> list[State]:
    """Every state ``role`` can be in (for tests and fuzzers that start from each)."""
    found = [INITIAL_STATE[role]]
    for (r, s), moves in TRANSITIONS.items():
        if r is role:
            found += [s, *moves.values()]
    return [*dict.fromkeys(found), State.CLOSED]


_DIRECTIONS: dict[Role, tuple[Direction, Direction]] = {
    # role: (direction we receive, direction we send)
    Role.CLIENT: ("daemon->client", "client->daemon"),
    Role.DAEMON: ("client->daemon", "daemon->client"),
    Role.SUPERVISOR: ("jail->daemon", "daemon->jail"),
    Role.JAIL: ("daemon->jail", "jail->daemon"),
}

_HANDSHAKE = (Hello, Welcome, Harden, JailReady)

HANDSHAKE_FRAME_BYTES: Final = 64 << 10
"""The largest frame the daemon end takes before ``Hello`` (whose fields bound it to a few
hundred bytes): until then the frame decoder never holds more than this (plus one read)."""


class Connection:
    """One end of one link. See the module docstring."""

    __slots__ = (
        "_decoder",
        "_eof",
        "_error",
        "_max_frame_bytes",
        "_recv_dir",
        "_send_dir",
        "role",
        "state",
    )

    def __init__(self, role: Role, max_frame_bytes: int) -> None:
        self.role = role
        self.state = INITIAL_STATE[role]
        self._max_frame_bytes = max_frame_bytes
        self._decoder = FrameDecoder(max_frame_bytes)
        self._recv_dir, self._send_dir = _DIRECTIONS[role]
        self._error: RemoteProtocolError | None = None
        self._eof = False

    @property
    def max_frame_bytes(self) -> int:
        """The link's largest frame (after the handshake; see :data:`HANDSHAKE_FRAME_BYTES`)."""
        return self._max_frame_bytes

    @property
    def receive_limit(self) -> int:
        """The largest frame accepted now: tiny on the daemon end until ``Hello``."""
        if self.role is Role.DAEMON and self.state is State.AWAIT_HELLO:
            return min(self._max_frame_bytes, HANDSHAKE_FRAME_BYTES)
        return self._max_frame_bytes

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet returned as messages (part of a frame, or more)."""
        return self._decoder.buffered_bytes

    @property
    def inside_frame(self) -> bool:
        """True while part of a frame is buffered (the peer owes us the rest)."""
        return self._decoder.buffered_bytes > 0

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed its end."""
        if not data:
            self._eof = True
        else:
            self._decoder.feed(data)

    def next_event(self) -> Message | _Sentinel:
        """Return the next message, NEED_DATA, or CLOSED (clean EOF between frames)."""
        if self._error is not None:
            raise self._error
        try:
            payload = self._next_frame()
            if payload is None:
                if self._eof:
                    if self._decoder.buffered_bytes:
                        raise RemoteProtocolError(
                            f"connection closed inside a frame "
                            f"({self._decoder.buffered_bytes} bytes pending)"
                        )
                    return CLOSED
                return NEED_DATA
            msg = decode(payload, self._recv_dir)
            self._advance(RECV, msg)
            if isinstance(msg, _HANDSHAKE) and msg.protocol != PROTOCOL_VERSION:
                raise UnsupportedVersion(
                    f"peer speaks protocol version {msg.protocol}; "
                    f"this side speaks {PROTOCOL_VERSION}: upgrade the older side"
                )
            return msg
        except RemoteProtocolError as exc:
            self._error = exc
            self.state = State.CLOSED
            raise

    def send(self, msg: Message) -> bytes:
        """Frame ``msg`` for the wire. Raises LocalProtocolError if it is illegal now."""
        cls = MESSAGES[self._send_dir].get(msg.TYPE)
        if cls is None or type(msg) is not cls:
            raise LocalProtocolError(f"{self.role.value} cannot send {type(msg).__name__}")
        nxt = TRANSITIONS.get((self.role, self.state), {}).get((SEND, msg.TYPE))
        if nxt is None:
            raise LocalProtocolError(
                f"{self.role.value} cannot send {msg.TYPE} in state {self.state.value}"
            )
        data = encode_frame(encode(msg), self._max_frame_bytes)
        self.state = nxt
        return data

    def _next_frame(self) -> bytes | None:
        limit = self._decoder.max_frame_bytes = self.receive_limit
        try:
            return self._decoder.next_frame()
        except FrameTooLarge as exc:
            if limit < self._max_frame_bytes:  # still in the handshake
                raise FrameTooLarge(
                    f"{exc.message.split(';')[0]} before Hello; until the handshake a frame "
                    f"may have at most {limit} bytes"
                ) from None
            raise

    def _advance(self, verb: str, msg: Message) -> None:
        nxt = TRANSITIONS.get((self.role, self.state), {}).get((verb, msg.TYPE))
        if nxt is None:
            raise UnexpectedMessage(
                f"{msg.TYPE} is not allowed here ({self.role.value} in state {self.state.value})"
            )
        self.state = nxt

