"""A policy's seccomp filters split in two: what its zygote loads once, what each jail adds.

Theory of operation
-------------------
Loading a policy's filters costs each jail ~1.1 ms of kernel CPU (the kernel converts,
JIT-compiles and pre-evaluates every filter for every system call number, for its action
cache): a seventh of a fresh jail's kernel floor. Most of it is the allow-list, the same
for every jail of the policy. The zygote cannot load the policy's own filters -- it needs
``unshare``, ``mount``, ``setns`` and a few more for each jail, and so does each jail until
its runtime has dropped its privileges -- but it can load them *with those calls let
through*, once. Each jail then adds a small filter that takes them away again.

:func:`split` does it for a seccomp spec (:mod:`jaild.runtime.seccomp`), filter by filter.
Let ``E`` be the calls of :data:`ZYGOTE_NEEDS` that some filter of the spec does not allow
whatever their arguments. For each filter ``P_i`` of the spec:

* the zygote's filter ``Z_i`` is ``P_i`` with every rule for a call of ``E`` removed and,
  where the default is not allow, an unconditional allow for it;
* the jail's filter ``J_i`` (default allow) gives every call of ``E`` exactly ``P_i``'s
  verdict: ``P_i``'s rules for it, and where ``P_i`` falls back on a default other than
  allow, rules that give that default when none of them matches.

The jail's filters become one where no call has rules in two of them (the shipped policies:
``clone``, ``mount`` and the like come from the allow-list, ``ioctl`` from the filter of
argument values).

So for a call outside ``E``, ``J_i`` allows and ``Z_i`` is ``P_i``; for a call in ``E``,
``Z_i`` allows and ``J_i`` is ``P_i``: the kernel's verdict over all the filters is the
spec's. ``E`` is one set for all filters, so for every call the filters that decide keep
the spec's order -- the kernel runs the newest filter first and, of two verdicts of equal
precedence (two ``errno`` values), keeps the first it met. tests/unit/test_zygote_filter.py
checks the equivalence by running the BPF programs themselves, the spec's beside the
zygote's and the jail's together, over every system call number and the argument values
the specs compare with, for every shipped policy and for generated specs.

"Rules that give the default when none matches" exist for one conditional rule of one
``masked_eq`` comparison (``clone``'s namespace flags): its complement is one rule per bit
of the mask. A call of ``E`` with any other shape of conditional rules beside a default
other than allow (``socket``'s list of families, say) cannot be split: :func:`split` raises
:class:`Unsplittable`, and the policy's jails load the whole spec, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jaild.errors import Unsplittable

ZYGOTE_NEEDS: frozenset[str] = frozenset({
    # the zygote's loop: read a plan, fork the jail into a fresh pid namespace, reap
    "pselect6", "select", "recvmsg", "sendmsg", "sendto", "recvfrom", "read", "write",
    "close", "setns", "unshare", "clone", "clone3", "wait4", "rt_sigreturn", "rt_sigaction",
    "rt_sigprocmask", "openat", "newfstatat", "lseek", "ioctl", "fcntl", "brk", "mmap",
    "munmap", "exit_group", "gettid", "get_robust_list",
    # the jail, from the fork until its runtime has loaded its own filter
    # (jaild.runtime.zygote.jail_steps, jaild.runtime.harden)
    "set_robust_list", "dup2", "close_range", "mount", "umount2", "mkdir", "rmdir",
    "sethostname", "chdir", "prlimit64", "setrlimit", "getgroups", "setgroups",
    "setresgid", "setresuid", "capget", "capset", "prctl", "getrandom", "getsockname",
    "getsockopt", "seccomp", "exit",
})
"""What a zygote and its jails call before a jail's own filter is loaded (read with
``strace -f`` of a zygote and its jails; the shipped policies' filters already allow most of
it). A call missing here fails the zygote's tests at once; it never weakens a jail."""


class Split(NamedTuple):
    """A spec split in two (see the module docstring)."""

    zygote: dict[str, Any]
    """The spec the zygote loads once: the policy's, with the zygote's needs let through."""
    jail: dict[str, Any] | None
    """The spec each jail loads on top (default allow), or None: nothing to take back."""
    taken_back: tuple[str, ...]
    """The calls ``E``: let through in the zygote, given the policy's verdict in each jail."""


def _allows_always(fspec: Mapping[str, Any], name: str) -> bool:
    rules = [rule for rule in fspec["rules"] if rule[0] == name]
    unconditional = {rule[1] for rule in rules if not rule[2]}
    if unconditional:
        return unconditional == {"allow"}
    if fspec["default"] != "allow":
        return False
    return all(rule[1] == "allow" for rule in rules)


def _complement(name: str, rules: Sequence[Sequence[Any]], action: str) -> list[list[Any]]:
    """Rules giving ``action`` exactly when none of ``rules`` (one action, each
    conditional) matches.

    Raises:
        Unsplittable: the complement is not a union of libseccomp rules of this kind.
    """
    if len(rules) != 1 or len(rules[0][2]) != 1 or rules[0][2][0][1] != "masked_eq":
        raise Unsplittable(
            f"{name!r}: a default beside {len(rules)} conditional rule(s) other than one "
            "masked_eq comparison cannot be rebuilt in a filter whose default is allow"
        )
    arg, _, mask, value = rules[0][2][0]
    value &= mask  # libseccomp compares the datum masked too (the proof's generated specs)
    return [
        [name, action, [[arg, "masked_eq", 1 << bit, (1 << bit) & ~value]]]
        for bit in range(64)
        if mask >> bit & 1
    ]


def _jail_rules(fspec: Mapping[str, Any], name: str) -> list[list[Any]]:
    """Rules for ``name`` in a default-allow filter that give ``fspec``'s verdict for it."""
    default = fspec["default"]
    rules = [list(rule) for rule in fspec["rules"] if rule[0] == name and rule[1] != default]
    unconditional = [rule for rule in rules if not rule[2]]
    if unconditional:
        actions = {rule[1] for rule in unconditional}
        if len(actions) != 1 or len(unconditional) != len(rules):
            # which of them libseccomp's tree lets decide depends on their order (the
            # proof's generated specs): the shipped policies never mix them
            raise Unsplittable(f"{name!r}: unconditional and other rules beside each other")
        (action,) = actions
        return [] if action == "allow" else [[name, action, []]]
    if not rules:
        return [] if default == "allow" else [[name, default, []]]
    actions = {rule[1] for rule in rules}
    if len(actions) != 1:
        raise Unsplittable(f"{name!r}: conditional rules with {sorted(actions)}")
    (action,) = actions
    kept = [] if action == "allow" else rules
    if default == "allow":
        return kept
    return kept + _complement(name, rules, default)


def split(spec: Mapping[str, Any], needs: frozenset[str] = ZYGOTE_NEEDS) -> Split:
    """The zygote's part and the jail's part of ``spec`` (see the module docstring). Pure.

    Raises:
        Unsplittable: a call of ``needs`` has a verdict the jail's part cannot rebuild.
    """
    filters = spec["filters"]
    taken = sorted(
        name for name in needs if any(not _allows_always(f, name) for f in filters)
    )
    zygote: list[dict[str, Any]] = []
    jail: list[dict[str, Any]] = []
    for fspec in filters:
        ours = [_jail_rules(fspec, name) for name in taken]
        rules = [list(rule) for rule in fspec["rules"] if rule[0] not in taken]
        if fspec["default"] != "allow":
            rules += [[name, "allow", []] for name in taken]
        zygote.append({"default": fspec["default"], "rules": rules})
        jail_rules = [rule for group in ours for rule in group]
        if jail_rules:
            jail.append({"default": "allow", "rules": jail_rules})
    names = [{rule[0] for rule in f["rules"]} for f in jail]
    if len(jail) > 1 and sum(map(len, names)) == len(set().union(*names)):
        # No call has rules in two of them: one filter holds them all and decides each call
        # as the one it came from did (the kernel loads, and runs, one filter fewer).
        jail = [{"default": "allow", "rules": [rule for f in jail for rule in f["rules"]]}]
    return Split(
        zygote={"filters": zygote},
        jail={"filters": jail} if jail else None,
        taken_back=tuple(taken),
    )
