"""Sockets made in another network namespace (the one place the daemon enters one).

A socket belongs to the network namespace it was made in, whoever holds it later. ``setns``
changes the namespace of the calling thread alone, so :func:`made_in` runs the making in a
thread of its own that enters the namespace, makes the socket and ends: no thread ever comes
back into use in the wrong namespace. Its users: the egress gateway's listener inside a
jail's namespace (:func:`jaild.daemon.egress.gateway.listen_in`), and the unix_diag socket
asked about a pod's connection in the pod's namespace
(:func:`jaild.daemon.identity.peer_inode`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000


def _setns(fd: int, nstype: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns({what}): {os.strerror(code)}")


def made_in(netns_fd: int, make: Callable[[], T], what: str = "") -> T:
    """``make()``, run in a thread that has entered the network namespace ``netns_fd`` (an
    open descriptor of it; the caller keeps and closes it; ``what`` names it in an error).

    Raises:
        OSError: the namespace could not be entered; or what ``make`` raised.
    """
    made: list[T] = []
    failed: list[BaseException] = []

    def enter_and_make() -> None:
        try:
            _setns(netns_fd, CLONE_NEWNET, what or f"fd {netns_fd}")
            made.append(make())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=enter_and_make, name="jaild-netns")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


__all__ = ["CLONE_NEWNET", "made_in"]
