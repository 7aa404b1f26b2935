"""The zygote: a per-policy template process that forks one fresh jail per job.

Theory of operation
-------------------
Starting a jail from nothing (nsjail, a new interpreter, the runtime's imports)
costs ~30 ms of CPU. The zygote pays it once: the daemon starts it in an nsjail
jail of its own -- the policy's read-only mounts, its own user, pid, mount, net,
ipc, uts and cgroup namespaces -- but with its capabilities *kept* inside that
user namespace, and a uid map holding the daemon's whole range of job uids
(inside uid N = host uid N; inside 0 = the zygote's own host uid). It imports the
runtime and the policy's ``preimport`` modules, then waits on its control socket
(fd 0, SOCK_SEQPACKET) for ``spawn`` requests.

For each request (the job's channel, stdout and stderr arrive with it as
SCM_RIGHTS) it forks the jail as the first process -- pid 1 -- of a fresh pid
namespace (``setns`` back to its own, ``unshare(CLONE_NEWPID)``, ``fork``). The
jail, still privileged inside the zygote's user namespace:

1. sends the preamble byte on the channel: the daemon learns its host pid from
   SO_PASSCRED and moves it into the job's cgroup, then sends the go byte;
2. unshares fresh mount, ipc, uts, cgroup and (unless the policy says host) net
   namespaces;
3. makes mount propagation private, mounts a new /tmp, /dev/shm and /proc (the
   zygote's are detached), sets hostname and rlimits;
4. drops the bounding set, then becomes the job's unprivileged uid (which clears
   every capability);
5. runs :func:`jaild.runtime.main.main` -- Harden, seccomp, JailReady.

One fork per jail: a waiter process between zygote and jail would cost a second
fork, its copy-on-write faults and its exit, for nothing the zygote cannot do.

So a zygote jail shares nothing writable with the zygote or with other jails:
memory is copy-on-write (the zygote holds no shared mappings), /tmp, /dev/shm
and /proc are new mounts, SysV/POSIX IPC, abstract sockets and pids live in new
namespaces, the cgroup is the job's own, the uid is the job's own. What it does
share with its siblings is the zygote's address-space layout (ASLR is per exec,
not per fork) and hash seed; the README's security model says so.

The zygote reports each jail's end (wait status, CPU, peak RSS) on the control
socket. It never reads what a jail writes and never runs user code.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from typing import Any

import msgpack

from jaild.errors import SetupFailed
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

PREAMBLE = b"Z"  # jail -> daemon, carrying SO_PASSCRED credentials
GO = b"G"  # daemon -> jail: you are in the job's cgroup
MAX_CONTROL = 64 * 1024
EXIT_SETUP_FAILED = 70

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_RUNTIME_MODULES = (
    "asyncio",
    "jaild.runtime.main",
    "jaild.runtime.channel",
    "jaild.runtime.harden",
    "jaild.runtime.execute",
    "jaild.runtime.tools",
    "jaild.runtime.files",
)


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
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _setup_jail(req: dict[str, Any]) -> None:
    """In the jail process (pid 1 of its pid namespace), still privileged in the userns."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    for target in ("/dev/shm", "/tmp"):
        _umount(target)
    hardened = MS_NOSUID | MS_NODEV | MS_NOEXEC
    _mount("tmpfs", "/tmp", "tmpfs", hardened, req["tmp"])
    if req["shm"]:
        _mount("tmpfs", "/dev/shm", "tmpfs", hardened, req["shm"])
    if req["proc"] != "none":
        # The kernel allows this mount only while a fully visible proc is mounted (the
        # zygote's, at /proc): mount ours aside, detach the zygote's, move ours in place.
        aside = "/tmp/.proc"
        os.mkdir(aside, 0o700)
        _mount(
            "proc",
            aside,
            "proc",
            hardened | MS_RDONLY,
            "subset=pid" if req["proc"] == "pid-only" else "",
        )
        _umount("/proc")
        _check(_libc.mount(aside.encode(), b"/proc", None, MS_MOVE, None), "move /proc")
        os.rmdir(aside)
    else:
        _umount("/proc")
    socket.sethostname(req["hostname"])
    if req["loopback"]:
        _loopback_up()
    os.chdir("/tmp")
    for res, soft, hard in req["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    _drop_to(req["uid"])


def _jail(req: dict[str, Any]) -> None:
    """The forked child, pid 1 of a new pid namespace: preamble, namespaces, the runtime."""
    chan = socket.socket(fileno=os.dup(0))
    chan.sendall(PREAMBLE)
    if chan.recv(1) != GO:
        raise SetupFailed("the daemon did not place the jail in its cgroup")
    chan.close()
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if req["netns"]:
        flags |= CLONE_NEWNET
    _check(_libc.unshare(flags), "unshare")
    _setup_jail(req)
    from jaild.runtime.main import main

    main(warm_up=bool(req.get("warm_up")))


def _child_main(req: dict[str, Any], fds: Sequence[int], control: socket.socket) -> None:
    try:
        # Die with the zygote. Its pid is outside our pid namespace (getppid() is 0), so
        # the arming race cannot be checked here: a zygote that dies takes its cgroup,
        # where we still are until the daemon moves us, down with it.
        die_with_parent(signal.SIGKILL)
        control.close()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        _jail(req)
    except BaseException as exc:
        try:
            detail = exc if isinstance(exc, SetupFailed) else traceback.format_exc()
            os.write(2, f"jaild zygote: cannot set up the jail: {detail}\n".encode())
        finally:
            os._exit(EXIT_SETUP_FAILED)
    os._exit(0)


def _send(control: socket.socket, msg: dict[str, Any]) -> None:
    control.send(msgpack.packb(msg))


def _spawn(
    control: socket.socket, req: dict[str, Any], fds: list[int], own_pidns: int
) -> dict[int, int]:
    """Fork the jail as the first process of a fresh pid namespace: back into our own
    namespace for children (``setns``), a new one (``unshare``), then fork."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        _check(_libc.setns(own_pidns, CLONE_NEWPID), "setns")
        _check(_libc.unshare(CLONE_NEWPID), "unshare")
        pid = os.fork()
    except (OSError, SetupFailed) as exc:
        _send(control, {"t": "error", "id": req["id"], "message": f"fork: {exc}"})
        return {}
    if pid == 0:
        _child_main(req, fds, control)
    return {pid: req["id"]}


def _reap(control: socket.socket, children: dict[int, int]) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        job = children.pop(pid, None)
        if job is None:
            continue
        _send(
            control,
            {
                "t": "exit",
                "id": job,
                "status": status,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "maxrss_kb": usage.ru_maxrss,
            },
        )


def main(preimport: Sequence[str]) -> None:
    """The zygote's loop: fd 0 is the control socket (SOCK_SEQPACKET) to the daemon."""
    control = socket.socket(fileno=os.dup(0))
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    failed = {}
    for name in (*_RUNTIME_MODULES, *preimport):
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    # Every object so far is shared with the jails copy-on-write: keep the collector from
    # walking (and so writing to, and so copying) them in each jail.
    gc.freeze()
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(
        control,
        {"t": "ready", "pid": os.getpid(), "python": platform.python_version(), "failed": failed},
    )
    if failed:
        os._exit(EXIT_SETUP_FAILED)
    children: dict[int, int] = {}
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
            _reap(control, children)
        if control.fileno() in readable:
            try:
                data, ancdata, _, _ = control.recvmsg(MAX_CONTROL, socket.CMSG_SPACE(3 * 4))
            except InterruptedError:
                continue
            if not data:
                os._exit(0)  # the daemon is gone; our children die with us (pdeathsig)
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += list(memoryview(payload).cast("i"))
            try:
                req = msgpack.unpackb(data)
                if req.get("t") == "spawn" and len(fds) == 3:
                    children.update(_spawn(control, req, fds, own_pidns))
                elif req.get("t") == "seccomp":
                    from jaild.runtime import seccomp

                    seccomp.prepare(req["spec"])
            finally:
                for fd in fds:
                    os.close(fd)
            _reap(control, children)
