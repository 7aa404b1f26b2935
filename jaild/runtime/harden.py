"""The one place jaild touches python-prctl: lock the jailed process down.

Theory of operation
-------------------
nsjail already drops capabilities and sets no_new_privs; the runtime does it
again itself and then *verifies* the result, so a misconfigured nsjail fails
closed instead of running user code in a weaker jail:

1. ``PR_SET_NO_NEW_PRIVS`` -- execve can never grant privileges (setuid bits,
   file capabilities). Required before an unprivileged seccomp filter load.
2. ``PR_SET_PDEATHSIG(SIGKILL)`` -- die with the parent (nsjail).
3. Capability bounding set empty, and no effective/permitted/inheritable
   capabilities; any left over are dropped or the runtime refuses to continue.
4. The seccomp filters (:mod:`jaild.runtime.seccomp`), loaded last because they
   may forbid the calls above.

Everything happens before the first line of user code and before any other
thread exists, so every thread the code starts inherits the filters.

No other module imports ``prctl``: the zygote, the daemon and the self-test probe use
the typed functions at the end of this module.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

import prctl

from jaild.errors import HardeningFailed
from jaild.runtime import seccomp

_CAPS = tuple(zip(prctl.ALL_CAP_NAMES, prctl.ALL_CAPS, strict=True))
"""Every capability python-prctl knows, (name, number): the kernel's, up to CAP_LAST_CAP."""
_FLAGS = (
    ("effective/permitted", (prctl.CAP_EFFECTIVE, prctl.CAP_PERMITTED)),
    ("inheritable", (prctl.CAP_INHERITABLE,)),
)


def capabilities_left() -> list[str]:
    """Every capability this process still holds, as ``set:NAME`` (empty when none): the
    bounding set read per capability, the other three sets with one ``capget``."""
    left = [f"bounding:{name}" for name, cap in _CAPS if prctl.capbset_read(cap)]
    held = prctl.get_caps((prctl.ALL_CAPS, prctl.ALL_FLAGS))
    for label, flags in _FLAGS:
        left += [
            f"{label}:{name}" for name, cap in _CAPS if any(held[flag][cap] for flag in flags)
        ]
    return left


def harden(seccomp_spec: Mapping[str, Any]) -> str:
    """Apply and verify every hardening step; return the loaded filters' digest.

    Raises HardeningFailed: no user code may run then.
    """
    prctl.set_no_new_privs(1)
    prctl.set_pdeathsig(signal.SIGKILL)
    for name, cap in _CAPS:
        if prctl.capbset_read(cap):
            try:
                prctl.capbset_drop(cap)
            except OSError as exc:
                raise HardeningFailed(
                    f"cannot drop capability {name} from the bounding set: {exc}"
                ) from None
    if capabilities_left():
        try:
            prctl.cap_effective.limit()
            prctl.cap_permitted.limit()
            prctl.cap_inheritable.limit()
        except OSError:
            pass
    left = capabilities_left()
    if left:
        raise HardeningFailed(f"capabilities still present: {', '.join(left)}")
    if not no_new_privs():
        raise HardeningFailed("no_new_privs is not set")
    try:
        loaded = seccomp.load(seccomp_spec)
    except (OSError, ValueError) as exc:
        raise HardeningFailed(f"cannot load the seccomp filter: {exc}") from None
    if seccomp_mode() != 2:
        raise HardeningFailed("seccomp is not in filter mode after loading the filter")
    return loaded


def become_child_subreaper() -> None:
    """(Daemon side.) Orphaned descendants are reparented to us, not to init."""
    prctl.set_child_subreaper(1)


def die_with_parent(signal_number: int = signal.SIGKILL) -> None:
    """Have the kernel send ``signal_number`` to this process when its parent dies."""
    prctl.set_pdeathsig(signal_number)


def empty_bounding_set() -> None:
    """Drop every capability from the bounding set (needs CAP_SETPCAP).

    Raises:
        OSError: a capability could not be dropped.
    """
    for _name, cap in _CAPS:
        if prctl.capbset_read(cap):
            prctl.capbset_drop(cap)


def no_new_privs() -> bool:
    """Whether ``PR_SET_NO_NEW_PRIVS`` is set for this process."""
    return int(prctl.get_no_new_privs()) == 1


def seccomp_mode() -> int:
    """This process's seccomp mode: 0 off, 2 filter (python-prctl answers on/off; strict
    mode, 1, leaves no way to run Python)."""
    mode = prctl.get_seccomp()
    if isinstance(mode, bool):
        return 2 if mode else 0
    return int(mode)
