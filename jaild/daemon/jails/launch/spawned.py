"""Spawn launch: nsjail per job.

Theory of operation
-------------------
:class:`SpawnLauncher` runs nsjail with the policy's config (a sealed memfd), the job's
argv and a pipe it logs to. The jail's channel is nsjail's stdin; its stdout and stderr
are pipes. A pidfd says when nsjail exits (``wait4`` then gives its rusage, which
includes the jailed process nsjail reaped). The jail is over when nsjail has exited and
its stdout, stderr, log and channel reached EOF -- so no output and no ``CodeFinished``
is left unread.

Who owns the jail's user namespace
----------------------------------
The kernel charges per-user counts (ucounts: inotify instances and watches, queued
signals, POSIX message queue bytes, locked SysV shared memory, processes, namespaces)
up the chain of user namespaces, to the *owner* of each: the euid of the process that
created it. nsjail creates the jail's user namespace, so if nsjail ran as root, every
jail's counts would land on host root's, and a jail could exhaust them (128 inotify
instances, and root's own ``inotify_init1`` fails with EMFILE). So :func:`as_owner`
starts nsjail as the host uid that is to own the namespace -- the job's own uid here, the
zygote's own uid for a zygote -- with the daemon's capabilities kept as ambient ones
(setpriv ``--reuid``, ``--ambient-caps``): nsjail can still map uids, make cgroups and
mount, but what its jail consumes is charged to that uid, which nothing else uses.
setpriv sets the parent-death signal after it changes credentials (a credential change
clears it), so nsjail still dies with the daemon.

nsjail's child, running as that uid without host capabilities, makes its mount work
directories as ``/tmp/nsjail.<uid>.root`` and ``.tmp`` (it cannot write /run/user), and
leaves them. Those names are predictable, in a directory every local user may write: so
the daemon makes them itself first (:func:`claim_workdirs`: empty, the uid's own, whatever
was planted there removed) and removes them when nsjail has exited
(:func:`release_workdirs`), so that one uid's are not left behind per job uid.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Callable, Sequence

from jaild.daemon.core.machine import Exited, JobSpec, Spawned
from jaild.daemon.jails.launch.handle import JailHandle
from jaild.policy.compile import JobPlacement, job_argv


class SpawnLauncher:
    """Makes jails with nsjail (see the module docstring)."""

    async def start(
        self, handle: JailHandle, spec: JobSpec, uid: int, *, pooled: bool,
        on_sent: Callable[[], None],
    ) -> None:
        env = handle.env
        config_fd = env.config_fds[spec.policy.name]
        daemon_end, jail_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        log_r, log_w = os.pipe2(os.O_CLOEXEC)
        try:
            claim_workdirs(uid)
            argv = job_argv(
                env.nsjail,
                spec.policy,
                spec.limits,
                env.host,
                JobPlacement(handle.jail_id, uid, f"/proc/self/fd/{config_fd}", log_w),
            )
            handle.proc = subprocess.Popen(
                [*as_owner(env.launcher, uid), *_accounting_prefix(handle), *argv],
                stdin=jail_end.fileno(),
                stdout=out_w,
                stderr=err_w,
                pass_fds=(config_fd, log_w),
                close_fds=True,
                start_new_session=True,
                env={},
            )
        except BaseException:
            for fd in (out_r, err_r, log_r):
                os.close(fd)
            daemon_end.close()
            release_workdirs(uid)
            raise
        finally:
            for fd in (out_w, err_w, log_w):
                os.close(fd)
            jail_end.close()

        def ended(status: int, cpu_s: float) -> Exited:
            release_workdirs(uid)
            return Exited(returncode=os.waitstatus_to_exitcode(status), cpu_s=cpu_s)

        # stdout, stderr, nsjail's log and the channel: the job is over when nsjail has exited
        # and all four reached EOF (so no output and no CodeFinished is left unread)
        handle.feed(Spawned(forked=False, streams=4))
        watch_exit(handle, handle.proc, ended)
        handle.read_output(out_r, err_r)
        handle.read_log(log_r)
        handle.open_channel(daemon_end)
        on_sent()


@functools.cache
def owner_caps() -> str:
    """The daemon's permitted capabilities, as setpriv's ``--ambient-caps`` spells them
    (``-all,+cap_0,...``): what nsjail keeps when it runs as a namespace owner's uid. Read
    from the daemon itself, not a constant: setpriv refuses to raise a capability the
    process lacks (a host's bounding set may lack CAP_SYS_RESOURCE).

    Raises:
        OSError: /proc/self/status cannot be read.
    """
    with open("/proc/self/status") as status:
        line = next(ln for ln in status if ln.startswith("CapPrm:"))
    permitted = int(line.split()[1], 16)
    bits = [n for n in range(permitted.bit_length()) if permitted >> n & 1]
    return ",".join(["-all", *(f"+cap_{n}" for n in bits)])


def as_owner(launcher: Sequence[str], uid: int) -> list[str]:
    """``launcher`` (``setpriv ... --``) made to start its program as host ``uid`` (real,
    effective and saved uid and gid; no supplementary groups) with the daemon's
    capabilities kept as ambient ones, so that the user namespace nsjail creates is owned
    by ``uid`` and charges its per-user kernel counts there, not to root (see the module
    docstring)."""
    if not launcher or launcher[-1] != "--":
        raise ValueError(f"not a setpriv launcher ending in '--': {list(launcher)}")
    caps = owner_caps()
    return [
        *launcher[:-1],
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--securebits=+no_setuid_fixup",  # keep the capabilities across the uid change
        f"--inh-caps={caps}",
        f"--ambient-caps={caps}",
        "--",
    ]


def _workdirs(uid: int) -> tuple[str, ...]:
    """Where nsjail, run as ``uid``, makes its mount work directories (see the module
    docstring; its environment is empty, so no $TMPDIR)."""
    return (f"/tmp/nsjail.{uid}.root", f"/tmp/nsjail.{uid}.tmp")


def _remove(path: str) -> None:
    """Remove whatever is at ``path`` (never following a link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # with dir fds: safe against links planted inside
    else:
        os.unlink(path)


def claim_workdirs(uid: int) -> None:
    """Make nsjail's work directories for ``uid`` before it runs: empty, ``uid``'s own,
    mode 0755 (nsjail then uses them as they are). In the sticky /tmp no one else can
    replace them.

    Raises:
        OSError: they cannot be made.
    """
    for path in _workdirs(uid):
        _remove(path)
        os.mkdir(path, 0o700)
        os.chown(path, uid, uid)
        os.chmod(path, 0o755)


def release_workdirs(uid: int) -> None:
    """Remove nsjail's work directories for ``uid`` once it has exited (empty: nsjail
    mounted on them only in its jail's mount namespace)."""
    for path in _workdirs(uid):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
                os.rmdir(path)


def sweep_workdirs(uids: range) -> list[str]:
    """At start: remove the work directories a crashed daemon's nsjails left for ``uids``
    (the daemon's block); the ones removed."""
    swept = []
    for name in os.listdir("/tmp"):
        parts = name.split(".")
        if (len(parts) == 3 and parts[0] == "nsjail" and parts[1].isdigit()
                and parts[2] in ("root", "tmp") and int(parts[1]) in uids):
            release_workdirs(int(parts[1]))
            if not os.path.lexists(f"/tmp/{name}"):
                swept.append(name)
    return swept


def _accounting_prefix(handle: JailHandle) -> list[str]:
    """cgroup v1: nsjail places the jail in the memory, pids and cpu hierarchies only;
    CPU time is counted in ``cpuacct``, so nsjail starts there (and the jail with it)."""
    cgroup = handle.cgroup
    acct = cgroup.acct_dir if cgroup is not None else ""
    if not acct or cgroup is None or acct == cgroup.cpu_dir:
        return []
    return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', f"{acct}/cgroup.procs"]


def watch_exit(
    handle: JailHandle,
    proc: subprocess.Popen[bytes],
    ended: Callable[[int, float], Exited] | None = None,
    *,
    before_reap: Callable[[], None] | None = None,
) -> None:
    """Feed the jail's :class:`Exited` when ``proc`` exits (a pidfd on the loop).

    Args:
        ended: makes the event from the wait status and the rusage CPU seconds; by default
            nsjail's exit code and its CPU time.
        before_reap: runs first, while the exited process is a zombie (so its pid, or its
            process group's, cannot have been reused).
    """
    pid = proc.pid
    pidfd = os.pidfd_open(pid)

    def on_exit() -> None:
        if before_reap is not None:
            before_reap()
        try:
            waited, status, rusage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: its status is lost
            waited, status, rusage = pid, 0, None
        if waited == 0:
            return
        handle.loop.remove_reader(pidfd)
        os.close(pidfd)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu_s = rusage.ru_utime + rusage.ru_stime if rusage is not None else 0.0
        if ended is None:
            handle.feed(Exited(returncode=proc.returncode, cpu_s=cpu_s))
        else:
            handle.feed(ended(status, cpu_s))

    handle.loop.add_reader(pidfd, on_exit)


__all__ = [
    "SpawnLauncher",
    "as_owner",
    "claim_workdirs",
    "owner_caps",
    "release_workdirs",
    "sweep_workdirs",
    "watch_exit",
]
