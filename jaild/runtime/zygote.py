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

For each request (the job's channel, stdout, stderr and a status pipe arrive with
it as SCM_RIGHTS) it forks::

    zygote (caps in its userns, no user code ever)
      └─ waiter   sends the preamble byte on the channel (the daemon learns its host
         │        pid from SO_PASSCRED and moves it into the job's cgroup), waits for
         │        the go byte, unshares fresh mount/pid/ipc/net/uts/cgroup namespaces,
         │        forks, drops to the job's uid; when the jail ends it writes the wait
         │        status to the status pipe at once, then mirrors it as its own
         └─ jail  pid 1 of the new pid namespace: private mount propagation, a new
                  /tmp, /dev/shm and /proc, hostname, rlimits; drops the bounding set,
                  then to the job's unprivileged uid (which clears every capability);
                  then :func:`jaild.runtime.main.main` -- Harden, seccomp, JailReady.

So a zygote jail shares nothing writable with the zygote or with other jails:
memory is copy-on-write (the zygote holds no shared mappings), /tmp, /dev/shm
and /proc are new mounts, SysV/POSIX IPC, abstract sockets and pids live in new
namespaces, the cgroup is the job's own, the uid is the job's own. What it does
share with its siblings is the zygote's address-space layout (ASLR is per exec,
not per fork) and hash seed; the README's security model says so.

The zygote reports each waiter's end (wait status, CPU, peak RSS) on the control
socket. It never reads what a jail writes and never runs user code.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
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
import prctl

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

STATUS_FD = 3  # the waiter's: the jail's wait status and CPU time go to the daemon on it
STATUS = struct.Struct("=id")
PREAMBLE = b"Z"  # waiter -> daemon, carrying SO_PASSCRED credentials
GO = b"G"  # daemon -> waiter: you are in the job's cgroup
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
)


class SetupFailed(RuntimeError):
    pass


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
    for name in prctl.ALL_CAP_NAMES:
        if getattr(prctl.capbset, name):
            prctl.capbset.drop(name)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _arm_pdeathsig(parent: int) -> None:
    prctl.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        raise SetupFailed("the zygote died")


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


def _waiter(req: dict[str, Any], zygote_pid: int) -> None:
    """The forked child: preamble, namespaces, the jail, then mirror its end."""
    _arm_pdeathsig(zygote_pid)
    chan = socket.socket(fileno=os.dup(0))
    chan.sendall(PREAMBLE)
    if chan.recv(1) != GO:
        os._exit(EXIT_SETUP_FAILED)
    chan.close()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if req["netns"]:
        flags |= CLONE_NEWNET
    _check(_libc.unshare(flags), "unshare")
    pid = os.fork()
    if pid == 0:
        # Die with the waiter. Its pid is outside our new pid namespace (getppid() is 0),
        # so the arming race cannot be checked here; the daemon kills the job's cgroup
        # whenever the waiter ends, which covers it.
        prctl.set_pdeathsig(signal.SIGKILL)
        os.close(STATUS_FD)  # the waiter's alone
        _setup_jail(req)
        from jaild.runtime.main import main

        main()
        os._exit(0)
    for fd in (0, 1, 2):
        os.close(fd)  # only the jail holds the job's channel and pipes now
    _drop_to(req["uid"])
    prctl.set_no_new_privs(1)
    while True:
        try:
            _, status, usage = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
    # Report the jail's end at once: our own exit tears down the namespaces we unshared,
    # which takes milliseconds; the zygote's report of it comes after that.
    with contextlib.suppress(OSError):
        os.write(STATUS_FD, STATUS.pack(status, usage.ru_utime + usage.ru_stime))
        os.close(STATUS_FD)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL/SIGSTOP: always default
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _child_main(req: dict[str, Any], fds: Sequence[int], control: socket.socket) -> None:
    zygote_pid = os.getppid()
    try:
        control.close()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2, STATUS_FD), fds, strict=True):
            os.dup2(fd, target)
        os.closerange(STATUS_FD + 1, 65536)
        _waiter(req, zygote_pid)
    except BaseException as exc:
        try:
            detail = exc if isinstance(exc, SetupFailed) else traceback.format_exc()
            os.write(2, f"jaild zygote: cannot set up the jail: {detail}\n".encode())
        finally:
            os._exit(EXIT_SETUP_FAILED)
    os._exit(0)


def _send(control: socket.socket, msg: dict[str, Any]) -> None:
    control.send(msgpack.packb(msg))


def _spawn(control: socket.socket, req: dict[str, Any], fds: list[int]) -> dict[int, int]:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
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
                if req.get("t") == "spawn" and len(fds) == 4:
                    children.update(_spawn(control, req, fds))
            finally:
                for fd in fds:
                    os.close(fd)
            _reap(control, children)
