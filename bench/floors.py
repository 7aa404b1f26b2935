"""This machine's floors, measured in the same run as jaild: what any design with jaild's
hops pays here before doing anything of its own.

1. **A hop between processes**: one byte over a socketpair and back, the two processes on
   one CPU, then each on its own CPU, back to back -- the cost of a cross-CPU wake-up (on a
   VM an idle vCPU is halted: waking it is an IPI the hypervisor delivers).
2. **A warm job's shape** with no work in it: a client, a "daemon" and a "jail" (three
   processes, asyncio protocols in the first two, msgpack frames), the client's request
   going to the jail and the answer back through the daemon -- jaild's four hops --, paced
   as the warm row is.
3. **What idling costs the next piece of Python**: one decode of a ``RunJob`` frame, back to
   back, then each after the pause the warm row has between jobs. The ratio is how much
   slower any code runs when the CPU under it has just been idle (cold caches and TLB; on a
   VM, the host may have run someone else on that core meanwhile).

Nothing of jaild runs in 1 and 2; 3 decodes with jaild's protocol package.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import msgpack
from measure import BenchError, Latency

from jaild.protocol.messages import JobDescription, RunJob, decode, encode

WARMUP = 10


@contextmanager
def on_cpus(cpus: str) -> Iterator[None]:
    """This process (its calling thread, and threads it starts meanwhile) on ``cpus`` (a
    comma-separated list, as ``taskset -c`` takes) for the block."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pingpong(runs: int, pause_s: float, *, same_cpu: bool) -> Latency:
    """A byte's round trip between two processes over a socketpair: both on the first CPU
    this process may use, or the second on another CPU."""
    cpus = _cpus()
    if not same_cpu and len(cpus) < 2:
        raise BenchError("one CPU only: there is no other CPU to cross to")
    here, there = cpus[0], cpus[0] if same_cpu else cpus[1]
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo, pinned
        try:
            a.close()
            os.sched_setaffinity(0, {there})
            while data := b.recv(64):
                b.send(data)
        finally:
            os._exit(0)
    b.close()
    samples = []
    try:
        with on_cpus(str(here)):
            for i in range(WARMUP + runs):
                if pause_s:
                    time.sleep(pause_s)
                started = time.perf_counter()
                a.send(b"x")
                a.recv(64)
                if i >= WARMUP:
                    samples.append(time.perf_counter() - started)
    finally:
        a.close()
        os.waitpid(pid, 0)
    where = "one CPU" if same_cpu else "two CPUs"
    return Latency(samples, note=f"{where}, {pause_s * 1e3:.0f} ms between" if pause_s
                   else f"{where}, back to back")


# ---------------------------------------------------------------------------- a job's shape


def _frame(message: object) -> bytes:
    body: bytes = msgpack.packb(message)
    return struct.pack(">I", len(body)) + body


class _Framer(asyncio.Protocol):
    """Length-prefixed msgpack frames, each handed to ``on_message`` as it completes."""

    def __init__(self, on_message: Callable[[asyncio.Transport, object], None]) -> None:
        self._buffer = bytearray()
        self._on_message = on_message
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 4:
            size = struct.unpack_from(">I", self._buffer)[0]
            if len(self._buffer) < 4 + size:
                return
            message = msgpack.unpackb(bytes(self._buffer[4:4 + size]))
            del self._buffer[:4 + size]
            assert self.transport is not None
            self._on_message(self.transport, message)


def _jail(sock: socket.socket) -> None:
    """The "jail": reads a frame, answers one (blocking, as jaild's runtime does)."""
    stream = sock.makefile("rb")
    while header := stream.read(4):
        msgpack.unpackb(stream.read(struct.unpack(">I", header)[0]))
        sock.sendall(_frame({"type": "CodeFinished", "ok": True, "result": msgpack.packb(2)}))


async def _daemon(path: str, jail: socket.socket, ready: int) -> None:
    """The "daemon": a client's request to the jail, the jail's answer to the client."""
    loop = asyncio.get_running_loop()
    clients: list[asyncio.Transport] = []

    def from_jail(_: asyncio.Transport, message: object) -> None:
        assert isinstance(message, dict)
        clients[0].write(_frame({"type": "JobFinished", "record": {"status": "ok"},
                                 "result": message["result"]}))

    to_jail, _ = await loop.create_unix_connection(lambda: _Framer(from_jail), sock=jail)

    def from_client(transport: asyncio.Transport, message: object) -> None:
        if transport not in clients:
            clients.append(transport)
        assert isinstance(message, dict)
        to_jail.write(_frame({"type": "RunCode", "job": message["job"]}))

    server = await loop.create_unix_server(lambda: _Framer(from_client), path)
    os.write(ready, b"x")
    async with server:
        await asyncio.Event().wait()


def warm_shape(runs: int, pause_s: float) -> Latency:
    """A job's four hops and nothing else: client -> daemon -> jail -> daemon -> client."""
    with tempfile.TemporaryDirectory(prefix="jaild-bench-shape-") as tmp:
        path = os.path.join(tmp, "daemon.sock")
        daemon_end, jail_end = socket.socketpair()
        jail_pid = os.fork()
        if jail_pid == 0:
            try:
                daemon_end.close()
                _jail(jail_end)
            finally:
                os._exit(0)
        jail_end.close()
        ready_r, ready_w = os.pipe()
        daemon_pid = os.fork()
        if daemon_pid == 0:
            try:
                os.close(ready_r)
                asyncio.run(_daemon(path, daemon_end, ready_w))
            finally:
                os._exit(0)
        daemon_end.close()
        os.close(ready_w)
        try:
            if os.read(ready_r, 1) != b"x":
                raise BenchError("the floor's daemon did not start")
            return Latency(asyncio.run(_shape_client(path, runs, pause_s)),
                           note=f"{pause_s * 1e3:.0f} ms between jobs" if pause_s else "")
        finally:
            os.close(ready_r)
            for pid in (daemon_pid, jail_pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, 9)
                os.waitpid(pid, 0)


async def _shape_client(path: str, runs: int, pause_s: float) -> list[float]:
    loop = asyncio.get_running_loop()
    answer: list[asyncio.Future[object]] = []

    def on_message(_: asyncio.Transport, message: object) -> None:
        answer[0].set_result(message)

    transport, _ = await loop.create_unix_connection(lambda: _Framer(on_message), path)
    samples = []
    try:
        for i in range(WARMUP + runs):
            if pause_s:
                await asyncio.sleep(pause_s)
            answer[:] = [loop.create_future()]
            started = time.perf_counter()
            transport.write(_frame({"type": "RunJob", "job": {"code": "result = 1 + 1\nresult"},
                                    "policy": "default"}))
            await answer[0]
            if i >= WARMUP:
                samples.append(time.perf_counter() - started)
    finally:
        transport.close()
    return samples


# ---------------------------------------------------------------------------- idling


def after_idle(runs: int, pause_s: float) -> Latency:
    """One decode of a ``RunJob`` frame (jaild's protocol package), after ``pause_s`` of
    sleep each time (0: back to back)."""
    payload = encode(RunJob(ref=1, job=JobDescription(code="result = 1 + 1\nresult"),
                            policy="default"))
    samples = []
    for i in range(WARMUP + runs):
        if pause_s:
            time.sleep(pause_s)
        started = time.perf_counter()
        decode(payload, "client->daemon")
        if i >= WARMUP:
            samples.append(time.perf_counter() - started)
    return Latency(samples, note=f"after {pause_s * 1e3:.0f} ms idle" if pause_s
                   else "back to back")


FLOORS: dict[str, str] = {
    "pingpong_same": "a byte's round trip between two processes, one CPU",
    "pingpong_apart": "a byte's round trip between two processes, two CPUs",
    "pingpong_paced": "a byte's round trip between two processes, two CPUs, paced",
    "shape": "a warm job's four hops, nothing else (client, daemon, jail; asyncio), paced",
    "decode_hot": "one `RunJob` decode (jaild.protocol), back to back",
    "decode_idle": "one `RunJob` decode (jaild.protocol), after the pause between warm jobs",
}
"""The floors' keys and what each measures, in the report's order."""


def measure(key: str, runs: int, pause_s: float) -> Latency:
    """The floor ``key`` of :data:`FLOORS`."""
    if key == "pingpong_same":
        return pingpong(runs, 0.0, same_cpu=True)
    if key == "pingpong_apart":
        return pingpong(runs, 0.0, same_cpu=False)
    if key == "pingpong_paced":
        return pingpong(runs, pause_s, same_cpu=False)
    if key == "shape":
        return warm_shape(runs, pause_s)
    if key == "decode_hot":
        return after_idle(runs, 0.0)
    if key == "decode_idle":
        return after_idle(runs, pause_s)
    raise KeyError(key)
