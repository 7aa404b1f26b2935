"""A private daemon: one started inside a command, for that command only.

``jaild run``, ``jaild session``, ``jaild codemode`` and ``jaild doctor`` need a daemon
even on a host where none runs. Each starts one here, in this process, with the same rules:

* its socket is in a fresh private directory (mode 0700, removed afterwards), so no
  other user can reach it and it never takes the system daemon's socket;
* it serves no metrics endpoint, whatever the config file says: ``metrics_address``
  names the system daemon's port, which a private daemon must neither take nor be
  refused for;
* it serves only the policies the command asked for (all of them when none is named);
* it is stopped when the command is done, also when its start failed half-way.

:func:`daemon_socket` is the front ends' choice: the socket that was named (flag or
``$JAILD_SOCKET``) or the default one if a daemon listens there, else a private
daemon's. A private daemon that cannot start is then :class:`DaemonUnavailable`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager

from jaild.address import nobody_listening, socket_from_env
from jaild.daemon.config import DaemonConfig
from jaild.daemon.server import Daemon
from jaild.errors import DaemonUnavailable, StartupError


@asynccontextmanager
async def private_daemon(
    config: DaemonConfig, *, policies: Collection[str] | None = None
) -> AsyncIterator[Daemon]:
    """Start a daemon for this command only; stop it on leaving.

    Args:
        config: the daemon's settings; its ``socket_path`` and ``metrics_address`` are
            replaced (a private socket, no metrics endpoint).
        policies: serve only these; ``None`` serves every policy (``jaild doctor``).
    Yields:
        The started daemon; clients connect to ``daemon.config.socket_path``.
    Raises:
        StartupError: the daemon cannot start (it is stopped before this propagates).
    """
    with tempfile.TemporaryDirectory(prefix="jaild-private-") as directory:
        daemon = Daemon(
            dataclasses.replace(
                config, socket_path=os.path.join(directory, "jaild.sock"), metrics_address=None
            )
        )
        try:
            await daemon.start(only_policies=None if policies is None else set(policies))
            yield daemon
        finally:
            await daemon.stop()


@asynccontextmanager
async def daemon_socket(
    explicit: str | None,
    config: Callable[[], DaemonConfig],
    policy: str,
    on_private: Callable[[str], None],
) -> AsyncIterator[str]:
    """The socket a one-shot front end should use, and a private daemon behind it if needed.

    Args:
        explicit: the ``--socket`` flag, if given.
        config: builds the private daemon's settings; called only if one is started
            (it may raise ``PolicyError`` for a bad config file).
        policy: the one policy the private daemon serves.
        on_private: told the default socket's path when nothing listens there and a
            private daemon is started instead (the front end says so to its user).
    Yields:
        The socket path to connect to.
    Raises:
        DaemonUnavailable: a private daemon was needed and could not start.
    """
    path, named = socket_from_env(explicit)
    if named or not nobody_listening(path):
        yield path
        return
    on_private(path)
    try:
        async with private_daemon(config(), policies=(policy,)) as daemon:
            yield daemon.config.socket_path
    except StartupError as exc:
        raise DaemonUnavailable(
            f"no jaild daemon at {path}, and a private one could not start: {exc.message}"
        ) from exc
