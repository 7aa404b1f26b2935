"""The one place jaild touches pyseccomp (libseccomp).

A *seccomp spec* is plain data, built by :mod:`jaild.policy.seccomp` in the
daemon and sent to the jail in the ``Harden`` message::

    {"filters": [
        {"default": "kill" | "errno" | "allow",
         "rules": [[syscall, action, [[arg, op, datum_a, datum_b], ...]], ...]},
        ...]}

Actions are ``"allow"``, ``"kill"`` (kill the whole process), ``"errno:<n>"``.
Several filters are loaded in order; the kernel runs them all and the
strictest verdict wins, which is how a masked *deny* rule (e.g. ioctl TIOCSTI,
whatever the upper 32 bits say) can sit beside an allow-list.

libseccomp adds the architecture check (a foreign or x32 syscall number kills
the process), which nsjail's kafel does not.

When a spec refuses ``sysinfo`` (every built-in profile does), :func:`load` also
replaces ``os.sysconf`` with a wrapper that raises ``PermissionError`` for
``SC_PHYS_PAGES`` and ``SC_AVPHYS_PAGES``: glibc answers those two from
``sysinfo()`` without checking its return value, so they would otherwise be
stack garbage. C code calling ``sysconf`` directly still gets the garbage.

``pyseccomp`` finds libseccomp with ``ctypes.util.find_library``, which shells
out to ``ldconfig`` -- slow, and impossible in a minimal jail. The import below
answers those two lookups with sonames directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno as errno_module
import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from jaild.errors import SeccompSpecError, Unsplittable
from jaild.runtime import zygote_filter

_SONAMES = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}


def _import_pyseccomp() -> Any:
    original = ctypes.util.find_library

    def find_library(name: str) -> str | None:
        return _SONAMES.get(name) or original(name)

    ctypes.util.find_library = find_library
    try:
        import pyseccomp
    finally:
        ctypes.util.find_library = original
    return pyseccomp


_sc = _import_pyseccomp()

_OPS = {
    "ne": _sc.NE,
    "lt": _sc.LT,
    "le": _sc.LE,
    "eq": _sc.EQ,
    "ge": _sc.GE,
    "gt": _sc.GT,
    "masked_eq": _sc.MASKED_EQ,
}
OPS = frozenset(_OPS)


def action_value(action: str) -> int:
    """Map a spec action string to libseccomp's action constant."""
    if action == "allow":
        return int(_sc.ALLOW)
    if action == "kill":
        return int(_sc.KILL_PROCESS)
    if action == "errno":
        return int(_sc.ERRNO(errno_module.EPERM))
    if action.startswith("errno:"):
        try:
            number = int(action[6:])
        except ValueError:
            raise SeccompSpecError(f"bad errno action {action!r}") from None
        if not 0 < number < 4096:
            raise SeccompSpecError(f"errno {number} out of range")
        return int(_sc.ERRNO(number))
    raise SeccompSpecError(f"unknown action {action!r}")


def syscall_number(name: str) -> int | None:
    """The native syscall number of ``name``, or None if this architecture has no such call."""
    try:
        number = _sc.resolve_syscall(_sc.system_arch(), name)
    except Exception:
        return None
    return int(number) if number >= 0 else None


def syscall_name(number: int) -> str | None:
    """The native name of syscall ``number``, or None."""
    try:
        raw = _sc.resolve_syscall(_sc.system_arch(), number)
    except Exception:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _build(filter_spec: Mapping[str, Any]) -> Any:
    default = filter_spec.get("default")
    rules = filter_spec.get("rules")
    if not isinstance(default, str) or not isinstance(rules, list):
        raise SeccompSpecError("a filter needs 'default' (str) and 'rules' (list)")
    default_action = action_value(default)
    f = _sc.SyscallFilter(default_action)
    f.set_attr(_sc.Attr.ACT_BADARCH, _sc.KILL_PROCESS)
    f.set_attr(_sc.Attr.CTL_OPTIMIZE, 2)
    for rule in rules:
        if not (isinstance(rule, list) and len(rule) == 3):
            raise SeccompSpecError(f"bad rule {rule!r}")
        name, action, conditions = rule
        if not isinstance(name, str) or not isinstance(conditions, list):
            raise SeccompSpecError(f"bad rule {rule!r}")
        if syscall_number(name) is None:
            raise SeccompSpecError(f"unknown syscall {name!r}")
        args = []
        for cond in conditions:
            if not (isinstance(cond, list) and len(cond) == 4 and cond[1] in _OPS):
                raise SeccompSpecError(f"bad condition {cond!r} on {name}")
            arg, op, datum_a, datum_b = cond
            args.append(_sc.Arg(int(arg), _OPS[op], int(datum_a), int(datum_b)))
        value = action_value(action)
        if value == default_action:
            continue  # libseccomp refuses rules that restate the default (EACCES)
        f.add_rule(value, name, *args)
    return f


def _filters(spec: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    filters = spec.get("filters")
    if not isinstance(filters, list) or not filters:
        raise SeccompSpecError("spec needs a non-empty 'filters' list")
    return filters


def _export(f: Any) -> bytes:
    with tempfile.TemporaryFile() as tmp:
        f.export_bpf(tmp)
        tmp.seek(0)
        return bytes(tmp.read())


def digest(programs: Sequence[bytes]) -> str:
    """A short fingerprint of BPF programs: what the daemon expects a jail to have loaded."""
    h = hashlib.sha256()
    for program in programs:
        h.update(len(program).to_bytes(8, "big") + program)
    return h.hexdigest()[:32]


class _Prepared(NamedTuple):
    """What :func:`prepare` built for a spec, so that a jail loading it does nothing more
    than the system calls: every object a jail reads of a zygote's is written to (its
    reference count) and so copied -- walking the spec's ~300 rules cost ~200 copied pages."""

    spec: Mapping[str, Any]
    programs: list[bytes]
    """The programs a jail loads for it."""
    inherited: list[bytes]
    """Those its zygote loaded already (empty unless the spec was split)."""
    digest: str
    """Of ``inherited`` then ``programs``: what the jail reports."""
    without_sysinfo: bool
    """:func:`refuses` ``sysinfo``."""
    loadables: list[Any]
    """``programs``, made ready for ``seccomp(2)`` (:class:`_Loadable`)."""


_prepared: _Prepared | None = None


def prepare(spec: Mapping[str, Any], *, split: bool = False) -> None:
    """Build ``spec``'s programs ahead of :func:`load` (the zygote does, once: building and
    exporting ~3 ms of libseccomp work that every jail it forks would otherwise repeat).

    ``split``: also load, into the calling process (the zygote), the spec's filters with
    what the zygote and its jails need let through, and leave each jail only the small
    filters that take that back (:mod:`jaild.runtime.zygote_filter`); a spec that cannot be
    split is prepared whole. Call it once: a second split would stack the zygote's filters.

    Raises:
        OSError: the zygote's filters could not be loaded.
    """
    global _prepared
    _seccomp_call()
    parts = None
    if split:
        if _prepared is not None and _prepared.inherited:
            raise OSError(errno_module.EEXIST, "the zygote's seccomp filters are loaded already")
        with contextlib.suppress(Unsplittable):
            parts = zygote_filter.split(spec)
    if parts is None:
        programs, inherited = [_export(_build(f)) for f in _filters(spec)], []
    else:
        inherited = [_export(_build(f)) for f in _filters(parts.zygote)]
        programs = [_export(_build(f)) for f in _filters(parts.jail)] if parts.jail else []
        for program in inherited:
            _install(program)
    _prepared = _Prepared(spec, programs, inherited, digest(inherited + programs),
                          refuses(spec, "sysinfo"), [_loadable(p) for p in programs])
    if _prepared.without_sysinfo:
        _sysconf_without_sysinfo()  # made here, once; a jail's os.sysconf is it


def forked_programs(spec: Mapping[str, Any]) -> list[bytes]:
    """The programs a forked jail holds for ``spec`` when its zygote split it: the zygote's
    then its own (what it reports the digest of), or ``spec``'s own if it cannot be split."""
    try:
        parts = zygote_filter.split(spec)
    except Unsplittable:
        return bpf_program(spec)
    jail = bpf_program(parts.jail) if parts.jail else []
    return bpf_program(parts.zygote) + jail


class _SockFprog(ctypes.Structure):
    """``struct sock_fprog``: a classic BPF program for ``seccomp(2)``."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_SECCOMP_SET_MODE_FILTER = 1


@functools.cache
def _seccomp_call() -> tuple[Any, int | None]:
    """libc's ``syscall`` and the native number of ``seccomp``: looked up once (in the
    zygote, by :func:`prepare`; its forks inherit them)."""
    return ctypes.CDLL(None, use_errno=True).syscall, syscall_number("seccomp")


class _Loadable(NamedTuple):
    """A program made ready for ``seccomp(2)``: its bytes in C memory, and the
    ``struct sock_fprog`` pointing at them."""

    buffer: Any
    fprog_ref: Any


def _loadable(program: bytes) -> _Loadable:
    """Raises OSError: the kernel would refuse the program's length."""
    if len(program) % 8 or not 0 < len(program) // 8 <= 0xFFFF:
        raise OSError(errno_module.EINVAL, "cannot load this seccomp program")
    buffer = ctypes.create_string_buffer(program, len(program))
    return _Loadable(buffer, ctypes.byref(_SockFprog(len(program) // 8,
                                                     ctypes.addressof(buffer))))


def _install(program: bytes | _Loadable) -> None:
    """``seccomp(SECCOMP_SET_MODE_FILTER, 0, program)``: what libseccomp's load does once it
    has generated the program (no_new_privs is set first by the caller), without
    generating it again. Raises OSError."""
    syscall, number = _seccomp_call()
    if number is None:
        raise OSError(errno_module.EINVAL, "no seccomp(2) on this architecture")
    loadable = program if isinstance(program, _Loadable) else _loadable(program)
    if syscall(number, _SECCOMP_SET_MODE_FILTER, 0, loadable.fprog_ref) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"seccomp(SECCOMP_SET_MODE_FILTER): {os.strerror(code)}")


def load(spec: Mapping[str, Any]) -> str:
    """Load every filter of ``spec`` into the calling process, in order.

    Returns the digest of the BPF programs the process holds (see :func:`digest`): the
    very bytes the kernel was given, its zygote's first where it split the spec
    (:func:`prepare`). Call with no_new_privs set and before any other thread exists
    (filters are inherited by threads created later). The programs of :func:`prepare`
    for an equal spec are loaded as they are (libseccomp's own load would generate each
    program again: half of a jail's ~1 ms of loading, measured in forked children).
    """
    prepared = _prepared
    if prepared is not None and (prepared.spec is spec or prepared.spec == spec):
        for loadable in prepared.loadables:
            _install(loadable)
        return prepared.digest
    inherited = prepared.inherited if prepared is not None else []  # a zygote's hold anyway
    programs = [_export(_build(f)) for f in _filters(spec)]
    for program in programs:
        _install(program)
    if refuses(spec, "sysinfo"):
        _sysconf_without_sysinfo()
    elif os.sysconf is not _original_sysconf:
        os.sysconf = _original_sysconf  # the zygote's spec refused it; this one does not
    return digest(inherited + programs)


def refuses(spec: Mapping[str, Any], name: str) -> bool:
    """Whether any filter of ``spec`` refuses ``name`` whatever its arguments (a rule for it
    whose action is not allow, or no rule and a default that is not allow)."""
    for fspec in _filters(spec):
        actions = [rule[1] for rule in fspec.get("rules", []) if rule and rule[0] == name]
        if any(action != "allow" for action in actions):
            return True
        if not actions and fspec.get("default") != "allow":
            return True
    return False


_SYSINFO_NAMES = ("SC_PHYS_PAGES", "SC_AVPHYS_PAGES")
_original_sysconf = os.sysconf


def _sysconf_without_sysinfo() -> None:
    """Make ``os.sysconf`` refuse what glibc computes from ``sysinfo()`` (see the header)."""
    original: Callable[[str | int], int] = os.sysconf
    if getattr(original, "jaild_without_sysinfo", False):
        return
    refused = {os.sysconf_names[n] for n in _SYSINFO_NAMES if n in os.sysconf_names}

    @functools.wraps(original)
    def sysconf(name: str | int) -> int:
        number = os.sysconf_names.get(name, -1) if isinstance(name, str) else name
        if number in refused:
            raise PermissionError(
                errno_module.EPERM, "sysinfo() is denied in this jail (seccomp.allow re-opens it)"
            )
        return original(name)

    sysconf.jaild_without_sysinfo = True  # type: ignore[attr-defined]
    os.sysconf = sysconf


def explain(spec: Mapping[str, Any]) -> str:
    """libseccomp's pseudo-filter-code for every filter of ``spec`` (for ``policy explain``)."""
    parts = []
    for i, fspec in enumerate(_filters(spec)):
        with tempfile.TemporaryFile() as tmp:
            _build(fspec).export_pfc(tmp)
            tmp.seek(0)
            text = tmp.read().decode()
        parts.append(f"# ---- filter {i + 1} of {len(_filters(spec))}\n{text}")
    return "\n".join(parts)


def bpf_program(spec: Mapping[str, Any]) -> list[bytes]:
    """The raw BPF program of each filter (the daemon digests them; tests read them)."""
    return [_export(_build(fspec)) for fspec in _filters(spec)]
