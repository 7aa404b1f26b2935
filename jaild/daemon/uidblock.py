"""A daemon's claim on its block of jail uids: no two jaild instances on one kernel share one.

Theory of operation
-------------------
Every daemon runs its jails and zygotes as host uids of one block of 65,536
(``DaemonConfig.uid_base``: the default socket's block, or one of 4,095 picked by hashing
the instance's name, itself a hash of the socket path). Two instances whose socket paths
land on one block would run jails as the same host uids -- each could signal the other's
jails and read what they own, and each would count the other's processes and files as its
own. Nothing in the hash prevents it (1 in 4,095 per pair of instances), so at start-up the
daemon *claims* its block, and refuses to start if another instance holds it.

The claim is an exclusive, non-blocking ``flock`` on ``<LOCK_DIR>/<uid_base>.lock``, held on
an open descriptor for the daemon's life:

* The kernel drops it when the last reference to the descriptor's open file goes: at stop
  (:meth:`UidBlockClaim.release`, once the jails are gone), or when the process dies, however
  it dies. A crash leaves nothing to clean up: the file stays, unlocked, for the next claim.
* The file is never removed (two claimants could otherwise lock two files of one name, one
  of them unlinked). It holds what its last claimant wrote -- its socket path and pid --
  for a refusal to name. A claimant opens it without truncating, and rewrites it
  only once it holds the lock.
* A flock belongs to the open file, not to the process: a second claim in one process (two
  private daemons in one command) is refused like another process's.
* The descriptor is close-on-exec: nsjail and the zygotes never inherit it, so nothing the
  daemon started holds its block after it has stopped.

Where: ``/run/jaild/uid-blocks``, one directory every instance on the host sees. On a host it
is made (0700 root; ``/run/jaild`` 0755 if missing, as the image makes it); under systemd
it is inside the unit's ``RuntimeDirectory=jaild`` (``ProtectSystem=strict`` leaves nothing
else of ``/run`` writable; ``RuntimeDirectoryPreserve=yes`` keeps it, and a held claim, across
the unit's stops); in the container image it is the same path, on Kubernetes the node's
``/run/jaild`` (the hostPath the socket is in), so a DaemonSet's daemon and one installed on
the node meet there. A container with a ``/run/jaild`` of its own (podman with a socket
directory per container) claims among its own daemons only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from jaild.daemon.selftest import UID_BLOCK
from jaild.errors import StartupError

LOCK_DIR = "/run/jaild/uid-blocks"
"""Where each claimed block has its lock file, ``<uid_base>.lock``."""


@dataclass
class UidBlockClaim:
    """A held claim on the uid block from ``base``: its lock file and the open descriptor the
    lock is on (close-on-exec; -1 once released)."""

    base: int
    path: str
    fd: int

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        """Give the block up (closing the descriptor drops the lock). Idempotent. Call it
        once no jail of the daemon runs: the block's uids are free from then on."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def lock_path(base: int, lock_dir: str = LOCK_DIR) -> str:
    """The lock file of the block from ``base``."""
    return os.path.join(lock_dir, f"{base}.lock")


def claim_uid_block(base: int, socket_path: str, lock_dir: str = LOCK_DIR) -> UidBlockClaim:
    """Claim the uid block from ``base`` for the daemon serving ``socket_path``.

    Args:
        base: the block's first uid (``DaemonConfig.uid_base``).
        socket_path: the daemon's socket, written into the lock file for a refused
            instance's message.
        lock_dir: the directory of lock files (tests give a temporary one).
    Returns:
        The claim; hold it for the daemon's life and :meth:`~UidBlockClaim.release` it at
        stop, after the jails are gone.
    Raises:
        StartupError: another jaild instance holds the block (naming its socket path and
            pid where known, and what to do), or the lock directory or file is not safe
            to use or cannot be made.
    """
    path = lock_path(base, lock_dir)
    block = f"{base}..{base + UID_BLOCK - 1}"
    _lock_directory(lock_dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise StartupError(f"cannot claim the jails' uid block {block}: {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StartupError(
                f"cannot claim the jails' uid block {block}: {path} is not a regular file; "
                "remove it"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = os.pread(fd, 4096, 0).decode(errors="replace")
            holders = flock_holders(_read("/proc/locks"), st.st_dev, st.st_ino)
            raise StartupError(
                f"the jails' uid block {block} is in use by another jaild instance "
                f"({describe_holder(record, holders, _command_line)}; {path}): two instances "
                "must not run jails as the same host uids. The block is picked from the "
                "socket path: serve another socket path (--socket, daemon.socket or "
                "JAILD_SOCKET) -- another instance -- or stop the other one"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, claim_record(socket_path, os.getpid()).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return UidBlockClaim(base, path, fd)


def claim_record(socket_path: str, pid: int) -> str:
    """What a claimant writes into its lock file (one line of JSON)."""
    return json.dumps({"socket": socket_path, "pid": pid}) + "\n"


def describe_holder(record: str, holders: list[int], command_line: Callable[[int], str]) -> str:
    """Who holds a block, for the refusal: the socket path and pid its lock file names (what
    its last claimant wrote), and the pids ``/proc/locks`` shows holding the lock, each with
    its command line, where those differ (a claimant that has not written its record yet,
    or something else holding the file)."""
    socket, pid = _parse_record(record)
    parts = [f"socket {socket}, pid {pid}"] if socket is not None else []
    others = [p for p in holders if p != pid]
    if others:
        held = ", ".join(f"pid {p}: {command_line(p) or '?'}" for p in others)
        parts.append(f"the lock held by {held}" if parts else f"held by {held}")
    return "; ".join(parts) or "it wrote nothing into the lock file"


def _parse_record(record: str) -> tuple[str | None, int | None]:
    """The socket path and pid of a lock file's record; (None, None) if it is not one."""
    try:
        fields = json.loads(record)
        return str(fields["socket"]), int(fields["pid"])
    except (ValueError, KeyError, TypeError):
        return None, None


def flock_holders(locks: str, device: int, inode: int) -> list[int]:
    """The pids holding a ``flock`` on the file (``device``, ``inode``), from the text of
    ``/proc/locks`` (lines like ``1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF``; the device
    as hex major:minor; ``->`` lines wait for a lock and hold none). The kernel lists only the
    locks of processes visible in the reader's pid namespace."""
    want = f"{os.major(device):02x}:{os.minor(device):02x}:{inode}"
    pids = []
    for line in locks.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # a "->" line: a waiter
            continue
        with contextlib.suppress(ValueError):
            if fields[5] == want and int(fields[4]) > 0:
                pids.append(int(fields[4]))
    return pids


def _lock_directory(lock_dir: str) -> None:
    """Make the lock directory (0700; its parent 0755 if missing) or check the one there: a
    directory of this uid that no one else may write into."""
    try:
        os.makedirs(os.path.dirname(lock_dir), mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(lock_dir, 0o700)
        st = os.lstat(lock_dir)
    except OSError as exc:
        raise StartupError(
            f"cannot make the directory of uid block claims {lock_dir}: {exc.strerror}"
        ) from None
    euid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid or st.st_mode & 0o077:
        raise StartupError(
            f"{lock_dir} (where jaild instances claim their uid blocks) must be a directory "
            f"of uid {euid} with mode 0700; it is not (mode {stat.filemode(st.st_mode)}, uid "
            f"{st.st_uid}): remove it, and the daemon makes it anew"
        )


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _command_line(pid: int) -> str:
    """A process's command line, shortened, for a message ("" if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(4096).replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return ""
