"""A jail as the daemon holds it: its channel, output pipes, cgroup and top process.

Theory of operation
-------------------
A :class:`JailHandle` is made empty for one jail and filled by a :class:`Launcher`:
:class:`~jaild.daemon.jails.launch.spawned.SpawnLauncher` runs nsjail for the jail,
:class:`~jaild.daemon.jails.launch.forked.ZygoteLauncher` has the policy's zygote fork it. Either
way the handle then holds the daemon's end of the jail's channel, its stdout and stderr
pipes, its cgroup and uid, and its top process (nsjail, or the zygote's child).

The handle decides nothing. It reports what it sees -- channel bytes, output, EOFs, the
jail's exit -- as :mod:`jaild.daemon.core.machine` events through ``feed``, and it offers the
verbs the machine's actions need: write to the jail, drain its pipes, kill it, tear down
what is left, release the cgroup and uid. Whether a handle is reused for another job (a
pooled jail, a session's runs) is the job machine's and its driver's business, not the
launcher's.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any, Protocol

from jaild.daemon.core.machine import (
    ChannelBroken,
    ChannelOpened,
    Event,
    EvidenceRead,
    JailData,
    JobSpec,
    LeftoversGone,
    LogData,
    Output,
    ReleaseTimedOut,
    StreamClosed,
    Vanished,
)
from jaild.daemon.jails.cgroups import JobCgroup
from jaild.daemon.jails.kernlog import KernelAuditLog
from jaild.policy.compile import HostLayout

log = logging.getLogger("jaild")

RELEASE_TIMEOUT_S = 10.0
"""A zygote that has not reported a jail's reap by then: its cgroup and uid are released."""
LINGER_CHECK_S = 0.01
"""How often a spawned jail that outlived its nsjail is checked for (see ``await_leftovers``)."""


NS_GET_OWNER_UID = 0xB704  # _IO(0xb7, 0x4), linux/nsfs.h


def userns_owner(pid: int) -> int:
    """The host uid that owns the user namespace of process ``pid``: whose per-user kernel
    quotas the process's namespace is charged to (0 for the host's own namespace).

    Raises:
        OSError: the process is gone, or the kernel cannot say.
    """
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        buf = array.array("I", [0])
        fcntl.ioctl(fd, NS_GET_OWNER_UID, buf, True)
        return buf[0]
    finally:
        os.close(fd)


class LaunchEnvironment(Protocol):
    """What starting and ending a jail needs of the daemon's shared environment
    (:class:`jaild.daemon.jails.job.JailEnvironment` provides it; declared here so that the
    launchers do not depend on the job)."""

    nsjail: str
    host: HostLayout
    config_fds: dict[str, int]
    launcher: tuple[str, ...]
    audit: KernelAuditLog
    kill_grace_s: float

    def release_uid(self, uid: int) -> None: ...


class Launcher(Protocol):
    """Makes a jail into a :class:`JailHandle`."""

    async def start(
        self, handle: JailHandle, spec: JobSpec, uid: int, *, pooled: bool,
        on_sent: Callable[[], None],
    ) -> None:
        """Start the jail for ``spec`` as ``uid``; fill ``handle`` and feed ``Spawned``.
        ``on_sent``: called when the jail's own start begins (its start timeout counts from
        there). Raises OSError or RuntimeError if the jail cannot be started."""


class _Reader:
    """A non-blocking descriptor of the daemon's, read on the event loop until EOF (or a
    read error), which :meth:`close` handles -- once."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        on_data: Callable[[bytes], None],
        on_closed: Callable[[], None],
    ) -> None:
        self._loop = loop
        self.fd = fd
        self._on_data = on_data
        self._on_closed = on_closed
        self.closed = False
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)  # a socket's too: read(2) is recv(2) with no flags
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._on_data(data)
        else:
            self.close()

    def close(self) -> None:
        raise NotImplementedError


class _Pipe(_Reader):
    """The daemon's end of one of a jail's pipes (stdout, stderr, nsjail's log), read on
    the event loop until EOF, then closed -- here, once: the descriptor is this object's
    alone. (``loop.connect_read_pipe`` over a file object closed it twice under uvloop --
    libuv's close, then the file object's -- and a worker thread's file opened in between
    took the number and lost its descriptor.) While paused (a slow client), not read.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        on_data: Callable[[bytes], None],
        on_closed: Callable[[], None],
    ) -> None:
        self._paused = False
        os.set_blocking(fd, False)
        super().__init__(loop, fd, on_data, on_closed)

    def read_now(self) -> list[bytes]:
        """What the pipe holds now (not its EOF: the reader sees that and closes)."""
        chunks: list[bytes] = []
        if self.closed:
            return chunks
        with contextlib.suppress(OSError):
            while data := os.read(self.fd, 1 << 16):
                chunks.append(data)
        return chunks

    def pause(self) -> None:
        if not self.closed and not self._paused:
            self._paused = True
            self._loop.remove_reader(self.fd)

    def resume(self) -> None:
        if not self.closed and self._paused:
            self._paused = False
            self._loop.add_reader(self.fd, self._readable)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self._paused:
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self._on_closed()


class _Channel(_Reader):
    """The daemon's end of a jail's socketpair, driven by the event loop.

    Not an asyncio transport on purpose: a transport tears the connection down on the
    first failed write, dropping whatever the jail wrote just before it exited (its
    ``CodeFinished`` among it). Here a failed write only stops writing; reading goes on
    until EOF. Replies the jail does not read are buffered up to ``max_buffered`` bytes.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        on_data: Callable[[bytes], None],
        on_closed: Callable[[], None],
        on_overflow: Callable[[], None],
        max_buffered: int,
    ) -> None:
        self._sock = sock
        self._on_overflow = on_overflow
        self._max_buffered = max_buffered
        self._out = bytearray()
        self._writing = False  # a writer is registered: the jail has not read all we sent
        self._can_write = True
        sock.setblocking(False)
        super().__init__(loop, sock.fileno(), on_data, on_closed)

    def write(self, data: bytes) -> None:
        if self.closed or not self._can_write:
            return
        if not self._out:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._can_write = False  # the jail is gone; keep reading what it left
                return
            if sent == len(data):
                return
            self._loop.add_writer(self.fd, self._writable)
            self._writing = True
            data = data[sent:]
        self._out += data
        if len(self._out) > self._max_buffered:
            self._on_overflow()

    def _writable(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._can_write = False
            self._out.clear()
            sent = 0
        del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self.fd)
            self._writing = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.fd)
        if self._writing:
            self._loop.remove_writer(self.fd)
        self._sock.close()
        self._on_closed()


class JailHandle:
    """One jail's IO. See the module docstring.

    Args:
        env: what every jail of the daemon shares.
        jail_id: the jail's id (its cgroup's name).
        feed: where the handle's events go (the job machine's driver).
        max_frame_bytes: the jail link's frame limit (replies are buffered up to 4 frames).
    """

    def __init__(
        self,
        env: LaunchEnvironment,
        jail_id: str,
        feed: Callable[[Event], None],
        max_frame_bytes: int,
    ) -> None:
        self.env = env
        self.jail_id = jail_id
        self.feed = feed
        self.loop = asyncio.get_running_loop()
        self.max_frame_bytes = max_frame_bytes
        self.cgroup: JobCgroup | None = None
        self.outside_uid: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None  # spawned: nsjail
        self.jail_pid: int | None = None  # forked: the jail's process (host pid)
        self.reaped = False  # forked: the zygote reaped it
        self.spawn_id = 0  # forked: the zygote's id of the request
        self.warm_up = True  # forked, pooled: run a throwaway job once ready (see pool.py)
        self.preamble_sock: socket.socket | None = None  # forked: the channel, before it spoke
        self.adopting: asyncio.Future[None] | None = None  # forked: moving into its cgroup
        self.channel: _Channel | None = None
        self.pipes: tuple[tuple[_Pipe, str], ...] = ()  # stdout and stderr
        self.timers: list[asyncio.TimerHandle] = []
        self.release_timer: asyncio.TimerHandle | None = None
        self.linger_since: float | None = None  # a spawned jail outlived its nsjail since

    @property
    def pid(self) -> int | None:
        """nsjail's pid while it runs (None for a zygote jail: not our child)."""
        proc = self.proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def jail_process(self) -> int | None:
        """The host pid of the jail's first process (in the jail's namespaces): a zygote's
        fork, or nsjail's child."""
        if self.jail_pid is not None:
            return self.jail_pid
        pid = self.pid
        if pid is None:
            return None
        children: list[int] = []
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(
                    f"/proc/{pid}/task/{task}/children", encoding="ascii"
                ) as f:
                    children += [int(c) for c in f.read().split()]
        return children[0] if len(children) == 1 else None

    def host_view(self) -> dict[str, Any]:
        """The jail seen from the host: its processes' ids, its cgroup's limits."""
        if self.cgroup is None:
            return {}
        ids: set[int] = set()
        owners: set[int] = set()
        for pid in self.cgroup.member_pids(jail_only=True):
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{pid}/status", encoding="ascii") as status,
            ):
                for line in status:
                    if line.startswith(("Uid:", "Gid:")):
                        ids.update(int(x) for x in line.split()[1:])
                owners.add(userns_owner(pid))
        return {"outside_ids": sorted(ids), "userns_owners": sorted(owners), **self.cgroup.limits()}

    def live_usage(self) -> dict[str, Any]:
        """What the jail uses right now (memory, CPU time, processes)."""
        if self.cgroup is None:
            return {}
        cpu = self.cgroup.cpu_times()
        return {
            "memory_bytes": self.cgroup.memory_bytes(),
            "cpu_s": round(sum(cpu), 3) if cpu else None,
            "pids": len(self.cgroup.member_pids()),
        }

    def evidence(self, sigsys_pid: int | None) -> EvidenceRead:
        """What the host knows about how the jail (or a session's run) ended: the cgroup's
        OOM kills, and for a SIGSYS the kernel's audit record of the syscall."""
        oom = self.cgroup.oom_killed() if self.cgroup is not None else False
        syscall = self.env.audit.seccomp_kill(sigsys_pid) if sigsys_pid is not None else None
        return EvidenceRead(oom=oom, syscall=syscall)

    def later(self, delay_s: float, event: Event) -> asyncio.TimerHandle:
        """Feed ``event`` after ``delay_s`` (cancelled at teardown)."""
        timer = self.loop.call_later(delay_s, self.feed, event)
        self.timers.append(timer)
        return timer

    # -- streams

    def read_output(self, out_r: int, err_r: int) -> None:
        """The jail's stdout and stderr (this handle closes the descriptors)."""
        self.pipes = tuple(
            (_Pipe(self.loop, fd, functools.partial(self._output_data, sink), self.stream_closed),
             sink)
            for fd, sink in ((out_r, "stdout"), (err_r, "stderr"))
        )

    def read_log(self, log_r: int) -> None:
        """nsjail's log, on its private descriptor (this handle closes it)."""
        _Pipe(self.loop, log_r, self._log_data, self.stream_closed)

    def open_channel(self, sock: socket.socket) -> None:
        self.channel = _Channel(
            self.loop,
            sock,
            self._channel_data,
            self.stream_closed,
            functools.partial(
                self.feed, ChannelBroken("the jail does not read its tool replies")
            ),
            max_buffered=4 * self.max_frame_bytes,
        )
        self.feed(ChannelOpened())  # -> Harden

    def _log_data(self, data: bytes) -> None:
        self.feed(LogData(data))

    def _output_data(self, stream: str, data: bytes) -> None:
        self.feed(Output(stream, data))

    def _channel_data(self, data: bytes) -> None:
        self.feed(JailData(data))

    def stream_closed(self) -> None:
        self.feed(StreamClosed())

    def write(self, data: bytes) -> None:
        if self.channel is not None and not self.channel.closed:
            self.channel.write(data)

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def drain(self) -> None:
        """Feed what the output pipes hold now (the code's output before its report)."""
        for pipe, stream in self.pipes:
            for data in pipe.read_now():
                self.feed(Output(stream, data))

    def pause_output(self) -> None:
        for pipe, _ in self.pipes:
            pipe.pause()

    def resume_output(self) -> None:
        for pipe, _ in self.pipes:
            pipe.resume()

    def close_preamble(self) -> None:
        sock, self.preamble_sock = self.preamble_sock, None
        if sock is not None:
            self.loop.remove_reader(sock.fileno())
            sock.close()

    # -- the end

    def kill(self) -> None:
        """End the jail: nsjail gets SIGTERM (it SIGKILLs the jail and cleans up) and a
        grace period; a zygote jail is killed through its cgroup, with no grace period."""
        proc = self.proc
        if proc is None and self.jail_pid is None:
            if self.preamble_sock is not None:  # the waiter exits when it reads EOF
                self.close_preamble()
                self.feed(StreamClosed())
            else:
                self.feed(Vanished())
            return
        if proc is None:  # a zygote jail: nothing of it may survive, so no grace period
            self.kill_cgroup()
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # nsjail SIGKILLs the jail and cleans up
        self.timers.append(self.loop.call_later(self.env.kill_grace_s, self.force_kill))

    def kill_cgroup(self) -> None:
        if not self.reaped and self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.kill_all()
            if self.cgroup.member_pids():  # a fork raced the kill: again, shortly
                self.timers.append(self.loop.call_later(0.05, self.kill_cgroup))

    def force_kill(self) -> None:
        """nsjail ignored SIGTERM for the whole grace period: SIGKILL it and everything in
        the job's cgroup. Its orphans are reparented to this subreaper: the record waits
        until they are gone (:meth:`await_leftovers`), the server reaps them after it."""
        if self.proc is not None and self.proc.returncode is None:
            log.warning("job %s: nsjail ignored SIGTERM; killing it", self.jail_id)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            if self.cgroup is not None:
                with contextlib.suppress(OSError):
                    self.cgroup.kill_all()

    def await_leftovers(self) -> None:
        """A spawned jail's processes that outlive its killed nsjail: kill them, and check
        again shortly until none is left (then LeftoversGone).

        An nsjail that was SIGKILLed (it ignored SIGTERM) or died cannot reap: its jail,
        SIGKILLed through the cgroup and reparented to this subreaper, may still be tearing
        down its namespaces when the streams reach EOF. The record waits for it, so that it
        is exact and the cgroup and uid are released only once nothing of the job runs.
        A process that has not left after ``RELEASE_TIMEOUT_S`` is logged, not waited on."""
        if self.cgroup is None:
            self.feed(LeftoversGone())
            return
        try:
            left = self.cgroup.member_pids()
        except OSError:
            left = []
        if left and self.linger_since is None:
            self.linger_since = time.monotonic()
        elif left and time.monotonic() - (self.linger_since or 0.0) > RELEASE_TIMEOUT_S:
            log.warning(
                "job %s: processes %s outlived nsjail by %g s despite SIGKILL",
                self.jail_id, left, RELEASE_TIMEOUT_S,
            )
            left = []
        if not left:
            self.feed(LeftoversGone())
            return
        with contextlib.suppress(OSError):
            self.cgroup.kill_all()
        self.timers.append(self.loop.call_later(LINGER_CHECK_S, self.await_leftovers))

    def teardown(self) -> None:
        """Kill what is left of the jail (its cgroup and uid are released apart)."""
        for timer in self.timers:
            timer.cancel()
        if self.channel is not None:
            self.channel.close()
        self.close_preamble()
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.kill_jail()

    def arm_release_timer(self) -> None:
        # cancelled on release: a pending timer would keep the whole job alive for 10 s
        self.release_timer = self.loop.call_later(
            RELEASE_TIMEOUT_S, self.feed, ReleaseTimedOut()
        )

    def release(self) -> None:
        if self.adopting is not None:  # a move into the cgroup is under way: after it
            self.adopting.add_done_callback(lambda _: self.release())
            return
        if self.release_timer is not None:
            self.release_timer.cancel()
        if self.cgroup is None:
            self._release_uid()
            return
        # Removing a cgroup can wait on the kernel for milliseconds (a mean of 1.1 ms a jail
        # in a profile of paced warm jobs): in a worker thread, not on the loop; the uid goes
        # back to the daemon's pool once the cgroup is gone. A stopping daemon sweeps what is
        # left (its subtree's sweep), and the loop's shutdown waits for the thread.
        removed = self.loop.run_in_executor(None, _remove_cgroup, self.cgroup)
        removed.add_done_callback(lambda _: self._release_uid())

    def _release_uid(self) -> None:
        if self.outside_uid is not None:
            self.env.release_uid(self.outside_uid)


def _remove_cgroup(cgroup: JobCgroup) -> None:
    """Remove ``cgroup`` (in a worker thread). It is empty by now -- the jail was reaped,
    and with it, pid 1 of its pid namespace, every process of the jail -- so this is one
    ``rmdir`` per hierarchy; a cgroup still busy has what is in it killed first
    (:meth:`JobCgroup.remove`)."""
    with contextlib.suppress(OSError):
        cgroup.remove()
