"""The jail's answer to a network attempt its policy refuses (``network.mode = "none"``).

Theory of operation
-------------------
The seccomp filter is the boundary. In a jail without a network, ``socket()`` and
``socketpair()`` of AF_INET and AF_INET6 fail with EACCES before the kernel looks at them
(:mod:`jaild.policy.seccomp`), whoever calls them: C libraries, subprocesses and ``ctypes``
get a bare "Permission denied", and nothing is made. The job goes on; nothing here can widen
what the filter allows.

This module makes the refusal *readable* and *counted* in the job's own interpreter. Before
any user code runs, :func:`install` adds an audit hook (PEP 578; Python calls it for every
audited event and it cannot be removed) that, for

* ``socket.__new__`` of a refused family (``socket.socket``, ``_socket.socket``, and so
  everything built on them: ``socket.create_connection``, http.client, urllib, asyncio's
  connections, requests), and
* the name service (``socket.getaddrinfo``, ``gethostbyname``, ``gethostbyname_ex``,
  ``gethostbyaddr``, ``getnameinfo``) -- a lookup needs the network that is not there, and
  glibc's resolver would otherwise make its AF_INET socket out of the hook's sight (refused
  by the filter: the lookup would fail as a ``gaierror`` that names no policy, uncounted),

counts the attempt and raises ``PermissionError(EACCES, ...)`` naming the call, the policy,
and how to get network access (the daemon's words, ``Harden.network.explanation``). The call
never reaches the kernel. ``except OSError`` catches it, as it catches every network error.

The count is the jail's own word: code can make the same calls out of the hook's sight
(``ctypes``, a subprocess: refused by the filter, not counted), or reach into this module.
The daemon reports it as such (``CodeFinished.network_refused`` -> the record's
``network_refused``) and decides nothing on it.
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
from collections.abc import Callable

from jaild.protocol.fields import MAX_REF
from jaild.protocol.messages import NetworkRefusal

_NAME_SERVICE = {
    "socket.getaddrinfo": "getaddrinfo",
    "socket.gethostbyname": "gethostbyname",
    "socket.gethostbyaddr": "gethostbyaddr",
    "socket.getnameinfo": "getnameinfo",
}
"""Audit events of the name service -> the call they stand for (``gethostbyname_ex`` raises
``socket.gethostbyname``)."""

_SOCK_FLAGS = getattr(socket, "SOCK_NONBLOCK", 0) | getattr(socket, "SOCK_CLOEXEC", 0)
_SHOWN_CHARS = 200


class _Refusals:
    """The installed refusal and its count (one per process; threads share it)."""

    def __init__(self, refusal: NetworkRefusal) -> None:
        self.families = frozenset(refusal.families)
        self.explanation = refusal.explanation
        self.count = 0
        self.lock = threading.RLock()  # RLock: a signal handler may refuse inside the hook

    def refuse(self, call: str) -> None:
        with self.lock:
            self.count = min(self.count + 1, MAX_REF)
        raise PermissionError(
            errno.EACCES, f"network access refused in this jail ({call}): {self.explanation}"
        )


_installed: _Refusals | None = None


def _family_name(family: int) -> str:
    try:
        return socket.AddressFamily(family).name
    except ValueError:
        return str(family)


def _kind_name(kind: int) -> str:
    try:
        return socket.SocketKind(kind & ~_SOCK_FLAGS).name
    except ValueError:
        return str(kind)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _hook(refusals: _Refusals) -> Callable[[str, tuple[object, ...]], None]:
    families = refusals.families

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event == "socket.__new__":
            # (socket, family, type, proto); a socket made around an existing descriptor
            # (fileno=) says family -1 unless its caller names one
            family, kind = args[1], args[2]
            if family in families and isinstance(family, int) and isinstance(kind, int):
                refusals.refuse(f"socket({_family_name(family)}, {_kind_name(kind)})")
            return
        call = _NAME_SERVICE.get(event)
        if call is not None:
            shown = ", ".join(_shown(a) for a in args[:2])
            refusals.refuse(f"{call}({shown})")

    return hook


def install(refusal: NetworkRefusal) -> None:
    """Refuse, explain and count the job's network attempts from now on (see the header).
    Call once, after hardening and before any user code; a second call changes nothing."""
    global _installed
    if _installed is not None:
        return
    _installed = _Refusals(refusal)
    sys.addaudithook(_hook(_installed))


def take_refused() -> int:
    """Attempts refused since the last call (0 when nothing is installed)."""
    refusals = _installed
    if refusals is None:
        return 0
    with refusals.lock:
        count, refusals.count = refusals.count, 0
    return count
