"""Where a daemon listens and where clients look for it.

Shared by the daemon's config and the client, so that the client needs nothing of
the daemon's code to find it: an explicit path (a ``--socket`` flag, the client's
``socket_path``) wins, then ``$JAILD_SOCKET``, then :data:`DEFAULT_SOCKET`.
"""

from __future__ import annotations

import argparse
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


def parse_address(address: str) -> tuple[str, str, int]:
    """Where a client connects: ``("unix", path, 0)`` for a socket path (or
    ``unix:///path``), ``("tls", host, port)`` for ``tls://HOST:PORT`` (an IPv6 host in
    brackets). Raises ValueError for anything else."""
    if address.startswith("tls://"):
        rest = address[len("tls://"):]
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f'a network address is "tls://HOST:PORT", got {address!r}')
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return "tls", host, int(port)
    if address.startswith("unix://"):
        return "unix", address[len("unix://"):], 0
    if "://" in address:
        raise ValueError(f'an address is a socket path, "unix:///path" or "tls://HOST:PORT", '
                         f"got {address!r}")
    return "unix", address, 0


TLS_ENV = {"cert": "JAILD_TLS_CERT", "key": "JAILD_TLS_KEY", "ca": "JAILD_TLS_CA",
           "server_name": "JAILD_TLS_SERVER_NAME"}
"""Where a client looks for its TLS settings when it is given a ``tls://`` address and not
the setting itself: every front end (the CLI, ``jaild mcp``, ``jaild codemode``) and the
client library alike."""


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca``: for a ``--socket tls://HOST:PORT``."""
    group = parser.add_argument_group("over the network (--socket tls://HOST:PORT)")
    group.add_argument("--tls-cert", metavar="PEM",
                       help="this client's certificate (default: $JAILD_TLS_CERT)")
    group.add_argument("--tls-key", metavar="PEM",
                       help="this client's private key (default: $JAILD_TLS_KEY)")
    group.add_argument("--tls-ca", metavar="PEM",
                       help="the CA that signs the daemon's certificate (default: "
                            "$JAILD_TLS_CA, else the system's)")


def apply_tls_arguments(args: argparse.Namespace) -> None:
    """Flags win over the environment: they are put there, for every client this process
    makes."""
    for name in ("cert", "key", "ca"):
        value = getattr(args, f"tls_{name}", None)
        if value:
            os.environ[TLS_ENV[name]] = os.path.abspath(value)
