"""A fork straight into a cgroup: ``clone3(CLONE_INTO_CGROUP)``, for a zygote on cgroup v2.

A jail the zygote forks with ``fork()`` starts in the zygote's cgroup, and the daemon then
moves it into its job's (a write to ``cgroup.procs``, which on v2 waits for an RCU grace
period, in a worker thread of the daemon), while the jail waits for the daemon's go. Forked
with ``clone3`` and ``CLONE_INTO_CGROUP``, it is born in its job's cgroup: nothing to move,
nothing to wait for, and never charged to the zygote's.

``clone3`` is a raw system call, not glibc's ``fork``, so the child side of glibc's ``fork`` is
done here, as far as a single-threaded parent needs it (glibc 2.36, ``_Fork`` and
``__libc_fork``):

* glibc's thread structure caches the thread's id (``struct pthread``'s ``tid``), which glibc's
  ``fork`` has the kernel write in the child (``CLONE_CHILD_SETTID``). So does this, at the
  field's offset as glibc itself publishes it for debuggers (``_thread_db_pthread_tid``,
  ``libthread_db``'s description of the field), checked against ``gettid`` before it is used.
* the kernel clears a new process's robust-futex list; glibc's child registers its own again
  (``set_robust_list``), as does this, with the head the parent has (``get_robust_list``).
* the rest concerns other threads (their stacks, the locks they might hold: the zygote has
  none), ``pthread_once`` in flight (none) and ``pthread_atfork`` handlers (glibc's ``fork``
  runs them in the child; this does not -- as :func:`jaild.runtime.zygote._fork_jail` already
  skips the interpreter's own, the jail's random state is reseeded by
  :mod:`jaild.runtime.reseed`, and OpenSSL 3 tells a fork by its pid).

Anything unexpected -- another libc, a field that does not read as the thread's id, an
architecture not listed -- and :func:`prepare` says why, and the zygote forks as before.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal

CLONE_CHILD_SETTID = 0x01000000
CLONE_INTO_CGROUP = 0x200000000
ARGS_WORDS = 11
"""``struct clone_args`` (``CLONE_ARGS_SIZE_VER2``, 88 bytes): flags, pidfd, child_tid,
parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup."""
CHILD_TID, EXIT_SIGNAL, CGROUP = 2, 4, 10

SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"clone3": 435, "gettid": 186, "set_robust_list": 273, "get_robust_list": 274},
    "aarch64": {"clone3": 435, "gettid": 178, "set_robust_list": 99, "get_robust_list": 100},
}

_syscall = ctypes.PyDLL(None, use_errno=True).syscall
"""libc's ``syscall``, called with the GIL held (``PyDLL``), as the zygote's ``fork`` is."""
_syscall.restype = ctypes.c_long


class CloneInto:
    """``clone3`` into a cgroup, with glibc's child-side state set as ``fork`` sets it;
    made by :func:`prepare`. Its argument block is made once and reused."""

    def __init__(self, numbers: dict[str, int], tid_address: int, robust: tuple[int, int]):
        # the call's arguments made once: every object made per fork is written to a page
        # the zygote shares with its jails, and copied
        self._clone3 = ctypes.c_long(numbers["clone3"])
        self._set_robust_list = ctypes.c_long(numbers["set_robust_list"])
        self._robust = (ctypes.c_void_p(robust[0]), ctypes.c_size_t(robust[1]))
        self._size = ctypes.c_size_t(ARGS_WORDS * 8)
        self._args = (ctypes.c_uint64 * ARGS_WORDS)()
        self._args[0] = CLONE_INTO_CGROUP | CLONE_CHILD_SETTID
        self._args[CHILD_TID] = tid_address
        self._args[EXIT_SIGNAL] = signal.SIGCHLD
        self._address = ctypes.c_void_p(ctypes.addressof(self._args))

    def fork(self, cgroup_fd: int) -> int:
        """Fork into the cgroup directory ``cgroup_fd`` (an ``O_PATH`` descriptor will do):
        the child's pid in the parent, 0 in the child.

        Raises:
            OSError: the kernel refused (ENOSYS: no ``clone3``; EACCES, EPERM: the caller may
                not write the target's or the common ancestor's ``cgroup.procs``; ENOENT:
                the target is outside the caller's cgroup namespace; EBUSY: it is not a leaf,
                or a v1 hierarchy; EBADF: not a cgroup v2 directory).
        """
        self._args[CGROUP] = cgroup_fd
        pid: int = _syscall(self._clone3, self._address, self._size)
        if pid < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if pid == 0:
            _syscall(self._set_robust_list, *self._robust)
        return pid


def prepare() -> CloneInto | str:
    """The machinery for this process, or why it cannot be had (the caller then forks).
    Call it in the thread that will fork (the zygote has one)."""
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        return f"no clone3 numbers for {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        bits, count, offset = (ctypes.c_uint32 * 3).in_dll(libc, "_thread_db_pthread_tid")
    except ValueError:
        return "libc does not describe its thread structure (_thread_db_pthread_tid)"
    if bits != 32 or count != 1:
        return f"glibc's tid field is {bits} bits x {count}, not one 32-bit int"
    libc.pthread_self.restype = ctypes.c_void_p
    self_address = libc.pthread_self()
    tid = _syscall(ctypes.c_long(numbers["gettid"]))
    if not self_address or ctypes.c_int.from_address(self_address + offset).value != tid:
        return "glibc's tid field does not hold this thread's id"
    head, size = ctypes.c_void_p(), ctypes.c_size_t()
    if _syscall(ctypes.c_long(numbers["get_robust_list"]), ctypes.c_long(0),
                ctypes.byref(head), ctypes.byref(size)) != 0 or not head.value:
        return f"no robust-futex list to hand on: {os.strerror(ctypes.get_errno())}"
    return CloneInto(numbers, self_address + offset, (head.value, size.value))


__all__ = ["CloneInto", "prepare"]
