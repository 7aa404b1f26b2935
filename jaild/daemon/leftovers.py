"""What a jaild instance that is gone left behind, for ``jaild doctor`` to name and remove.

Theory of operation
-------------------
An instance (``DaemonConfig.instance``: ``jaild`` for the default socket, else
``jaild-<10 hex digits of the socket path's sha256>``) leaves two kinds of things on the host
when it dies without stopping (``kill -9``, the OOM killer, a power cut of its container):

* its cgroup subtree, named for the instance (or ``cgroup_subtree``), in each v1 hierarchy
  or in its v2 base (:mod:`jaild.daemon.jails.cgroups`), with a cgroup per job, session,
  warm jail and zygote, and any of their processes still alive;
* the work directories of its nsjails, ``/tmp/nsjail.<uid>.root`` and ``.tmp``, for uids of
  its block (:mod:`jaild.daemon.jails.launch.spawned`).

A daemon that stops removes both; the next daemon *on the same socket* sweeps them at its
start. Until then nothing else does. Other per-instance state is kept on purpose and is not
a leftover: snapshots and parked runs (``<state_dir>/snapshots|parked/<instance>``) outlive
restarts, the uid block's lock file is never removed (:mod:`jaild.daemon.uidblock`), and a
stale socket file is removed by the next daemon on that path.

Gone or running: every instance holds a ``flock`` on its uid block's lock file
(``/run/jaild/uid-blocks/<uid_base>.lock``, the block picked by hashing the instance's name,
:func:`jaild.daemon.config.instance_uid_base`) from *before* it makes its subtree until
*after* it has removed it, and the kernel drops the lock when the process dies however it
dies. So a subtree or work directory whose instance's lock is not held is a dead instance's.
Finding reads ``/proc/locks`` and takes nothing: a daemon starting meanwhile is never
refused. Cleaning (``jaild doctor --clean``) takes the lock itself, exclusively and without
waiting, for as long as it removes that instance's things: a live daemon holds it, so its
trees are never touched, and a daemon that starts meanwhile is refused, naming this command,
rather than having its fresh subtree removed under it. An instance whose lock file does not
exist here (its claims are in another ``/run/jaild``: a container's) is not judged, and
neither is one whose lock ``/proc/locks`` cannot show (a holder in another pid namespace is
listed by no line): run the doctor in the daemons' pid namespace.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import stat
from dataclasses import dataclass
from typing import Literal

from jaild.daemon.config import JAIL_UID_BASE, DaemonConfig, instance_uid_base
from jaild.daemon.jails.cgroups import _kill_members, _rmtree_cgroup
from jaild.daemon.selftest import UID_BLOCK, Check
from jaild.daemon.uidblock import LOCK_DIR, flock_holders, lock_path

INSTANCE_NAME = re.compile(r"jaild(-[0-9a-f]{10})?")
"""A cgroup directory of this name is an instance's subtree (``DaemonConfig.instance``)."""

WORKDIR = re.compile(r"nsjail\.(\d+)\.(root|tmp)")
"""An nsjail's work directory in /tmp, by uid."""

BLOCKS = 4096
"""Uid blocks from ``JAIL_UID_BASE``: the default one and 4,095 picked by hash."""


@dataclass(frozen=True)
class Leftover:
    """One thing a gone instance left: a cgroup directory (``path``, with ``processes``
    still in it) or an nsjail work directory."""

    instance: str  # the instance's name, or "uid block N.." for a work directory
    kind: Literal["cgroup", "workdir"]
    path: str
    uid_base: int
    last_claimant: str  # who last held the instance's uid block: "socket S, pid P", or ""
    processes: int = 0

    @property
    def command(self) -> str:
        """A shell command that removes it (as root): a cgroup tree is emptied of its
        processes and removed bottom-up (cgroupfs takes ``rmdir``, not ``rm``)."""
        path = shlex.quote(self.path)
        if self.kind == "workdir":
            return f"rmdir {path}"
        return (f"find {path} -name cgroup.procs -exec cat {{}} + | xargs -r kill -KILL; "
                f"find {path} -depth -type d -exec rmdir {{}} +")


def cgroup_mounts(mountinfo: str) -> list[str]:
    """The mount points of every cgroup (v1) and cgroup2 hierarchy in ``mountinfo``."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        with contextlib.suppress(ValueError, IndexError):
            if fields[fields.index("-") + 1] in ("cgroup", "cgroup2") and fields[4] not in points:
                points.append(fields[4])
    return points


def subtree_dirs(mounts: list[str], names: dict[str, str]) -> list[tuple[str, str]]:
    """``(instance, directory)`` of every cgroup directory below ``mounts`` that is an
    instance's subtree: named like an instance, or one of ``names`` (a subtree name ->
    its instance: a config's ``cgroup_subtree``). Not descended into."""
    found = []
    for mount in mounts:
        for root, dirs, _files in os.walk(mount):
            keep = []
            for d in sorted(dirs):
                if d in names:
                    found.append((names[d], os.path.join(root, d)))
                elif INSTANCE_NAME.fullmatch(d):
                    found.append((d, os.path.join(root, d)))
                else:
                    keep.append(d)
            dirs[:] = keep
    return found


def _processes(directory: str) -> int:
    count = 0
    for root, _dirs, _files in os.walk(directory):
        with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.procs")) as f:
            count += len(f.read().split())
    return count


def _block_base(uid: int) -> int | None:
    """The first uid of the jail uid block ``uid`` is in, or None if it is in none."""
    if not JAIL_UID_BASE <= uid < JAIL_UID_BASE + BLOCKS * UID_BLOCK:
        return None
    return JAIL_UID_BASE + (uid - JAIL_UID_BASE) // UID_BLOCK * UID_BLOCK


def _workdir_of(path: str, uid: int) -> bool:
    """Is ``path`` a directory of ``uid`` (an nsjail's; not whatever else /tmp holds by
    that name)?"""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def _claim_state(base: int, lock_dir: str, locks: str) -> tuple[bool, str] | None:
    """``(held, last claimant)`` of the uid block from ``base``; None if it has no lock file
    here (never claimed in this directory: not judged)."""
    path = lock_path(base, lock_dir)
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            record = f.read(4096)
    except OSError:
        return None
    held = bool(flock_holders(locks, st.st_dev, st.st_ino))
    claimant = ""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        fields = json.loads(record)
        claimant = f"socket {fields['socket']}, pid {int(fields['pid'])}"
    return held, claimant


def find_leftovers(
    config: DaemonConfig | None = None,
    *,
    mountinfo: str | None = None,
    lock_dir: str = LOCK_DIR,
    locks: str | None = None,
    tmp: str = "/tmp",
) -> list[Leftover]:
    """Every cgroup subtree and nsjail work directory on this host whose instance is gone
    (see the module docstring); touches nothing.

    Args:
        config: the doctor's config: its ``cgroup_subtree``, if set, is looked for too.
        mountinfo, locks: the text of ``/proc/self/mountinfo`` and ``/proc/locks`` (tests).
        lock_dir: where instances claim their uid blocks.
        tmp: where nsjail makes its work directories.
    """
    if mountinfo is None:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            mountinfo = f.read()
    if locks is None:
        with open("/proc/locks", encoding="utf-8", errors="replace") as f:
            locks = f.read()
    names = {}
    if config is not None and config.cgroup_subtree:
        names[config.cgroup_subtree] = config.instance
    states: dict[int, tuple[bool, str] | None] = {}

    def gone(base: int) -> tuple[bool, str]:
        if base not in states:
            states[base] = _claim_state(base, lock_dir, locks)
        state = states[base]
        return (state is not None and not state[0]), (state[1] if state else "")

    found = []
    for instance, directory in subtree_dirs(cgroup_mounts(mountinfo), names):
        base = instance_uid_base(instance)
        dead, claimant = gone(base)
        if dead:
            found.append(Leftover(instance, "cgroup", directory, base, claimant,
                                  _processes(directory)))
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(tmp)):
            match = WORKDIR.fullmatch(name)
            uid = int(match.group(1)) if match else -1
            block = _block_base(uid)
            if block is None or not _workdir_of(os.path.join(tmp, name), uid):
                continue
            dead, claimant = gone(block)
            if dead:
                found.append(Leftover(f"uid block {block}..{block + UID_BLOCK - 1}", "workdir",
                                      os.path.join(tmp, name), block, claimant))
    return found


def clean(leftovers: list[Leftover], lock_dir: str = LOCK_DIR) -> dict[str, str]:
    """Remove ``leftovers``, each instance's under its uid block's lock (taken without
    waiting, so never while its daemon runs or starts: see the module docstring). Returns
    the paths not removed, each with why."""
    failed: dict[str, str] = {}
    for base in sorted({item.uid_base for item in leftovers}):
        mine = [item for item in leftovers if item.uid_base == base]
        try:
            fd = os.open(lock_path(base, lock_dir), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            failed.update({item.path: f"cannot open its uid block's lock: {exc.strerror}"
                           for item in mine})
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                failed.update({item.path: "its instance is running again (its uid block is "
                               "claimed): left to it" for item in mine})
                continue
            for item in mine:
                try:
                    if item.kind == "cgroup":
                        _kill_members(item.path)
                        _rmtree_cgroup(item.path)
                    else:
                        os.rmdir(item.path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failed[item.path] = exc.strerror or str(exc)
        finally:
            os.close(fd)  # the lock goes with it
    return failed


def leftover_checks(leftovers: list[Leftover], failed: dict[str, str] | None = None) -> list[Check]:
    """The doctor's rows: one per leftover, naming it and the command that removes it -- a
    warning (it holds nothing but a directory), or a failed check when processes still run
    in it; after ``--clean`` (``failed``: :func:`clean`'s answer) the removed ones
    pass. None found: one passing row."""
    if not leftovers:
        return [Check("leftovers of gone instances", True,
                      "no cgroup tree or jail work directory of a jaild instance that is gone")]
    checks = []
    for item in leftovers:
        what = "cgroup tree" if item.kind == "cgroup" else "jail work directory"
        whose = f"{item.instance}, gone" + (f" (last: {item.last_claimant})"
                                           if item.last_claimant else "")
        held = f"; {item.processes} process(es) still in it" if item.processes else ""
        if failed is not None and item.path not in failed:
            checks.append(Check(f"leftover {what}", True, f"removed {item.path} ({whose})"))
            continue
        why = f"; not removed: {failed[item.path]}" if failed else ""
        # a warning unless processes of the gone instance still run in it
        checks.append(Check(f"leftover {what}", False, f"{item.path} ({whose}{held}){why}",
                            f"{item.command}   (or: jaild doctor --clean)",
                            warn=not item.processes))
    return checks
