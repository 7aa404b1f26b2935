"""Syscall groups and the two built-in seccomp profiles (data only).

Group names follow systemd's ``SystemCallFilter=`` vocabulary (``@basic-io``,
``@file-system``, ...) so policies read the way operators already know; the
contents are jaild's own, for x86_64, and every name is checked against
libseccomp when a policy is loaded.

Profiles are **allow-lists**: anything not allowed hits the policy's action
(kill the job, or fail the call with EPERM). A few syscalls are allowed only
with safe arguments (see ``CONDITIONAL``), and ``NEVER`` lists what no policy
may allow, whatever it says.
"""

from __future__ import annotations

# fmt: off
GROUPS: dict[str, tuple[str, ...]] = {
    "@default": (
        "arch_prctl", "brk", "clock_getres", "clock_gettime", "clock_nanosleep", "exit",
        "exit_group", "futex", "futex_waitv", "get_robust_list", "getegid", "geteuid", "getgid",
        "getgroups", "getpgid", "getpgrp", "getpid", "getppid", "getrandom", "getresgid",
        "getresuid", "getrlimit", "getsid", "gettid", "gettimeofday", "getuid", "membarrier",
        "mmap", "mprotect", "munmap", "nanosleep", "pause", "prlimit64", "restart_syscall",
        "rseq", "rt_sigreturn", "sched_getaffinity", "sched_yield", "set_robust_list",
        "set_tid_address", "time", "uname",
    ),
    "@basic-io": (
        "close", "close_range", "dup", "dup2", "dup3", "lseek", "pread64", "preadv", "preadv2",
        "pwrite64", "pwritev", "pwritev2", "read", "readv", "write", "writev",
    ),
    "@file-system": (
        "access", "chdir", "chmod", "creat", "faccessat", "faccessat2", "fallocate", "fchdir",
        "fchmod", "fchmodat", "fcntl", "fgetxattr", "flistxattr", "fstat", "fstatfs",
        "ftruncate", "futimesat", "getcwd", "getdents", "getdents64", "getxattr", "lgetxattr",
        "link", "linkat", "listxattr", "llistxattr", "lstat", "mkdir", "mkdirat", "newfstatat",
        "open", "openat", "openat2", "readlink", "readlinkat", "rename", "renameat",
        "renameat2", "rmdir", "stat", "statfs", "statx", "symlink", "symlinkat", "truncate",
        "unlink", "unlinkat", "utime", "utimensat", "utimes",
    ),
    "@memory": (
        "madvise", "mincore", "mlock", "mlock2", "mremap", "msync", "munlock", "get_mempolicy",
    ),
    "@sync": (
        "fdatasync", "fsync", "sync_file_range", "syncfs", "sync",
    ),
    "@signal": (
        "rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigsuspend", "rt_sigtimedwait",
        "sigaltstack", "signalfd", "signalfd4",
    ),
    "@io-event": (
        "epoll_create", "epoll_create1", "epoll_ctl", "epoll_pwait", "epoll_pwait2",
        "epoll_wait", "eventfd", "eventfd2", "poll", "ppoll", "pselect6", "select",
    ),
    "@timer": (
        "alarm", "getitimer", "setitimer", "timer_create", "timer_delete", "timer_getoverrun",
        "timer_gettime", "timer_settime", "timerfd_create", "timerfd_gettime",
        "timerfd_settime", "times",
    ),
    "@ipc-local": (
        "pipe", "pipe2",
    ),
    "@sysv-ipc": (
        "msgctl", "msgget", "msgrcv", "msgsnd", "semctl", "semget", "semop", "semtimedop",
        "shmat", "shmctl", "shmdt", "shmget", "mq_getsetattr", "mq_notify", "mq_open",
        "mq_timedreceive", "mq_timedsend", "mq_unlink",
    ),
    "@network-io": (
        "accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt",
        "listen", "recvfrom", "recvmmsg", "recvmsg", "sendmmsg", "sendmsg", "sendto",
        "setsockopt", "shutdown", "socketpair",
    ),
    "@process": (
        "capget", "execve", "execveat", "fork", "getrusage", "kill", "pidfd_open",
        "pidfd_send_signal", "prctl", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "tgkill", "tkill",
        "vfork", "wait4", "waitid",
    ),
    "@threads": (
        "set_robust_list", "get_robust_list", "futex", "rseq", "sched_getaffinity",
    ),
    "@resources": (
        "getpriority", "ioprio_get", "sched_get_priority_max", "sched_get_priority_min",
        "sched_getattr", "sched_getparam", "sched_getscheduler", "sched_rr_get_interval",
        "setpriority", "setrlimit",
    ),
    "@file-io-misc": (
        "copy_file_range", "sendfile", "splice", "tee", "vmsplice", "fadvise64", "umask",
        "readahead",
    ),
    "@seccomp": (
        "seccomp",
    ),
    # Closed in every shipped profile: side channels through the shared read-only binds
    # (docs/security.md, "Side channels"). A policy re-opens one with
    # `seccomp.allow = ["@inotify"]`.
    "@inotify": (
        "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch",
        "fcntl:F_NOTIFY",
    ),
    "@file-locks": (
        "flock", "fcntl:F_GETLK", "fcntl:F_OFD_GETLK",
    ),
    "@memfd": (
        "memfd_create",
    ),
    "@page-cache": (
        "fadvise64:POSIX_FADV_DONTNEED",
    ),
}
"""Named syscall groups. A policy may name groups (``@file-system``) or single syscalls."""

CONDITIONAL: tuple[str, ...] = ('clone', 'clone3', 'socket', 'socketpair', 'ioctl', 'personality')
"""Allowed only with safe arguments; the rules are built in :mod:`jaild.policy.seccomp`."""

_NEVER_BY_REASON: tuple[tuple[tuple[str, ...], str], ...] = (
    ((
        "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    ), "inspects or alters other processes"),
    ((
        "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
        "move_mount", "open_tree", "mount_setattr",
    ), "changes the mount table"),
    ((
        "unshare", "setns",
    ), "creates or joins namespaces"),
    ((
        "keyctl", "add_key", "request_key",
    ), "reaches the kernel keyring"),
    ((
        "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie",
    ), "is a large kernel attack surface"),
    ((
        "io_uring_setup", "io_uring_enter", "io_uring_register",
    ), "bypasses seccomp for the I/O it submits"),
    ((
        "kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module",
        "delete_module", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
        "vhangup", "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime",
        "adjtimex", "sethostname", "setdomainname",
    ), "administers the host"),
    ((
        "open_by_handle_at", "name_to_handle_at",
    ), "opens files by handle, escaping mounts"),
    ((
        "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid",
        "setfsgid", "setgroups", "capset",
    ), "changes credentials"),
    ((
        "mknod", "mknodat",
    ), "creates device nodes"),
    ((
        "process_madvise", "migrate_pages", "move_pages", "mbind", "set_mempolicy",
        "set_mempolicy_home_node",
    ), "manipulates memory placement of processes"),
    ((
        "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    ), "is not needed by jailed code"),
    ((
        "fanotify_init", "fanotify_mark", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl",
        "modify_ldt", "remap_file_pages", "vm86", "vm86old",
    ), "is obsolete or privileged"),
)
NEVER: dict[str, str] = {name: reason for names, reason in _NEVER_BY_REASON for name in names}
"""Syscalls no policy may allow, with the reason shown when a policy tries."""

SOFT_DENY: dict[str, str] = {
    "mbind": "EPERM",
    "set_mempolicy": "EPERM",
    "set_mempolicy_home_node": "EPERM",
    "migrate_pages": "EPERM",
    "move_pages": "EPERM",
    "io_uring_setup": "ENOSYS",
    "io_uring_enter": "ENOSYS",
    "io_uring_register": "ENOSYS",
}
"""Never allowed, but *failed* rather than killed whatever the policy's action: libraries
probe them (numpy's allocator calls ``mbind``; io_uring users fall back on ENOSYS), and
Docker's profile answers them the same way."""

PROFILES: dict[str, tuple[str, ...]] = {
    "default": (
        "@default", "@basic-io", "@file-system", "@memory", "@sync", "@signal", "@io-event",
        "@timer", "@ipc-local", "@sysv-ipc", "@network-io", "@process", "@threads",
        "@resources", "@file-io-misc", "@seccomp", "getcpu", "sched_setaffinity",
    ),
    "strict": (
        "@default", "@basic-io", "@file-system", "@memory", "@signal", "@io-event", "@timer",
        "@threads", "@seccomp", "getsockname", "getpeername", "getsockopt", "setsockopt",
        "recvfrom", "sendto", "recvmsg", "sendmsg", "sendfile", "copy_file_range", "shutdown",
        "pipe2", "getrusage", "getcpu", "umask", "prctl", "tgkill", "capget", "fadvise64",
        "getpriority",
    ),
}
"""Built-in allow-lists. ``strict`` has no process creation, no new sockets, no SysV IPC.
Neither has ``sysinfo``, ``@inotify``, ``@file-locks``, ``@memfd`` or ``@page-cache`` (see
``SOFT_CLOSED``)."""

PROFILE_CONDITIONALS: dict[str, frozenset[str]] = {
    "default": frozenset({'clone', 'clone3', 'ioctl', 'personality', 'socket', 'socketpair'}),
    "strict": frozenset({'clone', 'clone3', 'ioctl', 'personality', 'socketpair'}),
}
"""Which conditional syscalls each profile allows (with safe arguments only).

In ``strict``, ``clone`` is allowed for threads only (CLONE_THREAD required); ``socketpair``
is AF_UNIX only there, as there is no network.
"""

ARGUMENT_VALUES: dict[str, tuple[str, int, int]] = {
    "fcntl:F_GETLK": ("fcntl", 1, 5),
    "fcntl:F_OFD_GETLK": ("fcntl", 1, 36),
    "fcntl:F_NOTIFY": ("fcntl", 1, 1026),
    "fadvise64:POSIX_FADV_DONTNEED": ("fadvise64", 3, 4),
}
"""One value of one argument of a syscall, which a policy allows or denies by name as if it
were a syscall: name -> (syscall, argument index, value; compared on the low 32 bits). Every
other value is allowed with the syscall: ``F_SETLK``/``F_OFD_SETLK`` stay open (SQLite locks
its files with them), and so does every other ``fadvise`` advice."""

NETWORK_FAMILIES: dict[str, int] = {"AF_INET": 2, "AF_INET6": 10}
"""The address families of a network. A policy without one (``network.mode = "none"``)
*refuses* ``socket`` and ``socketpair`` of these with ``NETWORK_REFUSED``, whatever its action
and profile, instead of killing the job: agent code wraps a fetch in ``try``/``except`` and
goes on, and the filter answers before the kernel looks at the call, so no socket is made
and no kernel code runs for it. Every other family a policy does not allow (AF_NETLINK,
AF_PACKET, AF_ALG, AF_VSOCK, ...: kernel attack surface, never needed for a network) gets
the policy's action. The in-jail runtime explains and counts the refusals of the job's own
interpreter (:mod:`jaild.runtime.network`)."""

NETWORK_REFUSED = "EACCES"
"""The errno of a refused network family: Python raises ``PermissionError`` ("Permission
denied"), which a policy's ``errno`` action (EPERM) does not give, so the two read apart."""

SOFT_CLOSED: dict[str, str] = {
    "sysinfo": "EPERM",
    "inotify_init": "ENOSYS",
    "inotify_init1": "ENOSYS",
    "inotify_add_watch": "ENOSYS",
    "inotify_rm_watch": "ENOSYS",
    "fcntl:F_NOTIFY": "EPERM",
    "flock": "ENOSYS",
    "fcntl:F_GETLK": "EPERM",
    "fcntl:F_OFD_GETLK": "EPERM",
    "memfd_create": "ENOSYS",
    "fadvise64:POSIX_FADV_DONTNEED": "EPERM",
}
"""Closed in every built-in profile, and *failed* rather than killed when a policy leaves them
closed, whatever its action: they are side channels between tenants (``sysinfo`` shows the
host's task count, memory, load and uptime; inotify, dnotify, ``flock`` and lock queries see
other jails' and the host's use of the shared read-only binds; ``POSIX_FADV_DONTNEED`` drops
the shared binds' pages from the host's page cache, the reset half of a page-cache channel;
a ``memfd`` runs a binary despite the ``noexec`` ``/tmp``), yet ordinary libraries call
them and have a fallback: ``filelock`` raises on ENOSYS from ``flock`` (it would spin on
EPERM), gdbm falls back to ``fcntl`` locks, libffi to other trampolines, ``fadvise`` callers
ignore its failure, glibc's ``sysconf`` gets nothing (see :mod:`jaild.runtime.seccomp`). A
policy re-opens them with ``seccomp.allow``."""
# fmt: on
