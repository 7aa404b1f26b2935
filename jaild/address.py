"""Where a daemon listens and where clients look for it.

Shared by the daemon's config and the client, so that the client needs nothing of
the daemon's code to find it: an explicit path (a ``--socket`` flag, the client's
``socket_path``) wins, then ``$JAILD_SOCKET``, then :data:`DEFAULT_SOCKET`.
"""

from __future__ import annotations

import os
import socket

DEFAULT_SOCKET = "/run/jaild/jaild.sock"
"""The system daemon's socket (systemd/jaild.socket)."""


def socket_from_env(explicit: str | None = None) -> tuple[str, bool]:
    """(socket path, whether it was named explicitly by flag or JAILD_SOCKET)."""
    if explicit:
        return explicit, True
    env = os.environ.get("JAILD_SOCKET")
    if env:
        return env, True
    return DEFAULT_SOCKET, False


def nobody_listening(path: str) -> bool:
    """Whether nothing listens at the Unix socket ``path`` (no file, or connection refused).

    Any other failure (permission denied, ...) counts as someone listening: the caller
    then connects and reports that error instead of starting a daemon of its own.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return True
    except OSError:
        return False
    finally:
        s.close()
    return False
