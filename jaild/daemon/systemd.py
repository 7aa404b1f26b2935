"""The two small pieces of systemd integration: sd_notify and socket activation.

Both protocols are a few lines (a datagram to $NOTIFY_SOCKET; descriptors from
fd 3 when $LISTEN_PID is us), so they are written here rather than pulled in
as a dependency.
"""

from __future__ import annotations

import os
import socket
import stat

SD_LISTEN_FDS_START = 3


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to systemd if it asked for notifications."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(path)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


def listen_sockets() -> list[socket.socket]:
    """Sockets passed by systemd socket activation (and forget the variables)."""
    try:
        pid = int(os.environ.get("LISTEN_PID", "0"))
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    if pid != os.getpid() or count <= 0:
        return []
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    out = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(f"LISTEN_FDS passed descriptor {fd}, which is not a socket")
        os.set_inheritable(fd, False)
        out.append(socket.socket(fileno=fd))
    return out
