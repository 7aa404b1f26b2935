"""The zygote link: the daemon <-> a policy's zygote, and the jail description it carries.

Theory of operation
-------------------
A policy in zygote mode has one zygote process (:mod:`jaild.runtime.zygote`),
started by the daemon (:mod:`jaild.daemon.jails.launch.forked`) in an nsjail of its
own. The two talk over a ``SOCK_SEQPACKET`` socketpair, the zygote's fd 0. Each
packet carries exactly one frame (:mod:`jaild.protocol.framing`), and the frame
one message, a msgpack map ``{"type": <name>, <field>: <value>, ...}``, like the
other two links' messages (:mod:`jaild.protocol.messages`):

=================  ==============  ===============================================
message            direction       meaning
=================  ==============  ===============================================
``ZygoteReady``    zygote->daemon  once, after its imports; a non-empty ``failed``
                                   means it exits and the policy is not served
``PrepareJails``   daemon->zygote  once, after ``ZygoteReady``: the ``Harden``
                                   frame every jail will be sent, as its payload;
                                   the zygote decodes it and builds the filters
                                   once for all jails (each jail still receives
                                   and loads them, and the daemon checks the
                                   digest)
``SpawnJail``      daemon->zygote  fork one jail as ``jail`` describes; the jail's
                                   channel, stdout and stderr ride along as
                                   SCM_RIGHTS, and on cgroup v2 its job's cgroup
                                   (an ``O_PATH`` directory), to fork it into
``JailReaped``     zygote->daemon  jail ``spawn_id`` ended: wait status and usage
``SpawnFailed``    zygote->daemon  jail ``spawn_id`` could not be forked
=================  ==============  ===============================================

Every ``SpawnJail`` is answered by exactly one ``JailReaped`` or ``SpawnFailed``,
unless the zygote dies first (then the daemon fails them all).

The jail description
--------------------
:class:`JailSetup` is the per-jail part of a policy's jail plan
(:class:`jaild.policy.compile.JailPlan`), sent as it is: the mounts each jail
makes for itself (with their options, spelled once, by the compiler), its
rlimits, namespaces, hostname, working directory and uid. The compiler renders
the same plan to nsjail's config for spawn mode; the zygote applies it with
system calls. It lives here, not in :mod:`jaild.policy`, because the in-jail
runtime may import only the protocol package.

:func:`decode` is the only place bytes of this link become messages; whatever
the input, it returns a message or raises :class:`RemoteProtocolError`.
"""

from __future__ import annotations

from typing import Literal

import msgpack

from jaild.errors import LocalProtocolError, RemoteProtocolError
from jaild.protocol.fields import (
    Struct,
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
from jaild.protocol.framing import HEADER, HEADER_BYTES, FrameDecoder, encode_frame
from jaild.protocol.messages import Message, decode_from

MAX_FRAME_BYTES = 1 << 16
"""The largest frame either side sends (the seccomp spec is the largest message, ~10 KB)."""
MAX_PACKET_BYTES = HEADER_BYTES + MAX_FRAME_BYTES
"""What a receiver reads per packet: one whole frame."""
MAX_SPAWN_ID = (1 << 63) - 1
MAX_JAIL_MOUNTS = 16
MAX_UID = (1 << 32) - 2
MAX_FAILED_IMPORTS = 32
"""``ZygoteReady`` reports the first failed pre-imports only, so it stays one packet."""
MAX_FAILURE_CHARS = 1024

MAX_SHARED_NET_CHARS = 128
SHARED_NET_KEY = r"([A-Za-z0-9][A-Za-z0-9._-]*)?"
"""A shared network namespace's key: a tenant's (``Principal.key``: a uid, ``pod-<uid>``,
``sa-<digest>``, ``cert-<digest>``), or "" for none."""

MOUNT_KINDS = ("tmpfs", "proc", "bind", "symlink")
NAMESPACES = ("user", "mount", "pid", "ipc", "uts", "cgroup", "net")
"""Namespace names, in the order nsjail's config lists them (``clone_new*``) but ``net``."""

_path = string(4096, min_len=1, pattern=r"/.*")
_text = string(1 << 14)


# --------------------------------------------------------------------------- the jail


@struct
class Mount(Struct):
    """One mount of a jail. ``source`` is the host path of a bind, or a symlink's target."""

    target: str = field(_path)
    kind: str = field(one_of(*MOUNT_KINDS))
    source: str = field(string(4096), default="")
    options: str = field(string(1024), default="")
    """The filesystem's data string (``size=...,mode=...``): tmpfs and proc only."""
    writable: bool = field(boolean(), default=False)
    nosuid: bool = field(boolean(), default=False)
    nodev: bool = field(boolean(), default=False)
    noexec: bool = field(boolean(), default=False)

    def __post_init__(self) -> None:
        Struct.__post_init__(self)
        made = self.kind in ("tmpfs", "proc")
        if made == bool(self.source):
            need = "no source" if made else "a source"
            raise LocalProtocolError(f"field 'source': a {self.kind} mount takes {need}")
        if not made and self.options:
            raise LocalProtocolError(f"field 'options': a {self.kind} mount takes none")


@struct
class Rlimits(Struct):
    """The jail's resource limits, soft = hard, in the kernel's units."""

    cpu_s: int = field(integer(0, 1 << 40))
    file_size_bytes: int = field(integer(0, 1 << 62))
    open_files: int = field(integer(0, 1 << 30))
    core_bytes: int = field(integer(0, 1 << 62), default=0)
    sigpending: int = field(integer(0, 1 << 30), default=0)
    """Signals queued to the jail's uid (RLIMIT_SIGPENDING)."""
    msgqueue_bytes: int = field(integer(0, 1 << 40), default=0)
    """POSIX message queue bytes of the jail's uid (RLIMIT_MSGQUEUE)."""
    memlock_bytes: int = field(integer(0, 1 << 40), default=0)
    """Locked memory, mlock(2) and SHM_LOCK (RLIMIT_MEMLOCK)."""


@struct
class JailSetup(Struct):
    """The per-jail part of a jail plan: what a jail sets up for itself.

    A zygote applies it in this order: new ``namespaces``; join the shared network
    namespace of ``shared_net`` if set; private mount propagation; detach the zygote's
    mounts at ``detach``; make ``mounts`` in order; ``hostname``; bring ``lo`` up if
    ``loopback`` (a shared namespace: once, when the zygote makes it); ``cwd``;
    ``rlimits``; become ``uid``."""

    uid: int = field(integer(0, MAX_UID))
    """The uid the jail runs as, inside its user namespace."""
    hostname: str = field(string(64, min_len=1))
    cwd: str = field(_path)
    namespaces: tuple[str, ...] = field(list_of(one_of(*NAMESPACES), len(NAMESPACES)))
    """The namespaces the jail gets of its own (the others it shares with its maker)."""
    mounts: tuple[Mount, ...] = field(list_of(nested(Mount), MAX_JAIL_MOUNTS))
    """The mounts made fresh for each jail (its writable ones and /proc), in order."""
    rlimits: Rlimits | None = field(optional(nested(Rlimits)))
    """None only in a zygote's own plan: each jail it forks sets its own."""
    loopback: bool = field(boolean(), default=False)
    """Bring ``lo`` up in the jail's network namespace (its own, or the shared one)."""
    detach: tuple[str, ...] = field(list_of(_path, MAX_JAIL_MOUNTS), default=())
    """Mounts of the jail's maker (a zygote) the jail hides before making its own."""
    warm_up: bool = field(boolean(), default=False)
    """A pooled jail: it has time to run a throwaway job while it waits for its own."""
    shared_net: str = field(string(MAX_SHARED_NET_CHARS, pattern=SHARED_NET_KEY), default="")
    """The key of the network namespace the jail shares with its zygote's other jails of
    the same key -- its tenant's (``network.namespace = "tenant"``); "": none (then "net" in
    ``namespaces`` is a namespace of its own). The zygote makes one per key, once."""

    def __post_init__(self) -> None:
        Struct.__post_init__(self)
        if len(set(self.namespaces)) != len(self.namespaces):
            raise LocalProtocolError(f"field 'namespaces': duplicates in {list(self.namespaces)}")
        if self.shared_net and "net" in self.namespaces:
            raise LocalProtocolError(
                "field 'shared_net': a jail that shares a network namespace makes none of its own"
            )
        if self.loopback and "net" not in self.namespaces and not self.shared_net:
            raise LocalProtocolError("field 'loopback': needs a network namespace not its maker's")


# --------------------------------------------------------------------------- messages


@struct
class ZygoteReady(Message):
    TYPE = "ZygoteReady"
    pid: int = field(integer(1, 1 << 31))
    python: str = field(string(256), default="")
    failed: dict[str, str] = field(
        map_of(string(256, min_len=1), string(MAX_FAILURE_CHARS), MAX_FAILED_IMPORTS),
        default_factory=dict,
    )
    """Pre-imports that failed: module -> error."""


@struct
class PrepareJails(Message):
    TYPE = "PrepareJails"
    harden: bytes = field(binary(MAX_FRAME_BYTES - 64))  # the rest of the frame: its keys
    """The payload of the ``Harden`` frame (:mod:`jaild.protocol.messages`) the daemon sends
    each jail of this zygote, byte for byte."""
    split_seccomp: bool = field(boolean(), default=True)
    """Load the policy's seccomp filters in the zygote, once, each jail adding only what takes
    the zygote's own needs away (:mod:`jaild.runtime.zygote_filter`); False: each jail loads
    them whole."""


@struct
class SpawnJail(Message):
    TYPE = "SpawnJail"
    spawn_id: int = field(integer(0, MAX_SPAWN_ID))
    jail: JailSetup = field(nested(JailSetup))

    def __post_init__(self) -> None:
        Struct.__post_init__(self)
        if self.jail.rlimits is None:
            raise LocalProtocolError("field 'jail.rlimits': a spawned jail sets its own")
        if "user" in self.jail.namespaces:
            raise LocalProtocolError(
                "field 'jail.namespaces': a forked jail stays in its zygote's user namespace"
            )
        if "pid" not in self.jail.namespaces:
            raise LocalProtocolError("field 'jail.namespaces': a forked jail is pid 1 of its own")
        for mount in self.jail.mounts:
            if mount.kind not in ("tmpfs", "proc"):
                raise LocalProtocolError(
                    f"field 'jail.mounts': a zygote makes tmpfs and proc mounts, not {mount.kind}"
                )


@struct
class JailReaped(Message):
    TYPE = "JailReaped"
    spawn_id: int = field(integer(0, MAX_SPAWN_ID))
    status: int = field(integer(0, (1 << 31) - 1))
    """The wait status (``os.waitstatus_to_exitcode`` reads it)."""
    cpu_s: float = field(number(0, 1 << 40))
    maxrss_kb: int = field(integer(0, 1 << 50))


@struct
class SpawnFailed(Message):
    TYPE = "SpawnFailed"
    spawn_id: int = field(integer(0, MAX_SPAWN_ID))
    message: str = field(_text)


Direction = Literal["daemon->zygote", "zygote->daemon"]

MESSAGES: dict[Direction, dict[str, type[Message]]] = {
    "daemon->zygote": {m.TYPE: m for m in (PrepareJails, SpawnJail)},
    "zygote->daemon": {m.TYPE: m for m in (ZygoteReady, JailReaped, SpawnFailed)},
}


# --------------------------------------------------------------------------- encode / decode


def encode(msg: Message) -> bytes:
    """Message -> one framed packet. Raises LocalProtocolError if it is too large."""
    packed: bytes = msgpack.packb(msg.to_wire(), use_bin_type=True)
    return encode_frame(packed, MAX_FRAME_BYTES)


def decode(payload: bytes, direction: Direction) -> Message:
    """msgpack payload -> Message of ``direction``, or RemoteProtocolError. Never anything else."""
    return decode_from(payload, MESSAGES[direction], direction)


class LinkDecoder:
    """Bytes of one direction in (any split), messages out. No IO."""

    __slots__ = ("_frames", "direction")

    def __init__(self, direction: Direction) -> None:
        self.direction: Direction = direction
        self._frames = FrameDecoder(MAX_FRAME_BYTES)

    @property
    def buffered_bytes(self) -> int:
        return self._frames.buffered_bytes

    def feed(self, data: bytes) -> None:
        self._frames.feed(data)

    def next_message(self) -> Message | None:
        """The next whole message, None when more bytes are needed, or RemoteProtocolError."""
        payload = self._frames.next_frame()
        return None if payload is None else decode(payload, self.direction)


def decode_packet(packet: bytes, direction: Direction) -> Message:
    """One packet of the link -> its one message; anything but exactly one whole frame is
    a :class:`RemoteProtocolError`."""
    if len(packet) < HEADER_BYTES:
        raise RemoteProtocolError(f"a {len(packet)}-byte packet holds no frame header")
    (length,) = HEADER.unpack_from(packet)
    if length != len(packet) - HEADER_BYTES:
        raise RemoteProtocolError(
            f"a packet must hold one whole frame: it announces {length} bytes "
            f"and carries {len(packet) - HEADER_BYTES}"
        )
    decoder = LinkDecoder(direction)
    decoder.feed(packet)
    msg = decoder.next_message()
    assert msg is not None  # the packet is exactly one frame
    return msg


__all__ = [
    "MAX_FAILED_IMPORTS",
    "MAX_FAILURE_CHARS",
    "MAX_FRAME_BYTES",
    "MAX_PACKET_BYTES",
    "MAX_SHARED_NET_CHARS",
    "MESSAGES",
    "SHARED_NET_KEY",
    "JailReaped",
    "JailSetup",
    "LinkDecoder",
    "Mount",
    "PrepareJails",
    "Rlimits",
    "SpawnFailed",
    "SpawnJail",
    "ZygoteReady",
    "decode",
    "decode_packet",
    "encode",
]
