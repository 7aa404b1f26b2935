"""The daemon's side of a zygote (see :mod:`jaild.runtime.zygote`): one per policy and
client uid, kept by :class:`jaild.daemon.jails.launch.zygotes.ZygoteSet`.

The zygote runs in an nsjail of its own, started by :meth:`Zygote.start`; the
daemon talks to it over a SOCK_SEQPACKET socketpair (the zygote's fd 0), one
framed message of :mod:`jaild.protocol.zygote_link` per packet:

* zygote -> daemon ``ZygoteReady`` once, after its imports; a non-empty ``failed``
  means it exits and the policy is not served.
* daemon -> zygote ``PrepareJails`` once, after ``ZygoteReady``: the payload of the
  ``Harden`` frame every jail of the policy is sent, which the zygote decodes and whose
  seccomp filters it builds once for all its jails (each jail still receives the frame
  and loads the filters itself, and the daemon still checks the digest it reports).
* daemon -> zygote ``SpawnJail``: the per-jail part of the jail's plan
  (:func:`jaild.policy.compile.compile_policy`), with the jail's channel, stdout and
  stderr as SCM_RIGHTS -- and on cgroup v2 the job's cgroup (its leaf, ``O_PATH``), which
  the zygote forks the jail straight into (``daemon.clone_into_cgroup``).
* zygote -> daemon ``JailReaped`` when a jail was reaped, or ``SpawnFailed`` when
  it could not fork.

A dead zygote fails every jail it had (they die with it by pdeathsig) and is
started again on the next spawn.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import functools
import logging
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaild.daemon.core.machine import Exited, JobSpec, Reaped, Spawned, StartFailed, StreamClosed
from jaild.daemon.jails.cgroups import Cgroups, JobCgroup
from jaild.daemon.jails.launch.handle import JailHandle
from jaild.daemon.jails.launch.spawned import as_owner, claim_workdirs, release_workdirs
from jaild.errors import RemoteProtocolError, ZygoteError
from jaild.policy.compile import (
    ZYGOTE_PIDS,
    HostLayout,
    JobFacts,
    compile_zygote,
    forked_jail,
    zygote_argv,
    zygote_memory_mb,
)
from jaild.policy.schema import Policy
from jaild.protocol.messages import Harden
from jaild.protocol.messages import encode as encode_message
from jaild.protocol.zygote_link import (
    MAX_PACKET_BYTES,
    JailReaped,
    JailSetup,
    PrepareJails,
    SpawnFailed,
    SpawnJail,
    ZygoteReady,
    decode_packet,
    encode,
)
from jaild.runtime.zygote import GO, PLACED, PREAMBLE

log = logging.getLogger("jaild.daemon.jails.launch.forked")

READY_TIMEOUT_S = 120.0
"""A zygote imports the runtime and its policy's pre-imports before it says it is ready: seconds on
an idle host, far more on a loaded or emulated one (a cold Debian 12 guest under TCG took over
30 s). Past this the policy is not served."""
SCM_CREDENTIALS = 2  # socket.SCM_CREDENTIALS, which typeshed lacks
MAX_IN_TRANSIT = 32
"""Jails forked but not yet moved into their job's cgroup: they live in the zygote's cgroup
and are charged to it, so a burst of 500 must not fork at once (it OOM-killed the zygote)."""
RESTART_BACKOFF_S = 1.0


@dataclass
class ZygoteExit:
    """How a jail forked by the zygote ended (its waiter's wait status mirrors it)."""

    status: int | None  # None: never started, or the zygote died
    cpu_s: float = 0.0
    detail: str = ""


OnExit = Callable[[ZygoteExit], None]


def namespace_problem(pid: int | None, namespaces: Sequence[str]) -> str | None:
    """Fail closed unless process ``pid`` (a zygote) really sits in the ``namespaces`` of its
    plan, its own: it keeps its capabilities, which is only harmless inside a user
    namespace of its own."""
    try:
        names = [_PROC_NS.get(ns, ns) for ns in namespaces]
        shared = [
            ns
            for ns in names
            if os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}")
        ]
    except (OSError, ValueError) as exc:
        return f"cannot inspect the zygote's namespaces: {exc}"
    if shared:
        return (
            f"the zygote shares the daemon's {', '.join(shared)} namespace(s); "
            "nsjail did not isolate it, refusing to fork jails from it"
        )
    return None


_PROC_NS = {"mount": "mnt"}
"""A plan's namespace names that /proc/PID/ns spells differently."""


class Zygote:
    """One policy's zygote: start it, ask it for jails, hear how they end."""

    def __init__(
        self,
        policy: Policy,
        nsjail: str,
        host: HostLayout,
        cgroups: Cgroups,
        config_fd: int,
        zygote_uid: int,
        uid_base: int,
        launcher: tuple[str, ...],
        harden: Harden,
        max_jobs: int,
        label: str = "",
        split_seccomp: bool = True,
    ) -> None:
        self.policy = policy
        self.label = label or f"zygote-{policy.name}"  # its cgroup's name
        self._nsjail = nsjail
        self._host = host
        self._cgroups = cgroups
        self._config_fd = config_fd
        self.uid = zygote_uid
        self._uid_base = uid_base
        self._launcher = launcher
        self._harden = harden
        self._split_seccomp = split_seccomp
        self.clone_into = host.clone_into_cgroup
        """Its jails are forked straight into their jobs' cgroups, below its home (cgroup
        v2, ``daemon.clone_into_cgroup``; :mod:`jaild.runtime.clone3`)."""
        self._home = ""
        self._said_moved = False
        self._max_jobs = max_jobs
        self._proc: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._cgroup: JobCgroup | None = None
        self._pending: dict[int, OnExit] = {}
        self._outbox: collections.deque[tuple[bytes, tuple[int, ...], int]] = collections.deque()
        self._in_transit: set[int] = set()
        self._on_sent: dict[int, Callable[[], None]] = {}
        self._writer_armed = False
        self._next_id = 0
        self._ready: asyncio.Future[ZygoteReady] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._log = bytearray()
        self._failed_at = 0.0
        self._stopped = False  # stop() is final: a start under way gives up
        self.python = ""
        self.host_pid: int | None = None  # the zygote process itself (from SO_PASSCRED)

    # -- lifecycle

    @property
    def pid(self) -> int | None:
        """nsjail's pid (the zygote's parent) while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._control is not None and self._ready is not None and self._ready.done()

    @property
    def jails(self) -> int:
        """Jails asked for and not yet reaped (running a job, waiting in a pool, queued)."""
        return len(self._pending)

    async def ensure_started(self) -> None:
        if self.alive:
            return
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        try:
            await asyncio.shield(self._starting)
        finally:
            if self._starting is not None and self._starting.done():
                self._starting = None

    async def _start(self) -> None:
        wait = self._failed_at + RESTART_BACKOFF_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if self._stopped:
            raise ZygoteError(f"the zygote of policy {self.policy.name!r} was stopped")
        loop = asyncio.get_running_loop()
        cgroup = self.label
        if self.clone_into:  # itself one level down, beside its jobs' cgroups
            cgroup = f"{self.ensure_home()}/zygote"
        self._cgroup = self._cgroups.create_job(
            cgroup,
            zygote_memory_mb(self.policy, self._max_jobs),
            ZYGOTE_PIDS,
            with_cpu=False,
        )
        daemon_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        daemon_end.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the zygote's host pid
        log_r, log_w = os.pipe2(os.O_CLOEXEC)
        argv = zygote_argv(
            self._nsjail,
            self.policy,
            self._host,
            f"/proc/self/fd/{self._config_fd}",
            log_w,
            self.uid,
            self._uid_base,
            cgroup=cgroup,
        )
        try:
            claim_workdirs(self.uid)
            self._proc = subprocess.Popen(
                [*as_owner(self._launcher, self.uid), *argv],
                stdin=zygote_end.fileno(),
                stdout=log_w,
                stderr=log_w,
                pass_fds=(self._config_fd, log_w),
                close_fds=True,
                start_new_session=True,
                env={},
            )
        except OSError:
            daemon_end.close()
            os.close(log_r)
            raise
        finally:
            zygote_end.close()
            os.close(log_w)
        self._control = daemon_end
        daemon_end.setblocking(False)
        self._ready = loop.create_future()
        loop.add_reader(daemon_end.fileno(), self._readable)
        loop.add_reader(log_r, self._log_readable, log_r)
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                hello = await asyncio.shield(self._ready)
        except (TimeoutError, ZygoteError) as exc:
            self._died(f"the zygote did not start: {exc or 'timeout'}")
            raise ZygoteError(self._why(str(exc) or "it did not become ready")) from None
        if hello.failed:
            failed = "; ".join(f"{k}: {v}" for k, v in hello.failed.items())
            self._died("preimport failed")
            raise ZygoteError(f"policy {self.policy.name!r}: pool.preimport failed: {failed}")
        plan = compile_zygote(self.policy, self._host)
        problem = namespace_problem(self.host_pid, plan.jail.namespaces)
        if problem:
            self._died(problem)
            raise ZygoteError(self._why(problem))
        self.python = hello.python
        assert self._control is not None
        self._control.send(encode(PrepareJails(encode_message(self._harden), self._split_seccomp)))
        log.info(
            "zygote of policy %s ready (nsjail pid %d, python %s)",
            self.policy.name,
            self._proc.pid,
            self.python,
        )

    def ensure_home(self) -> str:
        """The name of its home cgroup in the daemon's subtree, made if it is not there:
        where it and its jobs' cgroups live when it forks jails into them
        (:meth:`jaild.daemon.jails.cgroups.Cgroups.create_home`).

        Raises:
            CgroupError: it cannot be made.
        """
        if not self._home:
            self._cgroups.create_home(self.label, self.uid)
            self._home = self.label
        return self._home

    def moved_not_placed(self) -> None:
        """A jail sent its cgroup came from a fork (the zygote could not ``clone3`` into
        it, and says why in its log): said once."""
        if not self._said_moved:
            self._said_moved = True
            log.warning("zygote of policy %s: its jails are forked, then moved into their "
                        "cgroups (clone3 into the cgroup failed)%s", self.policy.name,
                        "".join(f"\n  {line}" for line in self._log.decode(
                            "utf-8", "replace").splitlines()[-3:]))

    def _why(self, what: str) -> str:
        excerpt = "\n".join(self._log.decode("utf-8", "replace").splitlines()[-6:])
        return f"zygote of policy {self.policy.name!r}: {what}" + (
            f"; its log:\n{excerpt}" if excerpt else ""
        )

    def _log_readable(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
            return
        if len(self._log) < 65536:
            self._log += data

    def _readable(self) -> None:
        assert self._control is not None
        try:
            data, ancdata, _, _ = self._control.recvmsg(MAX_PACKET_BYTES, socket.CMSG_SPACE(12))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancdata = b"", []
        if not data:
            self._died("the zygote exited")
            return
        try:
            msg = decode_packet(data, "zygote->daemon")
        except RemoteProtocolError as exc:
            self._died(f"the zygote sent a malformed message: {exc.message}")
            return
        if isinstance(msg, ZygoteReady):
            creds = [d for lvl, k, d in ancdata if (lvl, k) == (socket.SOL_SOCKET, SCM_CREDENTIALS)]
            if creds and self._ready is not None and not self._ready.done():
                self.host_pid = struct.unpack("3i", creds[0][:12])[0]
                self._ready.set_result(msg)
        elif isinstance(msg, JailReaped):
            self.settled(msg.spawn_id)
            on_exit = self._pending.pop(msg.spawn_id, None)
            if on_exit is not None:
                on_exit(ZygoteExit(msg.status, float(msg.cpu_s)))
        elif isinstance(msg, SpawnFailed):
            self.settled(msg.spawn_id)
            on_exit = self._pending.pop(msg.spawn_id, None)
            if on_exit is not None:
                on_exit(ZygoteExit(None, detail=msg.message))

    def _died(self, why: str) -> None:
        loop = asyncio.get_running_loop()
        self._failed_at = time.monotonic()
        if self._control is not None:
            loop.remove_reader(self._control.fileno())
            if self._writer_armed:
                loop.remove_writer(self._control.fileno())
                self._writer_armed = False
            self._control.close()
            self._control = None
        self._in_transit.clear()
        self._on_sent.clear()
        while self._outbox:
            for fd in self._outbox.popleft()[1]:
                os.close(fd)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ZygoteError(why))
            self._ready.exception()  # retrieved: whoever awaits it sees it via _start
        self._ready = None
        pending, self._pending = self._pending, {}
        for on_exit in pending.values():
            on_exit(ZygoteExit(None, detail=f"the zygote of policy {self.policy.name!r} died"))
        self._reap()
        if why not in ("stopped",):
            log.warning("zygote of policy %s: %s", self.policy.name, why)

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
                proc.wait(timeout=2)
            release_workdirs(self.uid)
        if self._cgroup is not None:
            with contextlib.suppress(OSError):
                self._cgroup.kill_all()
                self._cgroup.remove()
            self._cgroup = None

    def stop(self) -> None:
        """Stop it for good (its jails die with it); a start under way gives up."""
        self._stopped = True
        self._died("stopped")
        if self._home:  # its jobs' cgroups, if any is left, go with it
            with contextlib.suppress(OSError):
                self._cgroups.remove_home(self._home)
            self._home = ""

    # -- jails

    def spawn(
        self,
        jail: JailSetup,
        fds: tuple[int, ...],
        on_exit: OnExit,
        on_sent: Callable[[], None] | None = None,
    ) -> int:
        """Ask for one jail, as ``jail`` (the per-jail part of its plan) describes; the
        zygote gets ``fds`` (its channel, stdout, stderr), which this takes over and
        closes once sent. ``on_exit`` hears when it was reaped (or
        never started), once. ``on_sent`` hears when the request left the queue for the
        zygote (a burst waits, see MAX_IN_TRANSIT): the jail's own start begins then."""
        if not self.alive or self._control is None:
            for fd in fds:
                os.close(fd)
            raise ZygoteError(f"the zygote of policy {self.policy.name!r} is not running")
        self._next_id += 1
        ident = self._next_id
        self._pending[ident] = on_exit
        if on_sent is not None:
            self._on_sent[ident] = on_sent
        self._outbox.append((encode(SpawnJail(ident, jail)), fds, ident))
        if len(self._outbox) == 1:
            self._flush()
        return ident

    def settled(self, ident: int) -> None:
        """Jail ``ident`` left the zygote's cgroup (moved to its job's, or gone)."""
        if ident in self._in_transit:
            self._in_transit.discard(ident)
            self._flush()

    def _flush(self) -> None:
        """Send queued requests until the socket is full; a burst waits for the zygote."""
        loop = asyncio.get_running_loop()
        control = self._control
        while self._outbox and control is not None and len(self._in_transit) < MAX_IN_TRANSIT:
            payload, fds, ident = self._outbox[0]
            rights = array.array("i", fds).tobytes()
            try:
                control.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
            except (BlockingIOError, InterruptedError):
                if not self._writer_armed:
                    loop.add_writer(control.fileno(), self._flush)
                    self._writer_armed = True
                return
            except OSError:
                return  # the zygote is gone; the reader sees EOF and fails every request
            self._outbox.popleft()
            self._in_transit.add(ident)
            for fd in fds:
                os.close(fd)
            sent = self._on_sent.pop(ident, None)
            if sent is not None:
                sent()
        if self._writer_armed and control is not None:
            loop.remove_writer(control.fileno())
            self._writer_armed = False


# --------------------------------------------------------------------------- the launcher


class ZygoteLauncher:
    """Makes jails with the policy's zygote: it forks the jail, which enters fresh
    namespaces of its own. The jail's first byte on the channel carries its host pid
    (SO_PASSCRED), which goes into the job's cgroup before anything else happens -- unless
    the zygote forked it there (``PLACED``, cgroup v2); the zygote reports how the jail
    ended (its wait status) once it has reaped it."""

    def __init__(self, zygote: Zygote) -> None:
        self.zygote = zygote

    async def start(
        self, handle: JailHandle, spec: JobSpec, uid: int, *, pooled: bool,
        on_sent: Callable[[], None],
    ) -> None:
        """Ask the policy's zygote for a jail (see :mod:`jaild.runtime.zygote`)."""
        zygote = self.zygote
        assert handle.cgroup is not None
        if spec.limits.cpu_cores > 0:
            handle.cgroup.limit_cpu(spec.limits.cpu_cores)
        await zygote.ensure_started()
        daemon_end, jail_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        daemon_end.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        # the tenant's key: a "tenant" network namespace is shared by its jails alone
        tenant = "" if spec.tenant is None else str(spec.tenant)
        facts = JobFacts(spec.limits, uid, pooled=pooled and handle.warm_up, tenant=tenant)
        jail = forked_jail(spec.policy, handle.env.host, facts)
        fds: tuple[int, ...] = (jail_end.detach(), out_w, err_w)
        if handle.cgroup.leaf:  # forked straight into it (cgroup v2)
            try:
                fds += (os.open(handle.cgroup.leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC),)
            except OSError:
                for fd in (*fds, out_r, err_r):
                    os.close(fd)
                daemon_end.close()
                raise
        try:
            handle.spawn_id = zygote.spawn(  # takes over the jail's ends
                jail,
                fds,
                functools.partial(_reaped, handle),
                on_sent=on_sent,
            )
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            daemon_end.close()
            raise
        # stdout, stderr and the channel; the zygote reports the end
        handle.feed(Spawned(forked=True, streams=3))
        handle.read_output(out_r, err_r)
        daemon_end.setblocking(False)
        handle.preamble_sock = daemon_end
        handle.loop.add_reader(daemon_end.fileno(), _preamble, handle, zygote)


def _preamble(handle: JailHandle, zygote: Zygote) -> None:
    """The jail's first byte: its host pid (SO_PASSCRED) goes into the job's cgroup."""
    sock = handle.preamble_sock
    assert sock is not None and handle.cgroup is not None
    try:
        data, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(12))
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        data, ancdata = b"", []
    creds = [
        d for lvl, kind, d in ancdata if (lvl, kind) == (socket.SOL_SOCKET, SCM_CREDENTIALS)
    ]
    if data not in (PREAMBLE, PLACED) or not creds:
        handle.close_preamble()
        handle.feed(StreamClosed())
        return
    pid, uid, _gid = struct.unpack("3i", creds[0][:12])
    handle.loop.remove_reader(sock.fileno())
    problem = ""
    if uid != zygote.uid:  # only a process of the zygote's may claim a jail
        problem = f"preamble from uid {uid}, not the zygote's"
    elif data == PLACED and not handle.cgroup.leaf:
        problem = "the jail says it was forked into a cgroup it was not sent"
    if problem:
        handle.preamble_sock = None
        sock.close()
        handle.feed(StartFailed(problem))
        handle.feed(StreamClosed())
        return
    if data == PLACED:  # born in its job's cgroup (clone3): nothing to move, no go to send
        handle.preamble_sock = None
        zygote.settled(handle.spawn_id)
        handle.jail_pid = pid
        handle.open_channel(sock)
        return
    if handle.cgroup.leaf:
        zygote.moved_not_placed()
    # Moving a process between cgroups waits for an RCU grace period in the kernel
    # (cgroup_threadgroup_rwsem): milliseconds, in a worker thread, not on the loop. Until
    # it is done the jail still waits for GO and the handle still holds its preamble
    # socket: a kill or a teardown meanwhile closes it (the jail exits at EOF), and the
    # handle's release waits for the move (see JailHandle.adopting).
    moved = handle.loop.run_in_executor(None, handle.cgroup.adopt, pid)
    handle.adopting = moved
    moved.add_done_callback(functools.partial(_adopted, handle, zygote, sock, pid))


def _adopted(handle: JailHandle, zygote: Zygote, sock: socket.socket, pid: int,
             moved: asyncio.Future[None]) -> None:
    """The jail is in its job's cgroup (or could not be moved): GO, or its failure."""
    handle.adopting = None
    if handle.preamble_sock is not sock:  # killed or torn down while it moved
        return
    handle.preamble_sock = None
    error = moved.exception()
    if error is None:
        zygote.settled(handle.spawn_id)
        handle.jail_pid = pid
        try:
            sock.send(GO)
        except OSError as exc:
            error = exc
    if error is not None:
        sock.close()
        handle.feed(StartFailed(f"could not move the jail into its cgroup: {error}"))
        handle.feed(StreamClosed())
        return
    handle.open_channel(sock)


def _reaped(handle: JailHandle, end: ZygoteExit) -> None:
    """The zygote reaped the jail (or never made it): its end, and nothing left of it."""
    handle.reaped = True
    if end.status is None:
        handle.feed(Exited(cpu_s=end.cpu_s, failure=end.detail))
    elif os.WIFSIGNALED(end.status):
        sig = os.WTERMSIG(end.status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"SIG{sig}"
        term = ("signaled", sig, name, handle.jail_pid or 0)
        handle.feed(Exited(termination=term, cpu_s=end.cpu_s))
    else:
        term = ("exited", os.waitstatus_to_exitcode(end.status), "", 0)
        handle.feed(Exited(termination=term, cpu_s=end.cpu_s))
    if handle.preamble_sock is not None:  # it never spoke: nothing more will come
        handle.close_preamble()
        handle.feed(StreamClosed())
    handle.feed(Reaped())


__all__ = ["Zygote", "ZygoteError", "ZygoteExit", "ZygoteLauncher"]
