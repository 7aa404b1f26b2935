"""The jail's end of the tool channel: a blocking socket, one reader thread.

Theory of operation
-------------------
The channel is the socketpair end nsjail handed the runtime as fd 0 (moved to
a close-on-exec descriptor at start, so subprocesses of user code never
inherit it). Frames only ever travel here -- never on stdout/stderr.

Writes happen on whichever thread makes a tool call, under one lock. Reads
happen on a single daemon thread, started after hardening (so it inherits the
seccomp filters). The reader resolves *waiters*: an asyncio future when the
call was made with an event loop running in the calling thread (the result is
handed to that loop with ``call_soon_threadsafe``), or a threading event when
the call was made from plain synchronous code. This is what lets
``await tools.x()`` and ``tools.x()`` both work, from any thread.

If the daemon closes the channel, the job is over: the runtime exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
from typing import Any

from jaild.errors import RemoteProtocolError
from jaild.protocol import CLOSED, NEED_DATA, Connection
from jaild.protocol.messages import JailToolFailed, JailToolReturned, Message

EXIT_CHANNEL_LOST = 70


class _Waiter:
    """Where one call's outcome goes: (ok, value-or-(type, message))."""

    __slots__ = ("_event", "_future", "_loop", "outcome")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._future: asyncio.Future[Any] | None = loop.create_future() if loop else None
        self._event = None if loop else threading.Event()
        self.outcome: tuple[bool, Any] | None = None

    @property
    def future(self) -> asyncio.Future[Any]:
        assert self._future is not None
        return self._future

    def resolve(self, ok: bool, value: Any) -> None:
        self.outcome = (ok, value)
        if self._event is not None:
            self._event.set()
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                self._loop.call_soon_threadsafe(self._set_future)

    def _set_future(self) -> None:
        fut = self._future
        if fut is not None and not fut.done():
            fut.set_result(self.outcome)

    def wait(self) -> tuple[bool, Any]:
        assert self._event is not None
        self._event.wait()
        assert self.outcome is not None
        return self.outcome


class Channel:
    """Thread-safe request/response over the jail link."""

    def __init__(self, sock: socket.socket, conn: Connection) -> None:
        self._sock = sock
        self._conn = conn
        self._lock = threading.Lock()
        self._pending: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        self._reader: threading.Thread | None = None

    # -- blocking helpers used before the reader thread exists

    def send(self, msg: Message) -> None:
        with self._lock:
            data = self._conn.send(msg)
            self._sock.sendall(data)

    def receive(self) -> Message:
        """Block for the next message (only before the first call)."""
        while True:
            event = self._conn.next_event()
            if event is NEED_DATA:
                data = self._sock.recv(1 << 16)
                self._conn.receive_data(data)
                continue
            if event is CLOSED:
                os._exit(EXIT_CHANNEL_LOST)
            assert isinstance(event, Message)
            return event

    # -- calls

    def begin_call(self, make_msg: Any, loop: asyncio.AbstractEventLoop | None) -> _Waiter:
        """Register a waiter, then send ``make_msg(call_id)``. The first call starts the
        reader thread: code that calls no tool pays nothing for it."""
        waiter = _Waiter(loop)
        call_id = next(self._ids)
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(
                    target=self._read_loop, name="jaild-channel", daemon=True
                )
                self._reader.start()
            self._pending[call_id] = waiter
            data = self._conn.send(make_msg(call_id))
            self._sock.sendall(data)
        return waiter

    def _read_loop(self) -> None:
        try:
            while True:
                data = self._sock.recv(1 << 16)
                with self._lock:
                    self._conn.receive_data(data)
                    while True:
                        event = self._conn.next_event()
                        if event is NEED_DATA:
                            break
                        if event is CLOSED:
                            os._exit(EXIT_CHANNEL_LOST)
                        self._dispatch(event)
        except (OSError, RemoteProtocolError):
            os._exit(EXIT_CHANNEL_LOST)

    def _dispatch(self, event: object) -> None:
        if isinstance(event, JailToolReturned):
            waiter = self._pending.pop(event.call_id, None)
            if waiter is not None:
                waiter.resolve(True, event.value)
        elif isinstance(event, JailToolFailed):
            waiter = self._pending.pop(event.call_id, None)
            if waiter is not None:
                waiter.resolve(False, (event.error_type, event.message))
