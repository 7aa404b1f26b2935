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
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

import prctl

from jaild.errors import HardeningFailed
from jaild.runtime import seccomp


def _has_any_capability() -> list[str]:
    left = []
    for name in prctl.ALL_CAP_NAMES:
        if getattr(prctl.capbset, name):
            left.append(f"bounding:{name}")
        if getattr(prctl.cap_effective, name) or getattr(prctl.cap_permitted, name):
            left.append(f"effective/permitted:{name}")
        if getattr(prctl.cap_inheritable, name):
            left.append(f"inheritable:{name}")
    return left


def harden(seccomp_spec: Mapping[str, Any]) -> str:
    """Apply and verify every hardening step; return the loaded filters' digest.

    Raises HardeningFailed: no user code may run then.
    """
    prctl.set_no_new_privs(1)
    prctl.set_pdeathsig(signal.SIGKILL)
    for name in prctl.ALL_CAP_NAMES:
        if getattr(prctl.capbset, name):
            try:
                prctl.capbset.drop(name)
            except OSError as exc:
                raise HardeningFailed(
                    f"cannot drop capability {name} from the bounding set: {exc}"
                ) from None
    if _has_any_capability():
        try:
            prctl.cap_effective.limit()
            prctl.cap_permitted.limit()
            prctl.cap_inheritable.limit()
        except OSError:
            pass
    left = _has_any_capability()
    if left:
        raise HardeningFailed(f"capabilities still present: {', '.join(left)}")
    if prctl.get_no_new_privs() != 1:
        raise HardeningFailed("no_new_privs is not set")
    try:
        loaded = seccomp.load(seccomp_spec)
    except (OSError, ValueError) as exc:
        raise HardeningFailed(f"cannot load the seccomp filter: {exc}") from None
    if prctl.get_seccomp() not in (2, True):
        raise HardeningFailed("seccomp is not in filter mode after loading the filter")
    return loaded


def become_child_subreaper() -> None:
    """(Daemon side.) Orphaned descendants are reparented to us, not to init."""
    prctl.set_child_subreaper(1)
