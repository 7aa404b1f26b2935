"""The daemon's scheduling hint: a short slice, so the processes it wakes do not preempt it.

Theory of operation
-------------------
A warm job wakes a process at each hop: the daemon writes ``RunCode`` and the jail wakes,
writes ``JobFinished`` and the client wakes. Linux's EEVDF scheduler (6.6 and later) lets a
woken task preempt the running one when its virtual deadline is earlier, which a task that
slept usually has. Measured on the bench's 2-vCPU machine, the daemon's write of
``JobAccepted``/``JobFinished`` took 24 µs at the median but 1.4 ms at p90: the client it
woke took the daemon's CPU mid-job.

Since 6.12 a fair-class task may ask for a shorter *slice* (``sched_setattr`` with
``sched_runtime``, 0.1-100 ms; the default grows with the CPU count: 1.4 ms on the
bench's 2 vCPUs). A shorter slice gives earlier
deadlines: the daemon's short bursts of work between two waits finish before whoever it
woke runs, and it does not get more CPU than its weight gives it. The daemon asks for
``daemon.sched_slice_us`` (100 µs; 0 leaves the kernel's default) for its event-loop thread,
with ``SCHED_FLAG_RESET_ON_FORK``: the threads it starts and the processes it spawns -- its
zygotes, and so every jail -- get the kernel's default slice, not the daemon's.

On kernels before 6.12 the request is accepted and has no effect (the slice reads back as
0): the start-up log says so. Policies other than ``SCHED_OTHER`` (an administrator's
``SCHED_BATCH``, a real-time policy) are left alone, and so is the thread's nice value.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct

log = logging.getLogger("jaild")

_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
"""``sched_setattr`` and ``sched_getattr`` per architecture."""
_ATTR = struct.Struct("=IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1: 56 bytes
SCHED_FLAG_RESET_ON_FORK = 0x01


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def slice_ns(tid: int = 0) -> int | None:
    """The slice of thread ``tid`` (0: the calling one) in ns, as ``sched_getattr`` reads it:
    the kernel's default slice where it asked for none (6.12+; 0 before), None where it
    cannot be read (another architecture, no such thread)."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    buf = ctypes.create_string_buffer(_ATTR.size)
    if _libc().syscall(numbers[1], tid, buf, _ATTR.size, 0) != 0:
        return None
    return int(_ATTR.unpack(buf.raw)[5])


def request_slice(slice_us: int) -> str:
    """Ask for a ``slice_us`` slice for the calling thread (see the module docstring); what
    happened, for the start-up log."""
    if slice_us <= 0:
        return "the kernel's default slice"
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return f"the kernel's default slice (no sched_setattr number for {platform.machine()})"
    policy = os.sched_getscheduler(0)
    if policy != os.SCHED_OTHER:
        return f"its own scheduling policy ({policy}), left alone"
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's: sched_setattr sets it too
    attr = _ATTR.pack(
        _ATTR.size, os.SCHED_OTHER, SCHED_FLAG_RESET_ON_FORK, nice, 0, slice_us * 1000, 0, 0, 0, 0
    )
    libc = _libc()
    if libc.syscall(numbers[0], 0, ctypes.create_string_buffer(attr), 0) != 0:
        err = ctypes.get_errno()
        return f"the kernel's default slice (sched_setattr: {os.strerror(err)})"
    if slice_ns() != slice_us * 1000:  # before 6.12: accepted, not kept (reads back 0)
        return "the kernel's default slice (this kernel has no per-task slices; 6.12 does)"
    return f"a {slice_us} us slice"


__all__ = ["request_slice", "slice_ns"]
