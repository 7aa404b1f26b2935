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

import ctypes
import os
import signal
from collections.abc import Mapping
from typing import Any

import prctl

from jaild.errors import HardeningFailed
from jaild.runtime import seccomp

_CAPS = tuple(zip(prctl.ALL_CAP_NAMES, prctl.ALL_CAPS, strict=True))
"""Every capability python-prctl knows, (name, number): the kernel's, up to CAP_LAST_CAP."""
_NAMES = {cap: name for name, cap in _CAPS}
_call = prctl._prctl.prctl  # python-prctl's C module: its calls without its Python wrappers
_CAPBSET_READ, _CAPBSET_DROP = prctl._prctl.PR_CAPBSET_READ, prctl._prctl.PR_CAPBSET_DROP
"""The bounding set is read and dropped per capability, 41 calls each: through python-prctl's
wrappers (a closure comparing its arguments with None) each wrote pages of the zygote's."""


class _CapHeader(ctypes.Structure):
    """``struct __user_cap_header_struct``."""

    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    """``struct __user_cap_data_struct`` (two of them: capabilities 0-31, 32-63)."""

    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_capget = ctypes.CDLL(None, use_errno=True).capget
_header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
_data = (_CapData * 2)()
_header_ref, _data_ref = ctypes.byref(_header), ctypes.byref(_data)
"""Made once (in a zygote, before its forks): a jail reads its sets into them, touching
nothing else (python-prctl's ``get_caps`` builds a dict per set, ~80 pages copied from the
zygote and 0.4 ms a jail)."""


def _held() -> tuple[list[int], int, int]:
    """(capabilities in the bounding set, effective|permitted, inheritable): the bounding set
    read per capability, the other three sets with one ``capget``.

    Raises:
        HardeningFailed: ``capget`` failed.
    """
    bounding = [cap for _name, cap in _CAPS if _call(_CAPBSET_READ, cap)]
    if _capget(_header_ref, _data_ref) != 0:
        raise HardeningFailed(f"capget: {os.strerror(ctypes.get_errno())}")
    low, high = _data
    active = (low.effective | low.permitted) | (high.effective | high.permitted) << 32
    return bounding, active, low.inheritable | high.inheritable << 32


def capabilities_left() -> list[str]:
    """Every capability this process still holds, as ``set:NAME`` (empty when none)."""
    bounding, active, inheritable = _held()
    held = set(bounding)
    left = [f"bounding:{name}" for name, cap in _CAPS if cap in held]
    left += [f"effective/permitted:{name}" for name, cap in _CAPS if active >> cap & 1]
    left += [f"inheritable:{name}" for name, cap in _CAPS if inheritable >> cap & 1]
    return left


def harden(seccomp_spec: Mapping[str, Any]) -> str:
    """Apply and verify every hardening step; return the loaded filters' digest.

    Raises HardeningFailed: no user code may run then.
    """
    prctl.set_no_new_privs(1)
    prctl.set_pdeathsig(signal.SIGKILL)
    bounding, active, inheritable = _held()  # a zygote's jail: none (it dropped them)
    for cap in bounding:
        try:
            _call(_CAPBSET_DROP, cap)
        except OSError as exc:
            raise HardeningFailed(
                f"cannot drop capability {_NAMES[cap]} from the bounding set: {exc}"
            ) from None
    if bounding or active or inheritable:
        left = capabilities_left()
        if left:
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
        if _call(_CAPBSET_READ, cap):
            _call(_CAPBSET_DROP, cap)


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
