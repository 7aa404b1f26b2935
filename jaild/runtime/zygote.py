"""The zygote: a per-(policy, client uid) template process that forks one fresh jail per job.

Theory of operation
-------------------
Starting a jail from nothing (nsjail, a new interpreter, the runtime's imports)
costs ~30 ms of CPU. The zygote pays it once: the daemon starts it in an nsjail
jail of its own -- the policy's read-only mounts, its own user, pid, mount, net,
ipc, uts and cgroup namespaces (on cgroup v2 it keeps the daemon's cgroup namespace, to fork
into its jobs' cgroups) -- but with its capabilities *kept* inside that
user namespace, and a uid map holding the daemon's whole range of job uids
(inside uid N = host uid N; inside 0 = the zygote's own host uid). That namespace is
owned by the zygote's own host uid (nsjail runs as it), so what its jails hold of the
kernel's per-user counts is charged to that uid, not to root; first thing, the zygote
caps each uid's share inside it (:data:`USERNS_LIMITS`). It imports the
runtime and the policy's ``preimport`` modules, then waits on its control socket
(fd 0, SOCK_SEQPACKET) for ``SpawnJail`` messages (:mod:`jaild.protocol.zygote_link`).

Each ``SpawnJail`` carries the per-jail part of the daemon's plan of the jail
(:class:`~jaild.protocol.zygote_link.JailSetup`, compiled by
:func:`jaild.policy.compile.compile_policy` -- the same plan spawn mode renders to
nsjail's config), and the job's channel, stdout and stderr as SCM_RIGHTS (on cgroup v2
also the job's cgroup, an ``O_PATH`` directory). The
zygote turns the plan into steps (:func:`jail_steps`, pure; a plan a forked jail
cannot follow is a ``SpawnFailed``), then forks the jail as the first process --
pid 1 -- of a fresh pid namespace (``setns`` back to its own,
``unshare(CLONE_NEWPID)``, ``fork`` -- or, sent the job's cgroup, ``clone3`` straight into
it: :class:`Forker`, :mod:`jaild.runtime.clone3`). The jail, still privileged inside the
zygote's user namespace:

1. sends the preamble byte on the channel: the daemon learns its host pid from
   SO_PASSCRED and moves it into the job's cgroup, then sends the go byte -- or, born
   in its job's cgroup, it sends :data:`PLACED` instead and goes on at once;
2. applies the steps: unshares the plan's namespaces (mount, ipc, uts, cgroup
   and, unless the policy says host, net -- or, under ``network.namespace =
   "tenant"``, joins the network namespace the zygote keeps for the job's tenant:
   :class:`SharedNets`), makes mount propagation private,
   detaches the zygote's /tmp, /dev/shm and /proc and mounts the plan's own,
   sets hostname, brings lo up if asked, enters the working directory, sets the
   plan's rlimits, and last drops the bounding set and becomes the plan's
   unprivileged uid (which clears every capability);
3. runs :func:`jaild.runtime.main.main` -- Harden, seccomp, JailReady.

One fork per jail: a waiter process between zygote and jail would cost a second
fork, its copy-on-write faults and its exit, for nothing the zygote cannot do.

So a zygote jail shares nothing writable with the zygote or with other jails:
memory is copy-on-write (the zygote holds no shared mappings), /tmp, /dev/shm
and /proc are new mounts, SysV/POSIX IPC, abstract sockets and pids live in new
namespaces (abstract sockets and loopback: shared with the tenant's other jails of the
policy where it says ``network.namespace = "tenant"``), the cgroup is the job's own, the
uid is the job's own. What it does
share with its siblings is what no fork renews: the zygote's address-space layout
(ASLR is per exec, not per fork), stack canary, pointer guard, ``AT_RANDOM`` and hash
seed -- which is why the daemon gives each client uid zygotes of its own
(:mod:`jaild.daemon.jails.launch.zygotes`). What a fork *can* renew, it does: before the
runtime starts, the jail reseeds the pre-imported modules' random generators from fresh
entropy (:mod:`jaild.runtime.reseed`; the zygote surveys them once, at its first fork).

The zygote reports each jail's end (``JailReaped``: wait status, CPU, peak RSS)
on the control socket. It never reads what a jail writes and never runs user code.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal.signal's C function (no stubs)
import _socket
import contextlib
import ctypes
import errno
import gc
import importlib
import os
import platform
import resource
import select
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgpack

from jaild.errors import RemoteProtocolError, SetupFailed
from jaild.protocol.framing import HEADER, HEADER_BYTES
from jaild.protocol.messages import Harden, Message, remember, safe_text, unpack
from jaild.protocol.zygote_link import (
    MAX_FAILED_IMPORTS,
    MAX_FAILURE_CHARS,
    MAX_PACKET_BYTES,
    MAX_SPAWN_ID,
    MAX_UID,
    JailSetup,
    Mount,
    PrepareJails,
    SpawnFailed,
    SpawnJail,
    ZygoteReady,
    decode_packet,
    encode,
)
from jaild.runtime import clone3, reseed
from jaild.runtime.harden import die_with_parent, empty_bounding_set

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
MS_MOVE = 0x2000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

NET_FD = 3
"""Where a jail that joins a shared network namespace holds it (:class:`SharedNets`) from its
fork until its ``join_net`` step, which closes it: the jail's other descriptors are 0-2."""
PREAMBLE = b"Z"  # jail -> daemon, carrying SO_PASSCRED credentials: move me, then GO
PLACED = b"C"  # jail -> daemon, the same, from a jail forked into its job's cgroup: no GO
GO = b"G"  # daemon -> jail: you are in the job's cgroup
EXIT_SETUP_FAILED = 70

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_fork = ctypes.PyDLL("libc.so.6", use_errno=True).fork
"""libc's ``fork``, called with the GIL held (``PyDLL``): see :func:`_fork_jail`."""
_RUNTIME_MODULES = (
    "asyncio",
    "jaild.runtime.main",
    "jaild.runtime.channel",
    "jaild.runtime.harden",
    "jaild.runtime.execute",
    "jaild.runtime.tools",
    "jaild.runtime.files",
    "jaild.runtime.network",
)
_SIG_DFL = int(signal.SIG_DFL)
_DEFAULT_SIGNALS = (int(signal.SIGCHLD), int(signal.SIGTERM))
"""The signals a jail resets to their default (:func:`_default_signals`), as plain ints."""
_SESSION_MODULES = ("jaild.runtime.snapshot", "cloudpickle")
"""Imported too where the jail environment has them: a session's snapshot and restore then
skip cloudpickle's ~25 ms import (an environment built before snapshots has none)."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupFailed(f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not a mount point: nothing to hide
            raise SetupFailed(f"umount {target}: {os.strerror(err)}")


def _loopback_up() -> None:
    import fcntl

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        s.close()


def _drop_to(uid: int) -> None:
    """Empty the bounding set while CAP_SETPCAP is still held, then become ``uid``:
    leaving uid 0 clears the effective, permitted and ambient sets."""
    empty_bounding_set()
    if os.getgroups():  # none: the zygote starts with none, and may not set them (see main)
        os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


# --------------------------------------------------------------------------- the plan, applied


class Step(NamedTuple):
    """One system-level step of setting up a jail: an operation and its arguments."""

    op: str
    args: tuple[Any, ...] = ()


_UNSHARE = {
    "mount": CLONE_NEWNS,
    "ipc": CLONE_NEWIPC,
    "uts": CLONE_NEWUTS,
    "cgroup": CLONE_NEWCGROUP,
    "net": CLONE_NEWNET,
}
_RLIMITS = (
    (resource.RLIMIT_CPU, "cpu_s"),
    (resource.RLIMIT_FSIZE, "file_size_bytes"),
    (resource.RLIMIT_NOFILE, "open_files"),
    (resource.RLIMIT_CORE, "core_bytes"),
    (resource.RLIMIT_SIGPENDING, "sigpending"),
    (resource.RLIMIT_MSGQUEUE, "msgqueue_bytes"),
    (resource.RLIMIT_MEMLOCK, "memlock_bytes"),
)


def _mount_flags(mount: Mount) -> int:
    flags = 0 if mount.writable else MS_RDONLY
    for name, flag in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC)):
        if getattr(mount, name):
            flags |= flag
    return flags


def jail_steps(jail: JailSetup) -> list[Step]:
    """What a forked jail does, in order, to become the jail ``jail`` describes -- the
    daemon's plan, applied (see :class:`jaild.protocol.zygote_link.JailSetup`). Pure.

    Raises:
        SetupFailed: the plan asks for something a forked jail cannot do.
    """
    if "user" in jail.namespaces or "pid" not in jail.namespaces or jail.rlimits is None:
        raise SetupFailed(
            "a forked jail is pid 1 of its own pid namespace, in the zygote's user namespace, "
            f"with its own rlimits; the plan asks for namespaces {list(jail.namespaces)}"
        )
    flags = 0
    for ns in jail.namespaces:
        flags |= _UNSHARE.get(ns, 0)  # pid: the fork made it
    steps = [Step("unshare", (flags,))]
    if jail.shared_net:
        if "net" in jail.namespaces:
            raise SetupFailed("a jail that joins a shared network namespace makes none of its own")
        # the zygote makes it (lo up, if asked) and hands it to the fork: see SharedNets
        steps.append(Step("join_net", (jail.shared_net, jail.loopback)))
    steps.append(Step("private", ("/",)))
    remade_proc = {m.target for m in jail.mounts if m.kind == "proc"}
    steps += [Step("umount", (t,)) for t in jail.detach if t not in remade_proc]
    for mount in jail.mounts:
        if mount.kind == "tmpfs":
            steps.append(
                Step("mount", ("tmpfs", mount.target, "tmpfs", _mount_flags(mount), mount.options))
            )
        elif mount.kind == "proc":
            # The kernel allows this mount only while a fully visible proc is mounted (the
            # zygote's): mount ours aside, detach the zygote's, move ours in place.
            aside = f"{jail.cwd}/.proc"
            steps += [
                Step("mkdir", (aside,)),
                Step("mount", ("proc", aside, "proc", _mount_flags(mount), mount.options)),
                *([Step("umount", (mount.target,))] if mount.target in jail.detach else []),
                Step("move", (aside, mount.target)),
                Step("rmdir", (aside,)),
            ]
        else:
            raise SetupFailed(f"a zygote cannot make a {mount.kind} mount at {mount.target}")
    steps.append(Step("hostname", (jail.hostname,)))
    if jail.loopback and not jail.shared_net:
        steps.append(Step("loopback_up"))
    steps.append(Step("chdir", (jail.cwd,)))
    for res, name in _RLIMITS:
        value = getattr(jail.rlimits, name)
        steps.append(Step("rlimit", (res, value, value)))
    steps.append(Step("become", (jail.uid,)))
    return steps


def _move(source: str, target: str) -> None:
    _check(_libc.mount(source.encode(), target.encode(), None, MS_MOVE, None), f"move {target}")


def _setrlimit(res: int, soft: int, hard: int) -> None:
    resource.setrlimit(res, (soft, hard))


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _join_net(key: str, loopback: bool) -> None:
    """Enter the shared network namespace the zygote handed this jail at :data:`NET_FD`
    (made for ``key``, ``lo`` up if ``loopback``: see :class:`SharedNets`), and close it."""
    try:
        _check(_libc.setns(NET_FD, CLONE_NEWNET), f"setns to the shared network of {key}")
    finally:
        os.close(NET_FD)


def _private(target: str) -> None:
    _mount("none", target, None, MS_REC | MS_PRIVATE, None)


def _mkdir(path: str) -> None:
    os.mkdir(path, 0o700)


APPLY: dict[str, Callable[..., None]] = {
    "unshare": _unshare,
    "join_net": _join_net,
    "private": _private,
    "umount": _umount,
    "mount": _mount,
    "mkdir": _mkdir,
    "move": _move,
    "rmdir": os.rmdir,
    "hostname": socket.sethostname,
    "loopback_up": _loopback_up,
    "chdir": os.chdir,
    "rlimit": _setrlimit,
    "become": _drop_to,
}
"""Each step's system call(s)."""


def _apply(steps: Sequence[Step]) -> None:
    """In the jail process (pid 1 of its pid namespace), still privileged in the userns."""
    for step in steps:
        APPLY[step.op](*step.args)


def _await_cgroup(placed: bool) -> None:
    """Send the preamble on fd 0, the channel (a stream socket), and wait for the daemon's go:
    plain write(2) and read(2), no socket object made and closed in the jail (the kernel
    attaches our credentials to a write as to a send). A jail forked into its job's cgroup
    (``placed``) says so, and goes on at once.

    Raises:
        SetupFailed: the daemon answered anything but the go, or closed the channel.
    """
    if placed:
        if os.write(0, PLACED) != len(PLACED):
            raise SetupFailed("the daemon's channel took no preamble")
        return
    if os.write(0, PREAMBLE) != len(PREAMBLE) or os.read(0, 1) != GO:
        raise SetupFailed("the daemon did not place the jail in its cgroup")


def _default_signals() -> None:
    """Undo the zygote's signal handling in a jail: no wake-up fd, SIGCHLD and SIGTERM back to
    their defaults. ``_signal``'s C functions, not ``signal.signal``, whose conversions to and
    from its enums are Python (~60 pages a jail copied, each object they touch being written)."""
    signal.set_wakeup_fd(-1)
    for sig in _DEFAULT_SIGNALS:
        _signal.signal(sig, _SIG_DFL)


def _leave_zygote(control: socket.socket) -> None:
    """A jail's first steps, just forked: what it holds of the zygote's let go, written to
    copy as few of the zygote's pages as it can -- every object a jail touches is written
    (its reference count), so copied, a page at a time."""
    # The zygote's objects made since its own gc.freeze() (its plans, this spawn's), made
    # permanent here, in the jail (O(1): the lists are spliced): the jail's collector then
    # never walks -- so never writes, so never copies -- any object of the zygote's.
    gc.freeze()
    # Die with the zygote. Its pid is outside our pid namespace (getppid() is 0), so the
    # arming race cannot be checked here: a zygote that dies takes its cgroup, where we
    # still are until the daemon moves us, down with it.
    die_with_parent(signal.SIGKILL)
    _socket.socket.close(control)  # the C method: socket.socket.close is Python around it
    _default_signals()


def _jail(
    steps: Sequence[Step], warm_up: bool, generators: Sequence[object], placed: bool
) -> None:
    """The forked child, pid 1 of a new pid namespace: preamble, the plan, fresh random
    state for the pre-imported modules' generators, the runtime."""
    _await_cgroup(placed)
    _apply(steps)
    reseed.reseed(generators)  # before any user code (jaild.runtime.reseed)
    from jaild.runtime.main import main

    main(warm_up=warm_up)


def _child_main(
    steps: Sequence[Step],
    warm_up: bool,
    fds: Sequence[int],
    control: socket.socket,
    generators: Sequence[object],
    net_fd: int | None = None,
    placed: bool = False,
) -> None:
    try:
        _leave_zygote(control)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        if net_fd is not None:  # the shared network namespace, until the join_net step
            os.dup2(net_fd, NET_FD)
        os.closerange(3 if net_fd is None else NET_FD + 1, 65536)
        _jail(steps, warm_up, generators, placed)
    except BaseException as exc:
        try:
            detail = exc if isinstance(exc, SetupFailed) else traceback.format_exc()
            os.write(2, f"jaild zygote: cannot set up the jail: {detail}\n".encode())
        finally:
            os._exit(EXIT_SETUP_FAILED)
    os._exit(0)


class SharedNets:
    """The network namespaces this zygote keeps for jails that share one: a tenant's, under
    ``network.namespace = "tenant"`` (the daemon puts the tenant's key in each of its jails'
    plans, ``JailSetup.shared_net``; a jail with no key makes its own, as ever).

    The first jail of a key costs what its own namespace would: the zygote ``unshare``s a
    network namespace, brings ``lo`` up in it if the plan asks, keeps a descriptor to it and
    ``setns``es back to its own. Each jail of that key then only enters it (``setns`` in the
    fork, :func:`_join_net`); creating a network namespace is most of what the kernel's set of
    namespaces costs a jail (docs/performance.md). A key's namespace lives as long as the
    zygote (a ``uid``-scope zygote has one tenant, so one key), and its lo state is the
    key's: ``(key, loopback)`` is what is kept.

    At most :attr:`MAX` are kept. A new key past that takes the place of the least recently
    used one with no running jail; if every one has some, the new jail gets a namespace made
    for it alone (this zygote keeps no descriptor to it), as if it did not share.
    """

    MAX = 64

    def __init__(self, own: int) -> None:
        self._own = own  # this zygote's own network namespace
        self._fds: dict[tuple[str, bool], int] = {}  # least recently used first
        self._running: dict[tuple[str, bool], int] = {}
        self._jails: dict[int, tuple[str, bool]] = {}

    def take(self, key: str, loopback: bool) -> tuple[int, bool]:
        """A descriptor of ``key``'s namespace, and whether it is kept (else the caller
        closes it once the jail is forked).

        Raises:
            OSError: a namespace could not be made (or lo not brought up).
        """
        kept = (key, loopback)
        fd = self._fds.pop(kept, None)
        if fd is not None:
            self._fds[kept] = fd  # now the most recently used
            return fd, True
        fd = self._make(loopback)
        if len(self._fds) >= self.MAX:
            self._evict()
        if len(self._fds) >= self.MAX:
            return fd, False
        self._fds[kept] = fd
        return fd, True

    def started(self, pid: int, key: str, loopback: bool) -> None:
        """Jail ``pid`` runs in the kept namespace of ``(key, loopback)``."""
        self._jails[pid] = (key, loopback)
        self._running[(key, loopback)] = self._running.get((key, loopback), 0) + 1

    def ended(self, pid: int) -> None:
        """Jail ``pid`` was reaped."""
        kept = self._jails.pop(pid, None)
        if kept is not None:
            self._running[kept] -= 1
            if not self._running[kept]:
                del self._running[kept]

    def _evict(self) -> None:
        for kept in self._fds:
            if kept not in self._running:
                os.close(self._fds.pop(kept))
                return

    def _make(self, loopback: bool) -> int:
        _check(_libc.unshare(CLONE_NEWNET), "unshare a shared network namespace")
        try:
            if loopback:
                _loopback_up()
            return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            if _libc.setns(self._own, CLONE_NEWNET) != 0:
                # In a tenant's namespace: fork nothing more from here. The daemon sees the
                # zygote exit, fails its jails, and starts it afresh.
                raise RuntimeError(f"setns back: {os.strerror(ctypes.get_errno())}")


def _shared_net(steps: Sequence[Step]) -> tuple[str, bool] | None:
    """The shared network namespace ``steps`` join (its key, lo up?), or None."""
    for step in steps:
        if step.op == "join_net":
            key, loopback = step.args
            return key, loopback
        if step.op == "private":  # join_net comes before it, or not at all
            return None
    return None


def _send(control: socket.socket, msg: Message) -> None:
    control.send(encode(msg))


_SURVEYED: list[list[object]] = []


def _generators() -> list[object]:
    """The pre-imported modules' generators (:func:`jaild.runtime.reseed.survey`), found
    once, at the first fork (the zygote imports nothing after its start-up)."""
    if not _SURVEYED:
        _SURVEYED.append(reseed.survey())
    return _SURVEYED[0]


def _fork_jail() -> int:
    """fork(2) itself, not ``os.fork()``: without the interpreter's at-fork hooks, which in a
    child that runs no thread but its own redo work the zygote's state does not need --
    ``threading``'s alone writes ~130 pages (each a copy-on-write fault) and costs ~0.8 ms
    of the jail's CPU. The zygote has one thread, so no lock can be held by another at the
    fork, and the jail's random generators are reseeded by :mod:`jaild.runtime.reseed`,
    whatever ``random``'s hook would have done. The GIL stays held across the call.

    Raises:
        OSError: the fork failed.
    """
    pid: int = _fork()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return pid


class Forker:
    """How the zygote forks a jail: straight into its job's cgroup when the daemon sends
    that cgroup (a fourth descriptor, cgroup v2) and ``clone3`` can be had here
    (:mod:`jaild.runtime.clone3`); else with fork(2), into the zygote's cgroup, for the
    daemon to move. The jail's preamble tells the daemon which (:data:`PLACED`). Why
    ``clone3`` was not used goes to the zygote's log once."""

    def __init__(self, cloner: clone3.CloneInto | str) -> None:
        self._cloner = cloner
        self._said = False

    def fork(self, cgroup_fd: int | None) -> tuple[int, bool]:
        """The child's pid (0 in the child), and whether it was born in ``cgroup_fd``.

        Raises:
            OSError: neither could fork.
        """
        cloner = self._cloner
        if cgroup_fd is not None and not isinstance(cloner, str):
            try:
                return cloner.fork(cgroup_fd), True
            except OSError as exc:
                self._say(f"clone3 into the job's cgroup failed: {exc}")
        elif cgroup_fd is not None:
            self._say(str(cloner))
        return _fork_jail(), False

    def _say(self, why: str) -> None:
        if not self._said:
            self._said = True
            with contextlib.suppress(OSError):
                os.write(2, f"jaild zygote: {why}; forking, and the daemon moves each jail\n"
                         .encode())


class Spawn(NamedTuple):
    """A ``SpawnJail``, read: whom to answer, and what the jail does."""

    spawn_id: int
    steps: list[Step] | SetupFailed
    """The jail's steps (:func:`jail_steps`), or why its plan cannot be followed."""
    warm_up: bool


class Plans:
    """``SpawnJail`` packets, read. The jails of one policy differ in their id and their uid
    only (and in their rlimits, for a job with limits of its own): a plan seen before --
    the same bytes but for its ``uid`` -- is not decoded, checked and turned into steps
    again; its steps are taken as they were, the uid checked and put in the last one. In a
    zygote that forks all the time, every object a decode makes is written to a page it
    shares with its jails, and copied: a decode cost 0.64 ms and ~120 copied pages a jail,
    about a third of the zygote's CPU."""

    MAX = 64
    """Plans kept (a policy's jails have one or a few; a plan past this is read each time)."""

    def __init__(self) -> None:
        self._known: dict[bytes, tuple[list[Step], bool]] = {}

    def read(self, packet: bytes) -> Spawn | Message:
        """``packet``'s ``SpawnJail`` as a :class:`Spawn`, or the other message it holds.

        Raises:
            RemoteProtocolError: the packet is not a message of the link.
        """
        key = None
        data = _unpack_packet(packet)
        if type(data) is dict and data.get("type") == "SpawnJail" and len(data) == 3:
            jail = data.get("jail")
            spawn_id = data.get("spawn_id")
            if type(jail) is dict and "uid" in jail:
                uid = jail.pop("uid")
                key = msgpack.packb(jail, use_bin_type=True)
                known = self._known.get(key)
                if (known is not None and type(spawn_id) is int and type(uid) is int
                        and 0 <= spawn_id <= MAX_SPAWN_ID and 0 <= uid <= MAX_UID):
                    steps, warm_up = known
                    return Spawn(spawn_id, [*steps[:-1], Step("become", (uid,))], warm_up)
        req = decode_packet(packet, "daemon->zygote")
        if not isinstance(req, SpawnJail):
            return req
        try:
            steps = jail_steps(req.jail)
        except SetupFailed as exc:
            return Spawn(req.spawn_id, exc, req.jail.warm_up)
        if key is not None and len(self._known) < self.MAX and steps[-1].op == "become":
            self._known[key] = (steps, req.jail.warm_up)
        return Spawn(req.spawn_id, steps, req.jail.warm_up)


def _unpack_packet(packet: bytes) -> Any:
    """The msgpack value of a packet that is one whole frame, or None (then the full
    decode says what is wrong with it)."""
    if len(packet) < HEADER_BYTES or HEADER.unpack_from(packet)[0] != len(packet) - HEADER_BYTES:
        return None
    try:
        return unpack(packet[HEADER_BYTES:])
    except RemoteProtocolError:
        return None


def _spawn(
    control: socket.socket, spawn: Spawn, fds: list[int], own_pidns: int, nets: SharedNets,
    forker: Forker,
) -> dict[int, int]:
    """Fork the jail as the first process of a fresh pid namespace: back into our own
    namespace for children (``setns``), a new one (``unshare``), then fork -- into the job's
    cgroup if ``fds`` has it (``forker``). A jail that shares a network namespace is handed
    it (``nets``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    shared, net_fd, kept = None, None, False
    try:
        if len(fds) not in (3, 4):
            raise SetupFailed(
                f"a jail needs its channel, stdout, stderr (and cgroup); got {len(fds)} fds")
        if isinstance(spawn.steps, SetupFailed):
            raise spawn.steps
        steps = spawn.steps
        generators = _generators()  # in the zygote, before the fork: once, then cached
        shared = _shared_net(steps)
        if shared is not None:
            net_fd, kept = nets.take(*shared)
        _check(_libc.setns(own_pidns, CLONE_NEWPID), "setns")
        _check(_libc.unshare(CLONE_NEWPID), "unshare")
        pid, placed = forker.fork(fds[3] if len(fds) == 4 else None)
    except (OSError, SetupFailed) as exc:
        if net_fd is not None and not kept:
            os.close(net_fd)
        _send(control, SpawnFailed(spawn.spawn_id, safe_text(f"fork: {exc}", MAX_FAILURE_CHARS)))
        return {}
    if pid == 0:
        _child_main(steps, spawn.warm_up, fds[:3], control, generators, net_fd, placed)
    if net_fd is not None and shared is not None:
        if kept:
            nets.started(pid, *shared)
        else:
            os.close(net_fd)
    return {pid: spawn.spawn_id}


_pack = msgpack.Packer(use_bin_type=True).pack


def _reaped(spawn_id: int, status: int, cpu_s: float, maxrss_kb: int) -> bytes:
    """The ``JailReaped`` packet, packed as it is: byte for byte ``encode(JailReaped(...))``
    (a test holds them equal), without making and checking the message first. The zygote
    sends one per jail, and every page its loop writes after a fork is copied while that
    jail lives: the message's construction and checks were ~35 pages a jail. The values
    are the kernel's (``wait4``); the daemon checks every field it receives."""
    payload: bytes = _pack({"spawn_id": spawn_id, "status": status, "cpu_s": cpu_s,
                            "maxrss_kb": maxrss_kb, "type": "JailReaped"})
    return HEADER.pack(len(payload)) + payload


def _reap(control: socket.socket, children: dict[int, int], nets: SharedNets) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        spawn_id = children.pop(pid, None)
        if spawn_id is None:
            continue
        nets.ended(pid)
        control.send(
            _reaped(spawn_id, status, usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
        )


def _prepare(req: PrepareJails) -> None:
    """Decode the ``Harden`` frame every jail will be sent, once, and build its seccomp
    filters: each jail then recognises the frame by its bytes and loads the filters as they
    are (:func:`jaild.protocol.messages.remember`, :func:`jaild.runtime.seccomp.prepare`).
    With ``split_seccomp``, the zygote loads the policy's filters itself, with what it and
    its jails need let through, and each jail only takes that back
    (:mod:`jaild.runtime.zygote_filter`): from here on the zygote runs under them.
    A frame that is not a ``Harden`` is the daemon's bug: raise, and exit."""
    from jaild.runtime import seccomp

    harden = remember(req.harden, "daemon->jail")
    if not isinstance(harden, Harden):
        raise SetupFailed(f"PrepareJails carries a {harden.TYPE}, not a Harden")
    seccomp.prepare(harden.seccomp, split=req.split_seccomp)


def _preimport(names: Sequence[str]) -> dict[str, str]:
    """Import the runtime and ``names``; what failed, as the ``ZygoteReady`` message says it."""
    failed: dict[str, str] = {}
    for name in (*_RUNTIME_MODULES, *names):
        try:
            importlib.import_module(name)
        except Exception as exc:
            if len(failed) < MAX_FAILED_IMPORTS:
                failed[name[:256]] = safe_text(f"{type(exc).__name__}: {exc}", MAX_FAILURE_CHARS)
    for name in _SESSION_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return failed


def _receive(control: socket.socket) -> tuple[bytes, list[int]]:
    data, ancdata, _, _ = control.recvmsg(MAX_PACKET_BYTES, socket.CMSG_SPACE(4 * 4))
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(memoryview(payload).cast("i"))
    return data, fds


USERNS_LIMITS: dict[str, int] = {
    "max_inotify_instances": 8,
    "max_inotify_watches": 1024,
    "max_fanotify_groups": 0,
    "max_fanotify_marks": 0,
    "max_user_namespaces": 0,
}
"""Per-uid limits inside the zygote's user namespace (``/proc/sys/user``), so per jail: each
forked jail runs as a uid of its own in it. Above them, everything the zygote's jails make
is charged together to the zygote's own host uid, the namespace's owner, and bounded by the
host's per-user limits (128 inotify instances by default): these keep one jail from taking
all of that. Namespaces other than user namespaces are left alone: the zygote (uid 0 here)
makes several for each jail; jails themselves cannot (seccomp)."""


def limit_user_namespace(limits: dict[str, int], aside: str = "/tmp/.sysctl") -> None:
    """Write ``limits`` to this user namespace's ``/proc/sys/user`` and read them back. The
    zygote's /proc is read-only, so a proc of its own is mounted aside for the writes.

    Raises:
        SetupFailed: a limit could not be set (no CAP_SYS_RESOURCE in the namespace).
    """
    os.mkdir(aside, 0o700)
    try:
        _mount("proc", aside, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        try:
            for name, value in limits.items():
                path = f"{aside}/sys/user/{name}"
                with open(path, "w") as f:
                    f.write(str(value))
                with open(path) as f:
                    if int(f.read()) != value:
                        raise SetupFailed(f"{path} did not take {value}")
        except OSError as exc:
            raise SetupFailed(f"/proc/sys/user: {exc}") from None
        finally:
            _umount(aside)
    finally:
        os.rmdir(aside)


def _limit_jails() -> dict[str, str]:
    """What the jails inherit from the zygote's start-up, checked and set; what failed, as
    the ``ZygoteReady`` message says it (the zygote then exits and its policy is not served)."""
    try:
        # The daemon starts us without supplementary groups, in a user namespace where
        # setgroups(2) is denied (nsjail, run by a non-root owner, writes "deny"): there must
        # be none for the jails to inherit.
        if os.getgroups():
            raise SetupFailed(f"the zygote has supplementary groups {os.getgroups()}")
        with open("/proc/self/uid_map") as uid_map:
            if uid_map.read().split() == ["0", "0", "4294967295"]:
                raise SetupFailed("the zygote is not in a user namespace of its own")
        limit_user_namespace(USERNS_LIMITS)
    except (OSError, SetupFailed) as exc:
        return {"per-jail kernel limits": safe_text(str(exc), MAX_FAILURE_CHARS)}
    return {}


def main(preimport: Sequence[str]) -> None:
    """The zygote's loop: fd 0 is the control socket (SOCK_SEQPACKET) to the daemon."""
    control = socket.socket(fileno=os.dup(0))
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    failed = _limit_jails() or _preimport(preimport)
    forker = Forker(clone3.prepare())
    # Every object so far is shared with the jails copy-on-write: keep the collector from
    # walking (and so writing to, and so copying) them in each jail. And give the heap's
    # free pages back first (~1 MiB after the imports): fewer pages for each fork to map.
    _libc.malloc_trim(0)
    gc.freeze()
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    nets = SharedNets(os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(control, ZygoteReady(pid=os.getpid(), python=platform.python_version(), failed=failed))
    if failed:
        os._exit(EXIT_SETUP_FAILED)
    children: dict[int, int] = {}
    plans = Plans()
    while True:
        try:
            readable, _, _ = select.select([control.fileno(), wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            _reap(control, children, nets)
        if control.fileno() in readable:
            try:
                data, fds = _receive(control)
            except InterruptedError:
                continue
            if not data:
                os._exit(0)  # the daemon is gone; our children die with us (pdeathsig)
            try:
                # a message we cannot read is the daemon's bug: raise, and exit
                req = plans.read(data)
                if isinstance(req, Spawn):
                    children.update(_spawn(control, req, fds, own_pidns, nets, forker))
                elif isinstance(req, PrepareJails):
                    _prepare(req)
            finally:
                for fd in fds:
                    os.close(fd)
            _reap(control, children, nets)
