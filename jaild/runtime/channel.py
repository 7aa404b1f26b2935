"""The jail's end of the tool channel: a blocking socket, read by whoever waits.

Theory of operation
-------------------
The channel is the socketpair end nsjail handed the runtime as fd 0 (moved to
a close-on-exec descriptor at start, so subprocesses of user code never
inherit it). Frames only ever travel here -- never on stdout/stderr.

Writes happen on whichever thread makes a tool call, under one lock. There is no
reader thread: handing each reply from a reader thread to the caller cost a
thread wake-up per call (about 100 us here, most of a round trip). Instead the
waiting side reads:

* a call from plain synchronous code blocks in ``recv`` itself, holding the read
  lock, and dispatches every reply it reads -- its own and other threads';
* a call awaited on an event loop registers the socket with that loop
  (``add_reader``, for the loop's life); the callback reads without blocking,
  and only if no thread is reading.

Each reply resolves a *waiter*: a synchronous caller finds its outcome when it
next holds the read lock; an asyncio future is set on its own loop's thread
(``call_soon_threadsafe`` when another thread read the reply).
This is what lets ``await tools.x()`` and ``tools.x()`` both work, from any thread.

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

    __slots__ = ("_future", "_loop", "outcome")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._future: asyncio.Future[Any] | None = loop.create_future() if loop else None
        self.outcome: tuple[bool, Any] | None = None

    @property
    def future(self) -> asyncio.Future[Any]:
        assert self._future is not None
        return self._future

    def resolve(self, ok: bool, value: Any) -> None:
        """Called by whoever read the reply, with the channel's lock held."""
        self.outcome = (ok, value)
        loop = self._loop
        if loop is None:
            return  # a synchronous caller: it finds the outcome when it next holds the read lock
        if _running_loop() is loop:
            self._set_future()
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(self._set_future)

    def _set_future(self) -> None:
        """On the loop's own thread."""
        fut = self._future
        if fut is not None and not fut.done():
            fut.set_result(self.outcome)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Channel:
    """Thread-safe request/response over the jail link."""

    def __init__(self, sock: socket.socket, conn: Connection) -> None:
        self._sock = sock
        self._conn = conn
        self._lock = threading.Lock()  # the connection state and the pending calls
        self._read_lock = threading.Lock()  # one reader at a time
        self._pending: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        self._loops: set[asyncio.AbstractEventLoop] = set()  # loops reading the socket

    # -- before the code runs

    def send(self, msg: Message) -> None:
        with self._lock:
            data = self._conn.send(msg)
            self._sock.sendall(data)

    def receive(self) -> Message:
        """Block for the next message (only before the code runs)."""
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
        """Register a waiter, then send ``make_msg(call_id)``."""
        waiter = _Waiter(loop)
        call_id = next(self._ids)
        with self._lock:
            self._pending[call_id] = waiter
            if loop is not None and loop not in self._loops:
                # for the loop's life: re-registering per call would cost two syscalls
                loop.add_reader(self._sock.fileno(), self._readable)
                self._loops.add(loop)
            data = self._conn.send(make_msg(call_id))
            self._sock.sendall(data)
        return waiter

    def wait(self, waiter: _Waiter) -> tuple[bool, Any]:
        """Block until a synchronous call's reply is in, reading the socket meanwhile."""
        while waiter.outcome is None:
            with self._read_lock:
                if waiter.outcome is not None:  # read by whoever held the lock
                    break
                self._read(block=True)
        return waiter.outcome

    def _readable(self) -> None:
        """An event loop's reader callback: read what is there, unless a thread reads."""
        if not self._read_lock.acquire(blocking=False):
            return
        try:
            self._read(block=False)
        finally:
            self._read_lock.release()

    def _read(self, block: bool) -> None:
        """One ``recv`` (the caller holds the read lock), then dispatch what it completed."""
        try:
            data = self._sock.recv(1 << 16, 0 if block else socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            os._exit(EXIT_CHANNEL_LOST)
        try:
            with self._lock:
                self._conn.receive_data(data)
                while True:
                    event = self._conn.next_event()
                    if event is NEED_DATA:
                        break
                    if event is CLOSED:
                        os._exit(EXIT_CHANNEL_LOST)
                    self._dispatch(event)
        except RemoteProtocolError:
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
