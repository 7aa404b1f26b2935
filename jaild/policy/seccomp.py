"""Compile a policy's ``[seccomp]`` section into a seccomp spec (pure).

Theory of operation
-------------------
The spec (format in :mod:`jaild.runtime.seccomp`) holds two filters, loaded
by the in-jail runtime before any user code runs:

1. **The allow-list.** Default action = the policy's action (``kill`` ends the
   job with status ``policy_violation``; ``errno`` makes the call fail with
   EPERM, so Python raises ``PermissionError``). It allows the profile's groups
   plus the policy's ``allow`` entries minus its ``deny`` entries, and the
   conditional syscalls with safe arguments only:

   * ``clone`` without namespace flags (``strict``: threads only);
   * ``clone3`` -> ENOSYS, always, so glibc falls back to ``clone``, whose
     flags a filter can see;
   * ``socket`` and ``socketpair`` for AF_UNIX, plus AF_INET/AF_INET6 when the
     policy allows a network (a ``socketpair`` of any other family creates its
     sockets in the kernel before it fails). Without a network, AF_INET/AF_INET6
     fail with EACCES whatever the action and profile (``NETWORK_FAMILIES``): agent
     code tries the network and catches the error, and a refusal here reaches no
     kernel code, so killing the job would protect nothing and lose its work. Every
     other family (netlink, packet, alg, vsock, ...: kernel attack surface) gets
     the policy's action. :func:`network_refusal` is what the runtime is told, to
     explain and count the refusals (:mod:`jaild.runtime.network`);
   * ``personality`` for the harmless values only.

   A few never-allowed calls that libraries merely probe (``mbind``,
   ``io_uring_setup``, ...; see ``SOFT_DENY``) fail with EPERM/ENOSYS instead of
   killing the job, whatever the action. So do the side channels the profiles
   close but a policy may re-open (``sysinfo``, ``@inotify``, ``@file-locks``,
   ``@memfd``, ``@page-cache``; see ``SOFT_CLOSED``) while the policy leaves them
   closed.

2. **The deny filter** (default allow): ``ioctl`` TIOCSTI / TIOCLINUX, and the
   argument values a policy leaves closed (``fcntl`` ``F_NOTIFY``, ``F_GETLK``,
   ``F_OFD_GETLK``; ``fadvise64`` ``POSIX_FADV_DONTNEED``; see
   ``ARGUMENT_VALUES``), compared on their low 32 bits, as the kernel reads
   them. It must be a separate filter: libseccomp drops a conditional rule that
   sits beside an unconditional one for the same syscall.

Nothing in :data:`~jaild.policy.syscalls.NEVER` can be allowed; trying is a
policy error that says why.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jaild.errors import SyscallNameError
from jaild.policy.syscalls import (
    ARGUMENT_VALUES,
    CONDITIONAL,
    GROUPS,
    NETWORK_FAMILIES,
    NETWORK_REFUSED,
    NEVER,
    PROFILE_CONDITIONALS,
    PROFILES,
    SOFT_CLOSED,
    SOFT_DENY,
)
from jaild.protocol.messages import NetworkRefusal
from jaild.runtime.seccomp import syscall_number

CLONE_NAMESPACE_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
CLONE_THREAD = 0x00010000
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
PERSONALITY_SAFE = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # linux, linux32, uname26, query

ACTIONS = ("kill", "errno")


@dataclass(frozen=True)
class SeccompChoice:
    """The seccomp part of a policy, as validated."""

    profile: str
    action: str
    allow: tuple[str, ...]
    deny: tuple[str, ...]


def expand(entries: Iterable[str]) -> set[str]:
    """Expand group names; check every syscall name. Raises SyscallNameError."""
    out: set[str] = set()
    for entry in entries:
        if entry.startswith("@"):
            if entry not in GROUPS:
                raise SyscallNameError(f"unknown syscall group {entry!r}; known: {sorted(GROUPS)}")
            out.update(GROUPS[entry])
        else:
            out.add(entry)
    return out


def check_name(name: str) -> None:
    """Raise SyscallNameError unless ``name`` is a syscall of this architecture (or an
    argument value named like one, ``fcntl:F_GETLK``)."""
    if name in CONDITIONAL or name in ARGUMENT_VALUES:
        return
    if syscall_number(name) is None:
        raise SyscallNameError(f"unknown syscall {name!r} (not a syscall on this architecture)")


def allowed_syscalls(choice: SeccompChoice) -> tuple[set[str], set[str]]:
    """(unconditionally allowed syscalls, allowed conditional syscalls) for ``choice``."""
    if choice.profile not in PROFILES:
        raise SyscallNameError(f"unknown profile {choice.profile!r}; known: {sorted(PROFILES)}")
    base = expand(PROFILES[choice.profile])
    extra = expand(choice.allow)
    removed = expand(choice.deny)
    for name in sorted(extra | removed):
        check_name(name)
    for name in sorted(extra):
        if name in NEVER:
            raise SyscallNameError(f"{name!r} can never be allowed: it {NEVER[name]}")
    conditional = set(PROFILE_CONDITIONALS[choice.profile]) | (extra & set(CONDITIONAL))
    conditional -= removed
    plain = ((base | extra) - removed - set(CONDITIONAL)) - set(NEVER)
    return plain, conditional


def build_spec(choice: SeccompChoice, *, network: bool) -> dict[str, Any]:
    """The seccomp spec for the runtime's ``Harden`` message."""
    plain, conditional = allowed_syscalls(choice)
    rules: list[list[Any]] = [
        [name, "allow", []]
        for name in sorted(plain)
        if name not in ARGUMENT_VALUES and syscall_number(name) is not None
    ]
    if "clone" in conditional:
        if choice.profile == "strict":
            cond = [[0, "masked_eq", CLONE_NAMESPACE_FLAGS | CLONE_THREAD, CLONE_THREAD]]
        else:
            cond = [[0, "masked_eq", CLONE_NAMESPACE_FLAGS, 0]]
        rules.append(["clone", "allow", cond])
    rules.append(["clone3", f"errno:{errno.ENOSYS}", []])
    for name, code in sorted(SOFT_DENY.items()):
        if syscall_number(name) is not None:
            rules.append([name, f"errno:{getattr(errno, code)}", []])
    for name, code in sorted(SOFT_CLOSED.items()):
        if name not in plain and name not in ARGUMENT_VALUES and syscall_number(name) is not None:
            rules.append([name, f"errno:{getattr(errno, code)}", []])
    families = [AF_UNIX, AF_INET, AF_INET6] if network else [AF_UNIX]
    refused = f"errno:{getattr(errno, NETWORK_REFUSED)}"
    for name in ("socket", "socketpair"):
        if name in conditional:
            rules.extend([name, "allow", [[0, "eq", family, 0]]] for family in families)
        if not network:
            rules.extend(
                [name, refused, [[0, "eq", family, 0]]] for family in NETWORK_FAMILIES.values()
            )
    if "personality" in conditional:
        rules.extend(["personality", "allow", [[0, "eq", value, 0]]] for value in PERSONALITY_SAFE)
    if "ioctl" in conditional:
        rules.append(["ioctl", "allow", []])
    filters: list[dict[str, Any]] = [{"default": choice.action, "rules": rules}]
    deny = _argument_denials(choice, plain, conditional)
    if deny:
        filters.append({"default": "allow", "rules": deny})
    return {"filters": filters}


def network_refusal(policy_name: str, network_mode: str) -> NetworkRefusal | None:
    """What the runtime of a policy's jails refuses softly and how it says so (``Harden``'s
    ``network``), or None when the policy has a network (nothing is refused softly)."""
    if network_mode != "none":
        return None
    return NetworkRefusal(
        families=tuple(NETWORK_FAMILIES.values()),
        explanation=(
            f"policy {policy_name!r} has no network (network.mode = \"none\"); nothing was "
            "sent. For network access, use a policy with network.mode = \"egress\" and the "
            "host in its [egress] allow list (HTTP(S) by name through jaild's gateway; "
            "`jaild policies` shows what each policy reaches), or a host tool that fetches "
            "for you."
        ),
    )


def _argument_denials(choice: SeccompChoice, plain: set[str], conditional: set[str]) -> list[Any]:
    """The second filter's rules: calls allowed in the first, refused for some arguments.

    Commands are compared on their low 32 bits, as the kernel reads them (``unsigned int``).
    """
    deny: list[list[Any]] = []
    if "ioctl" in conditional:
        deny.extend(
            ["ioctl", choice.action, [[1, "masked_eq", 0xFFFFFFFF, cmd]]]
            for cmd in (TIOCSTI, TIOCLINUX)
        )
    for name, (syscall, arg, value) in ARGUMENT_VALUES.items():
        if syscall in plain and name not in plain:
            action = f"errno:{getattr(errno, SOFT_CLOSED[name])}"
            deny.append([syscall, action, [[arg, "masked_eq", 0xFFFFFFFF, value]]])
    return deny
