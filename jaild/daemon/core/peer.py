"""Who is on the other end of a client connection: pure data, read from ``SO_PEERCRED`` by
the server and used by every decision about that client (admission, placement, audit)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (from SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"uid={self.uid} pid={self.pid}"


__all__ = ["Peer"]
