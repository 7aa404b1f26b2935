"""Testing against jaild without root: frame helpers, a fake launcher, a daemon in memory.

This is jaild's ``trio.testing``: helpers that ship with the package so that users and
jaild's own tests can exercise the real protocol, the real daemon core and the real
in-jail runtime on any machine -- no root, no namespaces, no cgroups, no nsjail, no
staged runtime, no jail environment.

.. warning::

   Nothing here isolates anything. :class:`FakeLauncher` runs the job's code as a plain
   child process of the test, as the test's user, with the test's interpreter, its
   files, its network and no limit on memory, processes or CPU time. Use it for code you
   would run anyway (your own tests), never for untrusted code.

The three parts:

* **Frames** -- :func:`frame` and :func:`frames` turn messages into wire bytes and back;
  :class:`ConnectionPair` wires two :class:`~jaild.protocol.Connection` ends to each
  other in memory (the client link, or the jail link), as h11's test ``ConnectionPair``
  does: ``pair.send(Role.CLIENT, msg)`` returns what the other end received.
* **A fake launcher** -- :class:`FakeLauncher` implements the daemon's
  :class:`~jaild.daemon.jails.launch.handle.Launcher`: it starts the real runtime
  (:func:`jaild.runtime.main.main`) in a subprocess with its channel on a socketpair, so
  a :class:`~jaild.daemon.jails.job.JailedJob` drives it exactly as it drives a jail. The one
  step it leaves out is hardening (no capabilities dropped, no seccomp filter): its
  ``JailReady`` reports the digest :data:`UNHARDENED`, which the fake daemon expects. The
  runtime's own refusal of network attempts under a policy without a network
  (:mod:`jaild.runtime.network`) is there, as in a jail; the filter behind it is not.
* **A daemon in memory** -- :func:`fake_daemon` runs the real daemon core (the server
  shell, admission, the pipeline, placement, sessions, the registry, the job machine and
  its broker) with the fake launcher; :meth:`FakeDaemon.connect` gives an
  :class:`~jaild.client.AsyncClient` connected to it over a socketpair
  (:meth:`FakeDaemon.raw_connection`: a socket to write frames at it by hand), and
  :func:`daemon_pair` does both::

      async with jaild.testing.daemon_pair() as client:
          r = await client.run("tools.double(x=21)", tools={"double": lambda x: 2 * x})
          assert r.status == "ok" and r.result == 42

  :func:`daemon_thread` runs the same daemon on a thread and a Unix socket, for the
  blocking :class:`~jaild.client.Client` (or for code that finds jaild by
  ``JAILD_SOCKET``).

What the fake daemon leaves out, besides isolation: start-up (no socket of its own
unless :func:`daemon_thread`, no self-tests, no zygotes, no warm pools: every job gets a
fresh process), the cgroup's accounting (no memory or CPU usage in records, no OOM, no
session CPU watch), the kernel's seccomp evidence, and the reaping of orphans (it is not
a subreaper; it reaps its own jails only). Admission, the broker's rules (schemas,
quotas, approvals, timeouts, payload limits), the wall-clock limit, the output limit,
sessions, cancellation and the records are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaild.client import MAX_FRAME as CLIENT_MAX_FRAME
from jaild.client import Approver, AsyncClient
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core.machine import Exited, JobSpec, Spawned
from jaild.daemon.jails.cgroups import Cgroups
from jaild.daemon.jails.job import JailEnvironment
from jaild.daemon.jails.kernlog import KernelAuditLog
from jaild.daemon.jails.launch.handle import JailHandle
from jaild.daemon.jails.launch.spawned import watch_exit
from jaild.daemon.server import Daemon
from jaild.daemon.startup import Served
from jaild.errors import RemoteProtocolError
from jaild.policy.compile import CgroupLayout, HostLayout
from jaild.policy.schema import Policy, load_policy_text
from jaild.policy.seccomp import build_spec
from jaild.protocol import (
    CLOSED,
    NEED_DATA,
    PROTOCOL_VERSION,
    Connection,
    FrameDecoder,
    Role,
    encode_frame,
)
from jaild.protocol.messages import (
    Direction,
    Harden,
    Hello,
    JailReady,
    Message,
    Welcome,
    decode,
    encode,
)
from jaild.runtime.main import JAIL_MAX_FRAME
from jaild.tracing import OFF, Tracing

UNHARDENED = "none: jaild.testing's fake jail loads no seccomp filter"
"""The seccomp digest a fake jail reports, and the only one the fake daemon accepts."""

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- frames

def frame(message: Message, max_frame_bytes: int = CLIENT_MAX_FRAME) -> bytes:
    """One message as it travels on the wire: its 4-byte length, then its msgpack.

    Unlike :meth:`Connection.send <jaild.protocol.Connection.send>` this checks no
    state: it is for writing raw (also out-of-order) frames at a daemon or a runtime.

    Raises:
        LocalProtocolError: the frame would be larger than ``max_frame_bytes``.
    """
    return encode_frame(encode(message), max_frame_bytes)


def frames(
    data: bytes, direction: Direction, max_frame_bytes: int = CLIENT_MAX_FRAME
) -> list[Message]:
    """Every message in ``data`` (whole frames only), decoded as sent in ``direction``
    (``"client->daemon"``, ``"daemon->client"``, ``"daemon->jail"``, ``"jail->daemon"``).

    Raises:
        RemoteProtocolError: a frame does not decode, is too large, or ``data`` ends
            inside a frame.
    """
    decoder = FrameDecoder(max_frame_bytes)
    decoder.feed(data)
    out = []
    while (payload := decoder.next_frame()) is not None:
        out.append(decode(payload, direction))
    if decoder.buffered_bytes:
        raise RemoteProtocolError(f"{decoder.buffered_bytes} bytes left inside a frame")
    return out


class ConnectionPair:
    """Two ends of one link, wired to each other in memory (h11's ``ConnectionPair``).

    ``send(role, *messages)`` sends from ``role``'s end and feeds the bytes to the other
    end; it returns what that end received (every message, and ``CLOSED`` if it saw the
    end of the stream). Both ends keep their states, so an illegal order raises as it
    would on a real link: :class:`~jaild.errors.LocalProtocolError` from the sender.

    Args:
        first: one end (:meth:`client_link` and :meth:`jail_link` make both).
        second: the other end.
    """

    def __init__(self, first: Connection, second: Connection) -> None:
        self.ends = {first.role: first, second.role: second}
        self._peer = {first.role: second, second.role: first}

    @classmethod
    def client_link(cls, max_frame_bytes: int = CLIENT_MAX_FRAME) -> ConnectionPair:
        """A client (:attr:`Role.CLIENT`) and a daemon (:attr:`Role.DAEMON`)."""
        return cls(
            Connection(Role.CLIENT, max_frame_bytes), Connection(Role.DAEMON, max_frame_bytes)
        )

    @classmethod
    def jail_link(cls, max_frame_bytes: int = JAIL_MAX_FRAME) -> ConnectionPair:
        """A daemon's end (:attr:`Role.SUPERVISOR`) and a runtime's (:attr:`Role.JAIL`)."""
        return cls(
            Connection(Role.SUPERVISOR, max_frame_bytes), Connection(Role.JAIL, max_frame_bytes)
        )

    def __getitem__(self, role: Role) -> Connection:
        return self.ends[role]

    def send(self, role: Role, *messages: Message) -> list[Any]:
        """Send ``messages`` from ``role``'s end; return what the other end received."""
        data = b"".join(self.ends[role].send(m) for m in messages)
        return self.feed(self._peer[role], data)

    def close(self, role: Role) -> list[Any]:
        """``role``'s end closes its stream; return what the other end then reads."""
        return self.feed(self._peer[role], b"")

    @staticmethod
    def feed(conn: Connection, data: bytes) -> list[Any]:
        """Feed ``data`` to ``conn`` (``b""``: end of stream); return its events."""
        conn.receive_data(data)
        out: list[Any] = []
        while (event := conn.next_event()) is not NEED_DATA:
            out.append(event)
            if event is CLOSED:
                break
        return out

    def handshake(self) -> None:
        """Say the link's opening lines: ``Hello``/``Welcome``, or ``Harden``/``JailReady``."""
        if Role.CLIENT in self.ends:
            self.send(Role.CLIENT, Hello(protocol=PROTOCOL_VERSION, client="jaild.testing"))
            self.send(Role.DAEMON, Welcome(protocol=PROTOCOL_VERSION, daemon="jaild.testing"))
        else:
            self.send(Role.SUPERVISOR, Harden(protocol=PROTOCOL_VERSION, seccomp={}))
            self.send(Role.JAIL, JailReady(protocol=PROTOCOL_VERSION, seccomp_digest=UNHARDENED))


# ----------------------------------------------------------------------------- the launcher

_BOOTSTRAP = f"""\
import sys
sys.path.insert(0, {_PACKAGE_ROOT!r})
from jaild.runtime import harden

def unhardened(seccomp_spec):
    # jaild.testing: no capability is dropped and no seccomp filter loaded
    harden.die_with_parent()
    return {UNHARDENED!r}

harden.harden = unhardened
from jaild.runtime.main import main
main()
"""
"""The fake jail's program: the real runtime, with hardening replaced by a no-op."""


class FakeLauncher:
    """A :class:`~jaild.daemon.jails.launch.handle.Launcher` that isolates NOTHING.

    It runs the real in-jail runtime as a plain child process of the caller: no
    namespaces, no cgroup, no seccomp filter, no uid of its own, no memory, process or
    CPU-time limit, the caller's interpreter and network, and the whole host file system
    (its working directory is a fresh temporary directory, removed when it exits). Only
    the protocol is real: its channel is a socketpair on its stdin, its stdout and stderr
    are pipes, its exit status is reported as a zygote reports a jail's, and what it
    leaves in its process group is killed when it exits. Never run untrusted code with it.
    """

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    async def start(
        self, handle: JailHandle, spec: JobSpec, uid: int, *, pooled: bool,
        on_sent: Callable[[], None],
    ) -> None:
        """Start the runtime for ``spec`` (``uid`` and ``pooled`` are ignored); see
        :meth:`Launcher.start <jaild.daemon.jails.launch.handle.Launcher.start>`."""
        daemon_end, jail_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        workdir = tempfile.mkdtemp(prefix=f"jaild-testing-{handle.jail_id}-")
        try:
            handle.proc = subprocess.Popen(
                [self.python, "-I", "-B", "-c", _BOOTSTRAP],
                stdin=jail_end.fileno(),
                stdout=out_w,
                stderr=err_w,
                cwd=workdir,
                close_fds=True,
                start_new_session=True,
                env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
            )
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            daemon_end.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            jail_end.close()
        # stdout, stderr and the channel: the jail is over when the runtime has exited and
        # all three reached EOF (no output and no CodeFinished is left unread)
        handle.feed(Spawned(forked=False, streams=3))
        _watch_exit(handle, handle.proc, workdir)
        handle.read_output(out_r, err_r)
        handle.open_channel(daemon_end)
        on_sent()


def _termination(status: int, pid: int) -> tuple[str, int, str, int]:
    """A wait status as the job machine takes a zygote's report of it."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"SIG{signum}"
        return ("signaled", signum, name, pid)
    return ("exited", os.WEXITSTATUS(status), "", pid)


def _watch_exit(handle: JailHandle, proc: subprocess.Popen[bytes], workdir: str) -> None:
    """Feed Exited when the runtime exits; first kill what it left in its process group
    (it is a zombie until reaped, so its pid cannot have been reused)."""
    pid = proc.pid

    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def ended(status: int, cpu_s: float) -> Exited:
        shutil.rmtree(workdir, ignore_errors=True)
        returncode = os.waitstatus_to_exitcode(status)
        return Exited(returncode=returncode, termination=_termination(status, pid), cpu_s=cpu_s)

    watch_exit(handle, proc, ended, before_reap=kill_group)


# ----------------------------------------------------------------------------- the daemon

PolicySource = str | Policy
"""A policy's TOML text (as in ``policies/NAME.toml``), or a loaded :class:`Policy`."""


def load_policies(policies: Mapping[str, PolicySource] | None) -> dict[str, Policy]:
    """``{name: TOML text or Policy}`` as the daemon's policies; None: one policy
    ``default`` with every default value.

    Raises:
        PolicyError: a policy that does not load (naming it and the key).
    """
    out = {}
    for name, source in (policies if policies is not None else {"default": ""}).items():
        policy = source if isinstance(source, Policy) else load_policy_text(source, f"{name}.toml")
        if policy.name != name:
            raise ValueError(f"policy {policy.name!r} given under the name {name!r}")
        out[name] = policy
    return out


def fake_environment(
    policies: Mapping[str, Policy], launcher: FakeLauncher | None = None, kill_grace_s: float = 1.0
) -> JailEnvironment:
    """The environment of a fake daemon's jails: every jail made by ``launcher`` (a
    :class:`FakeLauncher` by default), which reports :data:`UNHARDENED`. The ``Harden``
    frame each jail gets is the real one (the policy's seccomp spec and file limits)."""
    unused = CgroupLayout(version=2, subtree="jaild-testing-unused", v2_root="/nonexistent")
    return JailEnvironment(
        nsjail="/nonexistent/nsjail (jaild.testing runs no nsjail)",
        host=HostLayout(runtime_dir=_PACKAGE_ROOT, envs_dir="/nonexistent", cgroup=unused),
        cgroups=Cgroups(unused),
        config_fds={},
        seccomp_specs={
            name: build_spec(p.seccomp_choice, network=p.network.mode != "none")
            for name, p in policies.items()
        },
        seccomp_digests=dict.fromkeys(policies, frozenset({UNHARDENED})),
        audit=KernelAuditLog(os.devnull),
        uid_base=os.getuid(),
        kill_grace_s=kill_grace_s,
        stand_in=launcher or FakeLauncher(),
    )


@dataclass
class FakeDaemon:
    """A daemon core serving in this event loop (see :func:`fake_daemon`).

    Attributes:
        daemon: the real :class:`~jaild.daemon.server.Daemon` (its registry, audit,
            accounting and metrics may be inspected).
    """

    daemon: Daemon
    _tasks: asyncio.TaskGroup
    _clients: list[AsyncClient] = field(default_factory=list)

    async def connect(self, *, name: str = "", approve: Approver | None = None) -> AsyncClient:
        """A new connection to the daemon, over a socketpair, handshake done. It is closed
        when the daemon stops (or by ``await client.close()``).

        Raises:
            JaildError: the daemon refused the connection (e.g. ``max_connections``).
        """
        client = AsyncClient("<jaild.testing socketpair>", sock=self.raw_connection(),
                             name=name or "jaild.testing", approve=approve)
        await client.connect()
        self._clients.append(client)
        return client

    def raw_connection(self) -> socket.socket:
        """A new connection to the daemon, raw: the caller's end of a socketpair, nothing
        said yet -- for writing frames by hand (:func:`frame`) and reading what the daemon
        answers (:func:`frames`). The caller closes it."""
        daemon_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._tasks.create_task(self._serve(daemon_end))
        return client_end

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().create_unix_connection(self.daemon.protocol, sock=sock)
        except BaseException:
            sock.close()
            raise

    async def _close(self) -> None:
        for client in self._clients:
            await client.close()
        await self.daemon.stop()


@contextlib.asynccontextmanager
async def fake_daemon(
    policies: Mapping[str, PolicySource] | None = None,
    *,
    config: DaemonConfig | None = None,
    launcher: FakeLauncher | None = None,
    tracing: Tracing = OFF,
) -> AsyncIterator[FakeDaemon]:
    """Run the real daemon core with :class:`FakeLauncher` jails, in this event loop.

    Args:
        policies: ``{name: TOML text or Policy}``; default: one policy ``default`` with
            every default value. Each policy's ``[python] env`` is ignored: jails run
            the test's interpreter.
        config: the daemon's settings (limits, timeouts); its paths are not used.
        launcher: the jails' launcher (default: a :class:`FakeLauncher`).
        tracing: the daemon's tracing: off by default (the ``OTEL_*`` environment is not
            read); ``jaild.tracing.Tracing(provider)`` traces its jobs to ``provider``
            (an SDK ``TracerProvider``, e.g. with an in-memory exporter).

    Yields:
        A :class:`FakeDaemon`; it is stopped (its jobs cancelled, its sessions closed,
        its connections closed) when the block ends.

    Raises:
        PolicyError: a policy that does not load.
    """
    loaded = load_policies(policies)
    config = config or DaemonConfig(socket_path="<jaild.testing>", probe_policies=False)
    # The real daemon, given what it serves with: no socket of its own, no cgroup subtree
    # (owns_cgroups), and no reaping of this process's other children (they are the
    # caller's; the fake launcher reaps its jails).
    served = Served(policies=loaded, env=fake_environment(loaded, launcher, config.kill_grace_s),
                    owns_cgroups=False)
    daemon = Daemon(config, served=served, tracing=tracing, reap_orphans=False)
    # The connections' task group is held by a task of its own, so that an exception of
    # the caller's block reaches the caller as itself (not inside an ExceptionGroup).
    group: asyncio.Future[asyncio.TaskGroup] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()

    async def hold() -> None:
        async with asyncio.TaskGroup() as tasks:
            group.set_result(tasks)
            await stop.wait()

    holder = asyncio.get_running_loop().create_task(hold(), name="jaild.testing connections")
    try:
        daemon.connections = await group  # the daemon's connections run in it too
        fake = FakeDaemon(daemon, daemon.connections)
        try:
            yield fake
        finally:
            await fake._close()
    finally:
        stop.set()
        await holder


@contextlib.asynccontextmanager
async def daemon_pair(
    policies: Mapping[str, PolicySource] | None = None,
    *,
    config: DaemonConfig | None = None,
    approve: Approver | None = None,
    tracing: Tracing = OFF,
) -> AsyncIterator[AsyncClient]:
    """An :class:`~jaild.client.AsyncClient` connected to a :func:`fake_daemon`.

    ::

        async with daemon_pair({"default": "[limits]\\nwall_time_s = 5\\n"}) as client:
            r = await client.run("print(1 + 1)")
            assert r.stdout == "2\\n"

    Args: as :func:`fake_daemon`; ``approve``: the client's approval callback.
    """
    async with fake_daemon(policies, config=config, tracing=tracing) as fake:
        yield await fake.connect(approve=approve)


class DaemonThread:
    """A :func:`fake_daemon` on a thread and event loop of its own, serving the Unix
    socket :attr:`socket_path` (in a private temporary directory). Made by
    :func:`daemon_thread`."""

    def __init__(
        self,
        policies: Mapping[str, PolicySource] | None,
        config: DaemonConfig | None,
        tracing: Tracing = OFF,
    ) -> None:
        self._policies = load_policies(policies)  # a bad one raises here, not on the thread
        self._config = config
        self._tracing = tracing
        self._directory = tempfile.mkdtemp(prefix="jaild-testing-")
        self.socket_path = os.path.join(self._directory, "jaild.sock")
        self._serving = threading.Event()  # set once it serves, or failed to start
        self._stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="jaild-testing-daemon")

    def start(self) -> None:
        """Start the thread; return once the daemon serves.

        Raises:
            RuntimeError: it did not start (the cause attached).
        """
        self._thread.start()
        self._serving.wait()
        if self._error is not None:
            self.stop()
            raise RuntimeError("the fake daemon did not start") from self._error

    def stop(self) -> None:
        """Stop the daemon (its jobs cancelled), end the thread, remove the directory."""
        if self._stop is not None:
            loop, stop = self._stop
            with contextlib.suppress(RuntimeError):  # its loop is closed: it stopped already
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join()
        shutil.rmtree(self._directory, ignore_errors=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start() (or lost after a clean start)
            self._error = exc
        finally:
            self._serving.set()

    async def _serve(self) -> None:
        stop = asyncio.Event()
        self._stop = (asyncio.get_running_loop(), stop)
        async with fake_daemon(self._policies, config=self._config, tracing=self._tracing) as fake:
            daemon = fake.daemon
            daemon.served.server = await asyncio.get_running_loop().create_unix_server(
                daemon.protocol, path=self.socket_path
            )
            self._serving.set()
            await stop.wait()


@contextlib.contextmanager
def daemon_thread(
    policies: Mapping[str, PolicySource] | None = None,
    *,
    config: DaemonConfig | None = None,
    tracing: Tracing = OFF,
) -> Iterator[DaemonThread]:
    """A :func:`fake_daemon` on a thread of its own, serving a Unix socket in a private
    temporary directory -- for the blocking :class:`~jaild.client.Client`, or for code
    that finds jaild by ``JAILD_SOCKET``::

        with daemon_thread() as d, Client(d.socket_path) as client:
            assert client.run("6 * 7").result == 42

    Args: as :func:`fake_daemon`.

    Raises:
        PolicyError: a policy that does not load.
        RuntimeError: the daemon did not start.
    """
    served = DaemonThread(policies, config, tracing)
    served.start()
    try:
        yield served
    finally:
        served.stop()


_STDLIB_PATHS = {
    sysconfig.get_path(key, vars={"installed_base": sys.base_prefix, "base": sys.base_prefix,
                                  "installed_platbase": sys.base_exec_prefix,
                                  "platbase": sys.base_exec_prefix})
    for key in ("stdlib", "platstdlib")
}
_LIST_MODULES = (
    "import importlib, json, sys\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "print(json.dumps([(n, m.__file__, hasattr(m, '__path__')) for n, m in sys.modules.items()"
    " if getattr(m, '__file__', None)]))\n"
)


def copy_modules(directory: Path, modules: tuple[str, ...], timeout_s: float = 60) -> None:
    """Copy what importing ``modules`` loads from outside the standard library (and only
    that) into ``directory``, world-readable, so that another uid can import them from
    there -- with the base interpreter, ``-I -S`` -- wherever this checkout lives (a clone
    under a 0700 home is out of other uids' reach)."""
    listed = subprocess.run([sys.executable, "-c", _LIST_MODULES, *modules],
                            capture_output=True, text=True, timeout=timeout_s, check=True)
    for name, file, is_package in json.loads(listed.stdout):
        if any(file.startswith(p + os.sep) for p in _STDLIB_PATHS):
            continue
        parts = name.split(".") if is_package else name.split(".")[:-1]
        target = directory.joinpath(*parts, os.path.basename(file))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)
    for root, _dirs, files in os.walk(directory):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


__all__ = [
    "UNHARDENED",
    "ConnectionPair",
    "DaemonThread",
    "FakeDaemon",
    "FakeLauncher",
    "copy_modules",
    "daemon_pair",
    "daemon_thread",
    "fake_daemon",
    "fake_environment",
    "frame",
    "frames",
    "load_policies",
]
