"""The jaild daemon: a Unix-socket server that runs jobs in jails and routes tool calls.

Theory of operation
-------------------
Lifecycle: :meth:`Daemon.start` (load and check every policy -- refusing to
start on any error --, prepare the cgroup subtree and sweep what a crash left,
stage the runtime, seal one nsjail config per policy, bind the socket, notify
systemd) -> :meth:`Daemon.serve_forever` -> :meth:`Daemon.stop` (stop
accepting, cancel running jobs so they end ``cancelled``, tell their clients,
close connections, remove the socket).

Each connection is a :class:`ClientSession` wrapping the sans-IO
:class:`~jaild.protocol.Connection`. A job belongs to the session that
submitted it: only that session may cancel it or answer its tool calls, and
when the session goes away its jobs are cancelled. A tool call from a jail
goes out as ``CallTool{job_id, call_id}`` to the owning session, and the
session's ``ToolReturned``/``ToolFailed`` for that pair resolves it.

Hostile input on a connection (a bad frame, an oversize frame, a message out of
order) gets an ``Error`` frame and that connection is closed; a well-formed but
unacceptable request (unknown policy, looser limits, unknown job) gets an
``Error`` frame and the connection carries on. Either way every other client is
unaffected.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import grp
import logging
import os
import resource
import secrets
import shutil
import socket
import stat
import struct
import time
from collections.abc import Mapping
from typing import Any

from jaild import __version__
from jaild.daemon import systemd
from jaild.daemon.accounting import Accounting
from jaild.daemon.audit import AuditLog, Peer
from jaild.daemon.cgroups import CgroupError, Cgroups, detect
from jaild.daemon.config import DaemonConfig
from jaild.daemon.job import JailedJob, JailEnvironment, JobSpec
from jaild.daemon.kernlog import KernelAuditLog
from jaild.daemon.launch.forked import Zygote
from jaild.daemon.metrics import Metrics
from jaild.daemon.pool import JailPool, poolable
from jaild.daemon.records import internal_error_record, syntax_error_record, with_session
from jaild.daemon.selftest import INSPECT_TOOL, Check, evaluate, host_paths_to_hide, probe_code
from jaild.daemon.staging import ensure_traversable, locate_nsjail, stage_runtime
from jaild.errors import (
    BadRequest,
    Busy,
    ConnectionLost,
    InternalError,
    JaildError,
    PermissionDenied,
    PolicyError,
    PolicyUnavailable,
    ReadTimeout,
    RemoteProtocolError,
    SessionClosed,
    ShuttingDown,
    UnknownJob,
    UnknownPolicy,
    UnknownSession,
)
from jaild.policy.compile import JOB_UIDS, CgroupLayout, HostLayout, nsjail_config
from jaild.policy.schema import (
    Limits,
    Policy,
    effective_limits,
    host_checks,
    load_policy_dir,
    resolve_env,
    user_matches,
)
from jaild.policy.seccomp import build_spec
from jaild.protocol import CLOSED, NEED_DATA, PROTOCOL_VERSION, Connection, Role, pack, unpack
from jaild.protocol.messages import (
    CancelJob,
    ClientCallTool,
    ClientToolFailed,
    ClientToolReturned,
    CloseSession,
    Error,
    GetStats,
    Hello,
    JobAccepted,
    JobFinished,
    JobList,
    JobOutput,
    Kill,
    Killed,
    ListJobs,
    ListPolicies,
    Message,
    OpenSession,
    PolicyList,
    RunJob,
    SessionOpened,
    Stats,
    ToolSpec,
    Welcome,
)
from jaild.protocol.messages import SessionClosed as SessionClosedMsg
from jaild.protocol.records import DaemonStats, JobEntry, JobRecord, PolicyEntry, SessionInfo
from jaild.runtime.files import check_file_set
from jaild.runtime.harden import become_child_subreaper
from jaild.runtime.seccomp import bpf_program
from jaild.runtime.seccomp import digest as seccomp_digest

log = logging.getLogger("jaild")

SO_PEERGROUPS = 59
WRITE_BUFFER_HIGH = 8 << 20


class StartupError(JaildError):
    """The daemon cannot start; the message lists every reason."""

    code = "internal_error"


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int, tuple[int, ...]]:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    groups: tuple[int, ...] = ()
    with contextlib.suppress(OSError):
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
        groups = struct.unpack(f"{len(raw) // 4}I", raw)
    return pid, uid, gid, groups


def _children() -> set[int]:
    """Our direct children, from /proc (every thread's list)."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
    return out


def new_job_id() -> str:
    return "job-" + secrets.token_hex(8)


def _sealed_memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, text.encode())
    import fcntl

    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


class ClientSession:
    """One client connection."""

    def __init__(
        self, daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.daemon = daemon
        self.reader = reader
        self.writer = writer
        self.conn = Connection(Role.DAEMON, daemon.config.max_frame_bytes)
        self.peer = Peer(*_peer_credentials(writer.get_extra_info("socket")))
        self.jobs: dict[str, JailedJob | None] = {}
        self.pending_calls: dict[tuple[str, int], asyncio.Future[tuple[bool, Any]]] = {}
        self.closed = False
        self.jail_sessions: dict[str, JailSession] = {}
        self._paused: set[JailedJob] = set()  # jobs whose output waits for this client
        self._drainer: asyncio.Task[None] | None = None
        limit = daemon.config.stream_buffer_bytes
        writer.transport.set_write_buffer_limits(high=limit, low=limit // 2)

    @property
    def who(self) -> str:
        return str(self.peer)

    def send(self, msg: Message) -> None:
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(self.conn.send(msg))

    def send_error(
        self, err: JaildError, ref: int | None = None, job_id: str | None = None
    ) -> None:
        with contextlib.suppress(JaildError):
            self.send(Error(code=err.code, message=err.message[:65536], ref=ref, job_id=job_id))

    async def serve(self) -> None:
        cfg = self.daemon.config
        try:
            try:
                async with asyncio.timeout(cfg.handshake_timeout_s):
                    hello = await self._next_message()
            except TimeoutError:
                raise ReadTimeout(
                    f"no Hello within {cfg.handshake_timeout_s:g} s of connecting"
                ) from None
            if not isinstance(hello, Hello):
                return
            # Admission answers the Hello (rather than closing on connect), so the client
            # always gets to read why it was refused.
            refusal = self.daemon.admit(self)
            if refusal is not None:
                log.warning("refused connection from %s: %s", self.who, refusal.message)
                self.daemon.refused(self.peer, refusal.code, refusal.message)
                self.send_error(refusal)
                await self._flush()
                return
            self.send(Welcome(protocol=PROTOCOL_VERSION, daemon=f"jaild/{__version__}"))
            while True:
                msg = await self._next_message()
                if msg is None:
                    return
                await self._dispatch(msg)
                if self.writer.transport.get_write_buffer_size() > WRITE_BUFFER_HIGH:
                    await self.writer.drain()
        except RemoteProtocolError as exc:
            log.warning("client %s sent bad input: %s", self.who, exc.message)
            self.daemon.refused(self.peer, exc.code, exc.message)
            self.send_error(exc)
            await self._flush()
        except (ConnectionError, OSError):
            pass
        finally:
            await self.close()

    async def _flush(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self.writer.drain()

    async def _next_message(self) -> Message | None:
        while True:
            event = self.conn.next_event()
            if event is NEED_DATA:
                if self.conn.inside_frame:  # the client owes us the rest: not forever
                    timeout = self.daemon.config.frame_timeout_s
                    try:
                        async with asyncio.timeout(timeout):
                            data = await self.reader.read(1 << 16)
                    except TimeoutError:
                        raise ReadTimeout(
                            f"a frame was started but not finished within {timeout:g} s"
                        ) from None
                else:
                    data = await self.reader.read(1 << 16)
                self.conn.receive_data(data)
                continue
            if event is CLOSED:
                return None
            assert isinstance(event, Message)
            return event

    async def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, RunJob):
            try:
                self.daemon.submit(self, msg)
            except JaildError as exc:
                log.info("refused job from %s: %s: %s", self.who, exc.code, exc.message)
                self.daemon.refused(self.peer, exc.code, exc.message, policy=msg.policy)
                self.send_error(exc, ref=msg.ref)
        elif isinstance(msg, (ClientToolReturned, ClientToolFailed)):
            fut = self.pending_calls.pop((msg.job_id, msg.call_id), None)
            if fut is None:
                if msg.job_id not in self.jobs:
                    self.send_error(
                        UnknownJob(f"no job {msg.job_id} of this connection"), job_id=msg.job_id
                    )
                return  # a late answer for a call that already ended: harmless
            if not fut.done():
                if isinstance(msg, ClientToolReturned):
                    fut.set_result((True, msg.value))
                else:
                    fut.set_result((False, (msg.error_type, msg.message)))
        elif isinstance(msg, CancelJob):
            job = self.jobs.get(msg.job_id)
            if msg.job_id not in self.jobs:
                self.send_error(
                    UnknownJob(f"no running job {msg.job_id} of this connection"), job_id=msg.job_id
                )
            elif job is not None:
                job.cancel("cancelled by the client")
        elif isinstance(msg, OpenSession):
            try:
                self.daemon.open_session(self, msg)
            except JaildError as exc:
                self.daemon.refused(self.peer, exc.code, exc.message, policy=msg.policy)
                self.send_error(exc, ref=msg.ref)
        elif isinstance(msg, CloseSession):
            sess = self.jail_sessions.get(msg.session_id)
            if sess is None:
                self.send_error(
                    UnknownSession(f"no open session {msg.session_id} of this connection")
                )
            else:
                self.daemon.close_session(sess, "closed", "closed by the client")
        elif isinstance(msg, ListJobs):
            jobs = tuple(map(JobEntry.from_wire, self.daemon.list_jobs(self.peer)))
            self.send(JobList(ref=msg.ref, jobs=jobs))
        elif isinstance(msg, Kill):
            try:
                kind = self.daemon.kill(self.peer, msg.id)
            except JaildError as exc:
                self.send_error(exc, ref=msg.ref)
            else:
                self.send(Killed(ref=msg.ref, id=msg.id, kind=kind))
        elif isinstance(msg, GetStats):
            uid = None if self.peer.uid == 0 else self.peer.uid
            self.send(Stats(ref=msg.ref, stats=DaemonStats.from_wire(self.daemon.stats_wire(uid))))
        elif isinstance(msg, ListPolicies):
            self.send(
                PolicyList(
                    ref=msg.ref,
                    policies=tuple(
                        PolicyEntry.from_wire({
                            **p.summary(),
                            "available": p.name not in self.daemon.unavailable,
                            "problems": self.daemon.unavailable.get(p.name, ""),
                            "pool": self.daemon.pool_summary(p, jails=self.peer.uid == 0),
                        })
                        for p in self.daemon.policies.values()
                        if p.user_allowed(self.peer.uid, (self.peer.gid, *self.peer.groups))
                    ),
                )
            )

    def call_tool(
        self, job_id: str, call_id: int, name: str, args: bytes, approval: bool = False
    ) -> asyncio.Future[tuple[bool, Any]]:
        """Send a tool call to this client; the future gets its reply (a ToolRouter).
        ``approval``: the client must ask its approval callback before the handler."""
        if self.closed:
            raise ConnectionLost("the client is gone")
        fut: asyncio.Future[tuple[bool, Any]] = asyncio.get_running_loop().create_future()
        key = (job_id, call_id)
        self.pending_calls[key] = fut
        fut.add_done_callback(lambda _: self.pending_calls.pop(key, None))
        self.send(
            ClientCallTool(job_id=job_id, call_id=call_id, name=name, args=args, approval=approval)
        )
        return fut

    def output(self, job_id: str, stream: str, data: bytes) -> None:
        """Stream a job's output -- within the connection's buffer (``stream_buffer_bytes``).
        Past it, by the job's ``slow_client`` limit: its output is paused until the client
        reads (the jail blocks on write), or skipped on the stream (the record has it all)."""
        job = self.jobs.get(job_id)
        if job is not None and self._buffered() > self.daemon.config.stream_buffer_bytes:
            if job.spec.limits.slow_client == "truncate":
                job.output_dropped(len(data))
                return
            job.pause_output()
            self._paused.add(job)
            if self._drainer is None or self._drainer.done():
                self._drainer = asyncio.get_running_loop().create_task(self._drain_paused())
        self.send(JobOutput(job_id=job_id, stream=stream, data=data))

    def _buffered(self) -> int:
        if self.closed or self.writer.is_closing():
            return 0
        return int(self.writer.transport.get_write_buffer_size())

    async def _drain_paused(self) -> None:
        with contextlib.suppress(Exception):
            await self.writer.drain()  # until the buffer is below half of stream_buffer_bytes
        paused, self._paused = self._paused, set()
        for job in paused:
            job.resume_output()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fut in self.pending_calls.values():
            if not fut.done():
                fut.set_exception(ConnectionLost("the client disconnected"))
        self.pending_calls.clear()
        for job in list(self.jobs.values()):
            if job is not None:
                job.cancel("the client disconnected")
        for sess in list(self.jail_sessions.values()):
            self.daemon.close_session(sess, "disconnected", "the client disconnected")
        for job in self._paused:
            job.resume_output()
        self._paused.clear()
        with contextlib.suppress(Exception):
            self.writer.close()
        self.daemon.sessions.discard(self)


JAIL_LIMITS = ("memory_mb", "pids", "cpu_cores", "file_size_mb", "open_files")
"""Limits a jail is made with: a session's runs cannot change them."""


def _jail_limits(limits: Limits) -> dict[str, float]:
    return {k: getattr(limits, k) for k in JAIL_LIMITS}


class JailSession:
    """A jail kept for a series of runs of one client (``OpenSession``)."""

    def __init__(
        self,
        session_id: str,
        owner: ClientSession,
        policy: Policy,
        limits: Limits,
        tools: tuple[ToolSpec, ...],
        jail: JailedJob,
        idle_s: float,
        max_lifetime_s: float,
    ) -> None:
        self.id = session_id
        self.owner = owner
        self.policy = policy
        self.limits = limits
        self.tools = tools
        self.jail = jail
        self.idle_s = idle_s
        self.max_lifetime_s = max_lifetime_s
        self.created = time.time()
        self._opened = time.monotonic()
        self.last_used = time.monotonic()
        self.busy: str | None = None  # the job id of the run in progress
        self.closed: str | None = None  # why it ended
        self.requested: dict[str, float] = {}  # the limits asked for at open (runs add theirs)
        self.idle_timer: asyncio.TimerHandle | None = None
        self.life_timer: asyncio.TimerHandle | None = None  # set once the jail is ready

    def touch(self, daemon: Daemon, idle: bool = True) -> None:
        """A run starts (idle=False: no idle expiry while it runs) or ends (idle clock restarts)."""
        self.last_used = time.monotonic()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if idle:
            self.idle_timer = asyncio.get_running_loop().call_later(
                self.idle_s,
                daemon.close_session,
                self,
                "idle",
                f"no run for {self.idle_s:g} s (the session's idle limit)",
            )

    def expires_in(self) -> float:
        left = self.max_lifetime_s - (time.monotonic() - self._opened)
        if self.busy is None:
            left = min(left, self.idle_s - (time.monotonic() - self.last_used))
        return max(0.0, left)


class Daemon:
    """See the module docstring."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.policies: dict[str, Policy] = {}
        self.sessions: set[ClientSession] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.jobs: dict[str, JailedJob] = {}
        self.env: JailEnvironment | None = None
        self._server: asyncio.Server | None = None
        self._stopping = False
        self._stopped = asyncio.Event()
        self._owns_socket = False
        self._socket_inode: tuple[int, int] | None = None
        self._config_fds: list[int] = []
        self.swept: list[str] = []
        self.audit = AuditLog()
        self.probe_results: dict[str, list[Check]] = {}
        self._only: set[str] | None = None
        self.unavailable: dict[str, str] = {}
        self.pools: dict[str, JailPool] = {}
        self.jail_sessions: dict[str, JailSession] = {}
        self.owners: dict[str, tuple[ClientSession, float]] = {}  # job id -> client, start
        self.accounting = Accounting()
        self.metrics = Metrics(config.metrics_address)

    # ------------------------------------------------------------------ startup

    def load_policies(self) -> dict[str, Policy]:
        policies = load_policy_dir(self.config.policies_dir)
        problems = [
            str(err) for p in policies.values() for err in host_checks(p, self.config.envs_dir)
        ]
        if problems:
            raise StartupError("invalid policies:\n  " + "\n  ".join(problems))
        return policies

    async def start(self, only_policies: set[str] | None = None) -> None:
        """Start serving. ``only_policies``: serve just these (a private one-job daemon)."""
        self._only = only_policies
        self.audit = AuditLog(self.config.audit_log)
        try:
            self.policies = self.load_policies()
        except PolicyError as exc:
            raise StartupError(f"invalid policy: {exc.message}") from None
        # Claim the socket first: a second daemon for the same socket must stop here,
        # before it touches (let alone sweeps) the cgroup subtree the first one uses.
        sock = self._listening_socket()
        try:
            # before any jail is made: a busy metrics port refuses the start at once
            self.metrics.start(
                lambda: {
                    n: self.pool_summary(p) for n, p in self.policies.items() if n in self.pools
                }
            )
            await self._start_serving(sock)
        except BaseException:
            self.metrics.stop()
            sock.close()
            raise

    async def _start_serving(self, sock: socket.socket) -> None:
        try:
            cgroups = Cgroups(detect(self.config.subtree))
            cgroups.prepare()  # v2: finds the cgroup the daemon owns and moves in
        except CgroupError as exc:
            raise StartupError(str(exc)) from None
        if cgroups.placement is not None:
            log.info("cgroup v2: %s; job cgroups in %s", cgroups.placement.detail,
                     cgroups.subtree_dirs()[0])
        try:
            await self._start_with(sock, cgroups.layout, cgroups)
        except BaseException:
            # We hold the socket, so the subtree is ours: a failed start leaves none of it.
            if self.env is not None:
                for zygote in self.env.zygotes.values():
                    zygote.stop()
            cgroups.sweep()
            cgroups.remove_subtree()
            raise

    async def _start_with(
        self, sock: socket.socket, layout: CgroupLayout, cgroups: Cgroups
    ) -> None:
        self.swept = cgroups.sweep()
        if self.swept:
            log.warning(
                "swept %d job(s) left by an earlier run (killed their processes, removed their "
                "cgroups): %s",
                len(self.swept),
                " ".join(self.swept[:20]),
            )
        nsjail = locate_nsjail(self.config.nsjail)
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise StartupError(
                "setpriv (util-linux) is missing: jaild uses it to give every nsjail a "
                "parent-death signal, so no jail outlives the daemon. apt-get install util-linux"
            )
        become_child_subreaper()
        ensure_traversable(self.config.state_dir)
        interpreters = [
            os.path.join(resolve_env(p, self.config.envs_dir), "bin", "python3")
            for p in self.policies.values()
        ]
        runtime_dir = await asyncio.to_thread(stage_runtime, self.config.state_dir, interpreters)
        host = HostLayout(runtime_dir=runtime_dir, envs_dir=self.config.envs_dir, cgroup=layout)
        config_fds = {}
        specs = {}
        for name, policy in self.policies.items():
            fd = _sealed_memfd(f"jaild-{name}", nsjail_config(policy, host))
            self._config_fds.append(fd)
            config_fds[name] = fd
            specs[name] = build_spec(policy.seccomp_choice, network=policy.network.mode != "none")
        self.env = JailEnvironment(
            nsjail=nsjail,
            host=host,
            cgroups=cgroups,
            config_fds=config_fds,
            seccomp_specs=specs,
            seccomp_digests={
                name: seccomp_digest(bpf_program(spec)) for name, spec in specs.items()
            },
            audit=KernelAuditLog(),
            on_tool_call=self._tool_called,
            uid_base=self.config.uid_base,
            launcher=(setpriv, "--pdeathsig", "TERM", "--"),
            kill_grace_s=self.config.kill_grace_s,
        )
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if self._only is not None:
            self.unavailable.update(
                {
                    n: "not started in this private daemon"
                    for n in self.policies
                    if n not in self._only
                }
            )
        await self._start_zygotes(host, nsjail)
        if self.config.probe_policies:
            await self.probe_policies()
        self._start_pools()
        self._server = await asyncio.start_unix_server(self._accept, sock=sock, limit=1 << 16)
        where = (
            self.config.socket_path if self._owns_socket else f"{sock.getsockname()} (activated)"
        )
        log.info(
            "jaild %s serving %d policies (%s) on %s; nsjail %s; cgroup v%d subtree %s",
            __version__,
            len(self.policies),
            ", ".join(sorted(self.policies)),
            where,
            nsjail,
            layout.version,
            layout.subtree,
        )
        systemd.notify(f"READY=1\nSTATUS=serving {len(self.policies)} policies")

    async def _start_zygotes(self, host: HostLayout, nsjail: str) -> None:
        """Start the zygote of every served policy in zygote mode; a policy whose zygote
        does not come up is not served (its jails could not be made)."""
        env = self.env
        assert env is not None
        for index, (name, policy) in enumerate(sorted(self.policies.items())):
            if policy.pool.mode != "zygote" or name in self.unavailable:
                continue
            config = nsjail_config(policy, host, zygote=True, max_jobs=self.config.max_jobs)
            fd = _sealed_memfd(f"jaild-zygote-{name}", config)
            self._config_fds.append(fd)
            env.zygotes[name] = Zygote(
                policy,
                nsjail,
                host,
                env.cgroups,
                fd,
                zygote_uid=self.config.uid_base + JOB_UIDS + index,
                uid_base=self.config.uid_base,
                launcher=env.launcher,
                seccomp_spec=env.seccomp_specs[name],
                max_jobs=self.config.max_jobs,
            )
        names = list(env.zygotes)
        results = await asyncio.gather(
            *(env.zygotes[n].ensure_started() for n in names), return_exceptions=True
        )
        for name, outcome in zip(names, results, strict=True):
            if isinstance(outcome, BaseException):
                self.unavailable[name] = f"its zygote did not start: {outcome}"
                self.probe_results[name] = [
                    Check("zygote", False, str(outcome), "see the zygote's log above")
                ]
                log.error("policy %s will not be served: %s", name, self.unavailable[name])

    def _start_pools(self) -> None:
        env = self.env
        assert env is not None
        for name, policy in self.policies.items():
            # no warm jails for a policy no one may use (access.users = [])
            if policy.pool.max == 0 or name in self.unavailable or not policy.access.users:
                continue

            def make(policy: Policy = policy) -> JailedJob:
                # named for the job that will take it: its cgroup cannot be renamed (v2)
                jail_id = new_job_id()
                spec = JobSpec(jail_id, policy, policy.limits, "", "<pool>", ())
                return JailedJob(spec, env, None, None, jail_id=jail_id)

            self.pools[name] = JailPool(policy, make)
            self.pools[name].start()

    def pool_summary(self, policy: Policy, jails: bool = False) -> dict[str, Any]:
        """The policy's jail-making mode and its warm pool's state (for ``jaild policies``).
        ``jails``: also the ids of the ready jails (root only: the ids their jobs will get)."""
        pool = self.pools.get(policy.name)
        summary: dict[str, Any] = {
            "mode": policy.pool.mode,
            "min": policy.pool.min,
            "max": policy.pool.max,
            "target": pool.target if pool else 0,
            "ready": pool.size if pool else 0,
        }
        if pool is not None:
            summary.update(dataclasses.asdict(pool.stats))
            if jails:
                summary["jails"] = pool.ready_ids()
        return summary

    def _listening_socket(self) -> socket.socket:
        activated = systemd.listen_sockets()
        if activated:
            return activated[0]
        path = self.config.socket_path
        directory = os.path.dirname(os.path.abspath(path))
        gid = grp.getgrnam(self.config.socket_group).gr_gid if self.config.socket_group else -1
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o750)
            if gid >= 0:
                os.chown(directory, -1, gid)  # group members must traverse the 0750 directory
        if os.path.lexists(path):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)  # stale, from a daemon that died
                log.warning("removed stale socket %s", path)
            else:
                raise StartupError(f"another daemon is already listening on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o777 & ~self.config.socket_mode)
        try:
            sock.bind(path)  # created with the final mode: no chmod-after-bind window
        finally:
            os.umask(old_umask)
        if gid >= 0:
            os.chown(path, -1, gid)
        st = os.stat(path)
        self._socket_inode = (st.st_dev, st.st_ino)
        self._owns_socket = True
        sock.listen(512)
        return sock

    async def probe_policies(self) -> None:
        """Run the self-test of every policy; a policy that fails it is not served."""
        names = sorted(n for n in self.policies if n not in self.unavailable)
        results = await asyncio.gather(*(self._probe(self.policies[n]) for n in names))
        self.probe_results.update(zip(names, results, strict=True))
        for name, checks in zip(names, results, strict=True):
            failed = [c for c in checks if not c.ok]
            if failed:
                self.unavailable[name] = "it failed its self-test at start: " + "; ".join(
                    f"{c.name}: {c.detail}" for c in failed
                )
                log.error(
                    "policy %s failed its self-test and will not be served: %s",
                    name,
                    self.unavailable[name],
                )
            else:
                log.info("policy %s passed its self-test (%d checks)", name, len(checks))

    async def _probe(self, policy: Policy) -> list[Check]:
        assert self.env is not None
        hidden = host_paths_to_hide(
            policy, self.config.socket_path, self.config.state_dir, self.config.policies_dir
        )
        spec = JobSpec(
            job_id="probe-" + secrets.token_hex(8),
            policy=policy,
            limits=dataclasses.replace(
                policy.limits, wall_time_s=min(policy.limits.wall_time_s, 20)
            ),
            code=probe_code(policy, hidden),
            filename="<self-test>",
            tools=(ToolSpec(name=INSPECT_TOOL, description="the job seen from the host"),),
        )

        def inspect(
            job_id: str, call_id: int, name: str, args: bytes, approval: bool
        ) -> asyncio.Future[tuple[bool, Any]]:
            reply: asyncio.Future[tuple[bool, Any]] = asyncio.get_running_loop().create_future()
            reply.set_result((True, pack(job.host_view())))
            return reply

        job = JailedJob(spec, self.env, inspect, lambda *_: None)
        try:
            record = await job.run()
        except Exception as exc:  # a jaild bug: the policy is not proven, so not served
            log.exception("self-test of policy %s crashed", policy.name)
            return [Check("probe job", False, f"crashed: {exc}")]
        facts = unpack(job.result) if job.result is not None else None
        error = record.error.to_dict() if record.error is not None else None
        return evaluate(policy, record.status, error, facts, job.outside_uid)

    # ------------------------------------------------------------------ serving

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopping:
            writer.close()
            return
        try:
            session = ClientSession(self, reader, writer)
        except OSError:
            writer.close()
            return
        self.sessions.add(session)
        await session.serve()

    def admit(self, session: ClientSession) -> JaildError | None:
        """May this connection stay? (peer credentials, connection limits)"""
        peer = session.peer
        if not user_matches(self.config.allowed_users, peer.uid, (peer.gid, *peer.groups)):
            return PermissionDenied(f"uid {peer.uid} may not use this daemon")
        others = [s for s in self.sessions if s is not session]
        if len(others) >= self.config.max_connections:
            return Busy(f"{len(others)} connections open, the daemon's limit; retry later")
        same_uid = sum(1 for s in others if s.peer.uid == peer.uid)
        if same_uid >= self.config.max_connections_per_uid:
            return Busy(f"uid {peer.uid} already has {same_uid} connections, the limit per uid")
        return None

    def _policy_for(
        self, session: ClientSession, name: str, tools: tuple[ToolSpec, ...]
    ) -> Policy:
        """The policy a request names, if this peer may use it with these tools."""
        if self._stopping:
            raise ShuttingDown("the daemon is shutting down")
        policy = self.policies.get(name)
        if policy is None:
            raise UnknownPolicy(
                f"no policy {name!r}; this daemon serves: {', '.join(sorted(self.policies))}"
            )
        if policy.name in self.unavailable:
            raise PolicyUnavailable(
                f"policy {policy.name!r} is not served: {self.unavailable[policy.name]}"
            )
        if not policy.user_allowed(session.peer.uid, (session.peer.gid, *session.peer.groups)):
            raise PermissionDenied(f"uid {session.peer.uid} may not use policy {policy.name!r}")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise BadRequest("tool names must be unique")
        refused = [n for n in names if not policy.tool_allowed(n)]
        if refused:
            raise PermissionDenied(
                f"policy {policy.name!r} does not allow tool(s) {', '.join(refused)} "
                f"(allowed: {', '.join(policy.access.tools)})"
            )
        assert self.env is not None
        for tool in tools:
            problem = self.env.check_schema(tool.parameters)
            if problem:
                raise BadRequest(f"tool {tool.name!r}: its parameters are not a valid JSON schema: "
                                 f"{problem}")
        return policy

    @staticmethod
    def _limits_for(policy: Policy, requested: Mapping[str, float]) -> Limits:
        try:
            return effective_limits(policy, requested)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def _check_files(
        self, policy: Policy, files: Mapping[str, bytes], download: tuple[str, ...]
    ) -> None:
        """Uploads within the policy's ``[files]`` limits, every name a plain relative path."""
        if not files and not download:
            return
        assert self.env is not None
        problem = check_file_set(files, self.env.file_limits(policy))
        if problem is not None:
            path, reason = problem
            raise BadRequest(f"upload {path!r} refused by policy {policy.name!r}: {reason}")
        for pattern in download:
            if "\x00" in pattern:
                raise BadRequest(f"download pattern {pattern!r} contains NUL")

    def submit(self, session: ClientSession, req: RunJob) -> None:
        """Validate a RunJob and start it. Raises a JaildError the client gets as Error."""
        if req.session_id is not None:
            self._submit_to_session(session, req)
            return
        policy = self._policy_for(session, req.policy, req.tools)
        self._check_code(policy, req.code)
        limits = self._limits_for(policy, req.limits)
        self._check_files(policy, req.files, req.download)
        if len(self.jobs) >= self.config.max_jobs:
            raise Busy(f"{len(self.jobs)} jobs running, the daemon's limit; retry later")
        if len(session.jobs) >= self.config.max_jobs_per_connection:
            raise Busy(
                f"{len(session.jobs)} jobs running on this connection, the limit per connection"
            )
        job_id = new_job_id()
        if self._syntax_error(session, req, job_id, policy, limits):
            return
        assert self.env is not None
        pool = self.pools.get(policy.name)
        pooled = pool.take() if pool is not None and poolable(policy, limits) else None
        if pooled is not None:
            job_id = pooled.jail_id  # made under the id of the job that takes it
        spec = JobSpec(
            job_id=job_id,
            policy=policy,
            limits=limits,
            code=req.code,
            filename=req.filename,
            tools=req.tools,
            files=req.files,
            download=req.download,
            download_changed=req.download_changed,
        )
        if pooled is not None:
            job = pooled
            job.assign(spec, session.call_tool, session.output)  # its code is on its way now
        else:
            job = JailedJob(spec, self.env, session.call_tool, session.output)
        # Accepted after a pooled jail got its code (it starts a write earlier); still before
        # anything about the job can reach the client, which only happens on a later callback.
        session.send(JobAccepted(ref=req.ref, job_id=job_id))
        session.jobs[job_id] = job
        self.jobs[job_id] = job
        self.owners[job_id] = (session, time.time())
        task = asyncio.get_running_loop().create_task(self._run(session, job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    def _check_code(policy: Policy, code: str) -> None:
        code_bytes = len(code.encode("utf-8", "surrogatepass"))
        if code_bytes > policy.limits.code_bytes:
            raise BadRequest(
                f"the code is {code_bytes} bytes; policy {policy.name!r} accepts at most "
                f"{policy.limits.code_bytes}"
            )

    def _syntax_error(
        self, session: ClientSession, req: RunJob, job_id: str, policy: Policy, limits: Limits
    ) -> bool:
        """Code that does not compile gets its record at once (no jail); True if so."""
        try:
            compile(
                req.code,
                req.filename,
                "exec",
                flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                dont_inherit=True,
            )
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
            record = syntax_error_record(job_id, policy, limits, exc)
            if req.session_id is not None:
                record = with_session(record, req.session_id, None, None)
            self._audit(session, record)  # audited before the client can see the result
            session.send(JobAccepted(ref=req.ref, job_id=job_id))
            session.send(JobFinished(job_id=job_id, record=record))
            return True
        return False

    # ------------------------------------------------------------------ sessions

    def open_session(self, client: ClientSession, req: OpenSession) -> None:
        """Make a jail that stays for a series of runs; answered by SessionOpened once it
        is ready (or Error if it cannot be made)."""
        policy = self._policy_for(client, req.policy, req.tools)
        if not policy.session.enabled:
            raise PermissionDenied(f"policy {policy.name!r} does not allow sessions")
        limits = self._limits_for(policy, req.limits)
        idle_s = policy.session.idle_s
        lifetime_s = policy.session.max_lifetime_s
        for key, wanted, allowed in (
            ("idle_s", req.idle_s, idle_s),
            ("max_lifetime_s", req.max_lifetime_s, lifetime_s),
        ):
            if wanted is not None and wanted > allowed:
                raise BadRequest(
                    f"session {key}={wanted:g} is looser than policy {policy.name!r} allows "
                    f"({allowed:g}); sessions may only tighten it"
                )
        idle_s = req.idle_s if req.idle_s is not None else idle_s
        lifetime_s = req.max_lifetime_s if req.max_lifetime_s is not None else lifetime_s
        mine = sum(1 for s in self.jail_sessions.values() if s.owner.peer.uid == client.peer.uid)
        if mine >= policy.session.max_per_user:
            raise Busy(
                f"uid {client.peer.uid} has {mine} sessions open; policy {policy.name!r} "
                f"allows {policy.session.max_per_user} per user"
            )
        if len(self.jobs) + len(self.jail_sessions) >= self.config.max_jobs:
            raise Busy("the daemon is at its job limit; retry later")
        assert self.env is not None
        session_id = "ses-" + secrets.token_hex(8)
        # the jail's CPU rlimit covers the session; each run's cpu_time_s is watched apart
        jail_limits = dataclasses.replace(limits, cpu_time_s=policy.session.cpu_time_s)
        spec = JobSpec(session_id, policy, jail_limits, "", "<session>", req.tools, keep=True)
        jail = JailedJob(spec, self.env, None, None, jail_id=session_id)
        sess = JailSession(session_id, client, policy, limits, req.tools, jail, idle_s, lifetime_s)
        sess.requested = dict(req.limits)
        self.jail_sessions[session_id] = sess
        self.metrics.sessions_open(len(self.jail_sessions))
        client.jail_sessions[session_id] = sess
        task = asyncio.get_running_loop().create_task(self._open(sess, req.ref))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _open(self, sess: JailSession, ref: int) -> None:
        client = sess.owner
        ready = await sess.jail.prepare()
        if not ready or sess.closed is not None:
            detail = sess.closed or "the jail did not start"
            if not ready:
                record = await sess.jail._final_record()
                error = record.error
                detail = f"{error.type}: {error.message}" if error else "JailStartFailed"
            self._forget_session(sess)
            sess.jail.cleanup()
            client.send_error(InternalError(f"the session's jail did not start: {detail}"), ref=ref)
            return
        loop = asyncio.get_running_loop()
        sess.life_timer = loop.call_later(
            sess.max_lifetime_s,
            self.close_session,
            sess,
            "lifetime",
            f"the session reached its maximum lifetime of {sess.max_lifetime_s:g} s",
        )
        sess.touch(self)
        watch = asyncio.get_running_loop().create_task(self._watch_session(sess))
        self.tasks.add(watch)
        watch.add_done_callback(self.tasks.discard)
        self.accounting.session(client.peer.uid, sess.policy.name)
        self.audit.session(client.peer, "opened", sess.id, sess.policy.name)
        client.send(
            SessionOpened(
                ref=ref,
                session_id=sess.id,
                record=SessionInfo(
                    policy=sess.policy.name,
                    idle_s=sess.idle_s,
                    max_lifetime_s=sess.max_lifetime_s,
                    limits=dataclasses.asdict(sess.limits),
                ),
            )
        )

    def _submit_to_session(self, client: ClientSession, req: RunJob) -> None:
        assert req.session_id is not None
        sess = client.jail_sessions.get(req.session_id)
        if sess is None:
            raise UnknownSession(f"no open session {req.session_id} of this connection")
        if sess.closed is not None:
            raise SessionClosed(f"session {sess.id} is closed: {sess.closed}")
        if sess.busy is not None:
            raise Busy(f"session {sess.id} is running job {sess.busy}; one run at a time")
        if sess.life_timer is None:
            raise Busy(f"session {sess.id} is still starting; wait for SessionOpened")
        if req.policy != sess.policy.name:
            raise BadRequest(
                f"session {sess.id} runs policy {sess.policy.name!r}, not {req.policy!r}"
            )
        if req.tools and req.tools != sess.tools:
            raise BadRequest("a session's tools are given when it opens, not per run")
        policy = sess.policy
        self._check_code(policy, req.code)
        limits = self._limits_for(policy, {**sess.requested, **req.limits})
        fixed = {
            k: v for k, v in _jail_limits(limits).items() if v != _jail_limits(sess.limits)[k]
        }
        if fixed:
            raise BadRequest(
                f"{', '.join(sorted(fixed))} apply to the whole session; set them when opening it"
            )
        self._check_files(policy, req.files, req.download)
        job_id = new_job_id()
        if self._syntax_error(client, req, job_id, policy, limits):
            return
        spec = JobSpec(
            job_id,
            policy,
            limits,
            req.code,
            req.filename,
            sess.tools,
            req.files,
            req.download,
            req.download_changed,
            keep=True,
        )
        sess.busy = job_id
        sess.touch(self, idle=False)
        client.send(JobAccepted(ref=req.ref, job_id=job_id))
        client.jobs[job_id] = sess.jail
        self.jobs[job_id] = sess.jail
        self.owners[job_id] = (client, time.time())
        task = asyncio.get_running_loop().create_task(self._run_in_session(client, sess, spec))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run_in_session(
        self, client: ClientSession, sess: JailSession, spec: JobSpec
    ) -> None:
        job_id = spec.job_id
        try:
            try:
                record, result, downloads = await sess.jail.run_next(
                    spec, client.call_tool, client.output
                )
            except Exception as exc:  # a jaild bug: report it, end the session, keep serving
                log.exception("job %s of session %s failed inside jaild", job_id, sess.id)
                record = internal_error_record(spec.job_id, spec.policy, spec.limits, exc)
                result, downloads = None, {}
                sess.jail.cancel("internal error")
            alive = sess.jail.alive
            record = with_session(record, sess.id, sess.jail.runs, None if alive else record.status)
            self._audit(client, record, uploaded=len(spec.files), downloaded=len(downloads))
            client.send(JobFinished(job_id=job_id, record=record, result=result, files=downloads))
        finally:
            self.jobs.pop(job_id, None)
            self.owners.pop(job_id, None)
            client.jobs.pop(job_id, None)
            sess.busy = None
        if not sess.jail.alive:
            why = f"run {job_id} ended the session: {record.error.message if record.error else ''}"
            self.close_session(sess, record.status, why)
        elif sess.closed is None:
            sess.touch(self)

    async def _watch_session(self, sess: JailSession) -> None:
        """A session's jail that dies between runs (its code left a thread that broke the
        channel protocol, a background process hit a limit) ends the session at once."""
        status, error = await sess.jail.ended()
        if sess.closed is None and sess.busy is None:
            why = (error or {}).get("message", "")
            self.close_session(sess, status, f"the session's jail ended between runs: {why}")

    def close_session(self, sess: JailSession, reason: str, message: str) -> None:
        """End a session: its jail is killed (a run in progress ends ``cancelled``), its
        client is told. Idempotent."""
        if sess.closed is not None:
            return
        sess.closed = reason
        for timer in (sess.idle_timer, sess.life_timer):
            if timer is not None:
                timer.cancel()
        if sess.busy is not None:
            sess.jail.cancel(f"the session was closed ({reason}): {message}")
        self._forget_session(sess)
        task = asyncio.get_running_loop().create_task(sess.jail.discard(f"session {reason}"))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.audit.session(sess.owner.peer, "closed", sess.id, sess.policy.name, reason=reason)
        sess.owner.send(SessionClosedMsg(session_id=sess.id, reason=reason, message=message[:4096]))

    def _forget_session(self, sess: JailSession) -> None:
        self.jail_sessions.pop(sess.id, None)
        self.metrics.sessions_open(len(self.jail_sessions))
        sess.owner.jail_sessions.pop(sess.id, None)

    # ------------------------------------------------------------------ ps, kill, stats

    def list_jobs(self, peer: Peer) -> list[dict[str, Any]]:
        """Running jobs and open sessions: all of them for root, else the peer's own."""
        now = time.time()
        out: list[dict[str, Any]] = []
        for job_id, (client, started) in list(self.owners.items()):
            job = self.jobs.get(job_id)
            if job is None or (peer.uid != 0 and client.peer.uid != peer.uid):
                continue
            out.append(
                {
                    "id": job_id,
                    "kind": "job",
                    "policy": job.spec.policy.name,
                    "uid": client.peer.uid,
                    "client_pid": client.peer.pid,
                    "state": "running" if job.alive else "starting",
                    "age_s": round(max(0.0, now - started), 3),  # the wall clock may step back
                    "session": job.jail_id if job.jail_id.startswith("ses-") else None,
                    **job.live_usage(),
                }
            )
        for sess in list(self.jail_sessions.values()):
            owner = sess.owner.peer
            if peer.uid != 0 and owner.uid != peer.uid:
                continue
            out.append(
                {
                    "id": sess.id,
                    "kind": "session",
                    "policy": sess.policy.name,
                    "uid": owner.uid,
                    "client_pid": owner.pid,
                    "state": "starting"
                    if sess.life_timer is None
                    else ("running" if sess.busy else "idle"),
                    "age_s": round(max(0.0, now - sess.created), 3),
                    "runs": sess.jail.runs,
                    "running": sess.busy,
                    "idle_s": round(time.monotonic() - sess.last_used, 3),
                    "expires_in_s": round(sess.expires_in(), 3),
                    **sess.jail.live_usage(),
                }
            )
        return out

    def kill(self, peer: Peer, ident: str) -> str:
        """``jaild kill``: end a job or session of the peer's (any, for root)."""
        sess = self.jail_sessions.get(ident)
        owner = sess.owner if sess is not None else self.owners.get(ident, (None, 0.0))[0]
        if owner is None or (peer.uid != 0 and owner.peer.uid != peer.uid):
            raise UnknownJob(f"no running job or open session {ident} of uid {peer.uid}")
        why = f"killed by uid {peer.uid} (jaild kill)"
        self.audit.killed(peer, ident)
        if sess is not None:
            self.close_session(sess, "killed", why)
            return "session"
        self.jobs[ident].cancel(why)
        return "job"

    def stats_wire(self, uid: int | None) -> dict[str, Any]:
        stats = self.accounting.to_wire(uid)
        stats["running"] = {
            "jobs": len(self.jobs),
            "sessions": len(self.jail_sessions),
            "connections": len(self.sessions),
        }
        stats["pools"] = {
            name: self.pool_summary(p) for name, p in self.policies.items() if name in self.pools
        }
        stats["metrics"] = self.metrics.summary()
        if uid is not None:  # other users' tool names and counts are theirs
            for key in ("tool_calls", "tool_latency"):
                stats["metrics"].pop(key, None)
        return stats

    async def _run(self, session: ClientSession, job: JailedJob) -> None:
        job_id = job.spec.job_id
        try:
            try:
                record = await job.run()
            except Exception as exc:  # a jaild bug: report it, keep serving
                log.exception("job %s failed inside jaild", job_id)
                spec = job.spec
                record = internal_error_record(spec.job_id, spec.policy, spec.limits, exc)
                job.result = None
                job.downloads = {}
            # audited before the client can see the result
            self._audit(
                session, record, uploaded=len(job.spec.files), downloaded=len(job.downloads)
            )
            session.send(
                JobFinished(job_id=job_id, record=record, result=job.result, files=job.downloads)
            )
        finally:
            self.jobs.pop(job_id, None)
            self.owners.pop(job_id, None)
            session.jobs.pop(job_id, None)
            self.reap_orphans()

    def reap_orphans(self) -> list[int]:
        """Reap children that are not a running job's nsjail.

        The daemon is a child subreaper: when an nsjail dies before its jail (it was
        SIGKILLed after the grace period), the jail's processes are reparented here, get
        their parent-death SIGKILL and must be reaped by us.
        """
        tracked = {job.pid for job in self.jobs.values() if job.pid is not None}
        if self.env is not None:
            tracked |= {z.pid for z in self.env.zygotes.values() if z.pid is not None}
        reaped = []
        for pid in _children() - tracked:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
        return reaped

    def _audit(
        self, session: ClientSession, record: JobRecord, uploaded: int = 0, downloaded: int = 0
    ) -> None:
        self.audit.job(session.peer, record)
        self.accounting.job(session.peer.uid, record, uploaded, downloaded)
        self.metrics.job_finished(record, session.peer.uid)

    def _tool_called(
        self, job_id: str, policy: str, tool: str, outcome: str, duration_s: float
    ) -> None:
        owner = self.owners.get(job_id)
        self.audit.tool_call(owner[0].peer if owner else None, job_id, tool, outcome, duration_s)
        self.metrics.tool_call(policy, tool, outcome, duration_s)

    def refused(self, peer: Peer, code: str, message: str, **extra: Any) -> None:
        """A connection or request was refused: audited and counted."""
        self.audit.refused(peer, code, message, **extra)
        self.metrics.refused(code)

    # ------------------------------------------------------------------ shutdown

    async def stop(self, grace_s: float | None = None) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        systemd.notify("STOPPING=1")
        if self._server is not None:
            self._server.close()
        for job in list(self.jobs.values()):
            job.cancel("the daemon is shutting down")
        for sess in list(self.jail_sessions.values()):
            self.close_session(sess, "shutdown", "the daemon is shutting down")
        pools, self.pools = list(self.pools.values()), {}
        await asyncio.gather(*(pool.close() for pool in pools), return_exceptions=True)
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=grace_s or self.config.shutdown_grace_s)
        if self.env is not None:
            for zygote in self.env.zygotes.values():
                zygote.stop()
        for session in list(self.sessions):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(session.writer.drain(), timeout=1.0)
            await session.close()
        if self._owns_socket:
            with contextlib.suppress(OSError):
                st = os.stat(self.config.socket_path)
                if (st.st_dev, st.st_ino) == self._socket_inode:
                    os.unlink(self.config.socket_path)
        self.audit.close()
        self.metrics.stop()
        if self.env is not None:
            self.env.audit.close()
            await asyncio.sleep(0)  # let the cleanups of the jobs just ended run
            # Only ours (we held the socket): whatever a job left is killed and removed, so the
            # subtree goes too -- nothing of a stopped daemon stays behind.
            self.env.cgroups.sweep()
            self.env.cgroups.remove_subtree()
        for fd in self._config_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._config_fds.clear()
        log.info("jaild stopped")
        self._stopped.set()


async def serve(config: DaemonConfig) -> None:
    """Run a daemon until SIGTERM/SIGINT, then stop it gracefully.

    The signal handlers are installed before start-up, so a stop request that
    arrives while the daemon is still starting stops it as soon as it serves.
    """
    import signal

    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await daemon.start()
        waiter = asyncio.ensure_future(stop_requested.wait())
        served = asyncio.ensure_future(daemon.serve_forever())
        await asyncio.wait([waiter, served], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        served.cancel()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await daemon.stop()


__all__ = ["ClientSession", "Daemon", "InternalError", "StartupError", "serve"]
