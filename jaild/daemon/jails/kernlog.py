"""Which syscall a seccomp filter killed a process for, from the kernel's own log.

When a filter kills a process the kernel writes an audit record
(``audit: type=1326 ... pid=<host pid> ... syscall=<nr> ...``) to the kernel
log. That is evidence the jailed code cannot forge, so the daemon reads
``/dev/kmsg`` (from the position at daemon start) and looks the dead process
up by its host pid. The kernel rate-limits these records, so this is
best-effort: the status (``policy_violation``) never depends on it, only the
``syscall`` detail does.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict

from jaild.runtime.seccomp import syscall_name

_SECCOMP = re.compile(rb"type=1326 .*? pid=(\d+) .*? syscall=(\d+)")
_KEEP = 4096


class KernelAuditLog:
    """A non-blocking reader of /dev/kmsg that remembers recent seccomp kills."""

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self._fd = -1
        self._kills: OrderedDict[int, int] = OrderedDict()
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            self.close()

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def drain(self) -> None:
        """Read every record written since the last call."""
        while self._fd >= 0:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == 32:  # EPIPE: records were overwritten; keep reading
                    continue
                return
            if not record:
                return
            match = _SECCOMP.search(record)
            if match:
                self._kills[int(match.group(1))] = int(match.group(2))
                while len(self._kills) > _KEEP:
                    self._kills.popitem(last=False)

    def seccomp_kill(self, host_pid: int) -> str | None:
        """Name of the syscall that got ``host_pid`` killed, if the kernel logged it."""
        self.drain()
        number = self._kills.pop(host_pid, None)
        if number is None:
            return None
        return syscall_name(number) or f"syscall {number}"

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
