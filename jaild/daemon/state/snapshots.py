"""The daemon's snapshot store: opaque bytes on disk, each owned by one principal.

Theory of operation
-------------------
A snapshot is what a session's jail answered when asked for its state
(:mod:`jaild.runtime.snapshot`): the jail's output, so hostile input to anything that
reads it. The daemon never parses it -- it stores the bytes, their size and digest, and
hands them whole to a fresh jail to restore -- so nothing on the host unpickles, unpacks
or follows anything a jail wrote.

On disk, under ``<state_dir>/snapshots`` (0700, root's)::

    <owner>/<id>.snap     the bytes, 0600
    <owner>/<id>.json     its entry (SnapshotEntry) and the owner's key, 0600

``<owner>`` is a digest of the principal's key and ``<id>`` is made here
(``snap-`` and 32 hex digits): no name on disk comes from a client or a jail. Files are
written to a temporary name (``O_EXCL | O_NOFOLLOW``), synced and renamed into place, the
entry last: a snapshot whose entry exists is whole, whatever moment the daemon died at.
Every file is opened ``O_NOFOLLOW``; a path that is not what the store made is refused.

Each principal sees only its own snapshots: a lookup names the owner, and another
principal's id is answered exactly as an unknown one (:class:`~jaild.errors.UnknownSnapshot`).
Snapshots count against the principal's quota (bytes and count); each has a TTL
(``expires``) after which :meth:`SnapshotStore.sweep` (at start, and on every save)
deletes it. A paused session's state is a snapshot of ``kind = "pause"``
(:class:`~jaild.protocol.records.SnapshotKind`); it is deleted when the session resumes or
ends, and at start (its session did not survive the daemon). A session's state before a run
parked for approval is of ``kind = "parked"``: it stays until that run ends or is dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

from jaild.daemon.core.peer import Tenant
from jaild.errors import QuotaExceeded, UnknownSnapshot
from jaild.protocol.records import SnapshotEntry, SnapshotKind

log = logging.getLogger("jaild")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(16)


def _owner_dir(owner: Tenant) -> str:
    return hashlib.sha256(f"{type(owner).__name__}:{owner}".encode()).hexdigest()[:32]


def _is_id(name: str) -> bool:
    return (len(name) == 37 and name.startswith("snap-")
            and all(c in "0123456789abcdef" for c in name[5:]))


@dataclass(frozen=True)
class Usage:
    count: int
    bytes: int


class SnapshotStore:
    """See the module docstring. ``quota_bytes`` / ``max_count``: per principal;
    ``total_bytes``: the whole store's (0: none), so that many principals -- a network
    principal is as cheap as a certificate -- cannot fill the disk between them."""

    def __init__(self, root: str, quota_bytes: int, max_count: int,
                 clock: Callable[[], float] = time.time, *, total_bytes: int = 0) -> None:
        self.root = root
        self.quota_bytes = quota_bytes
        self.max_count = max_count
        self.total_bytes = total_bytes
        self._clock = clock
        os.makedirs(root, mode=0o700, exist_ok=True)
        self._check_dir(root)
        os.chmod(root, 0o700)

    # -- public

    def save(self, owner: Tenant, blob: bytes, *, policy: str, session: str, ttl_s: float,
             kind: SnapshotKind | str = SnapshotKind.SNAPSHOT,
             labels: Iterable[str] = ()) -> SnapshotEntry:
        """Keep ``blob`` for ``owner`` (``labels``: its session's information-flow labels,
        which a session restored from it starts with).

        Raises:
            QuotaExceeded: it would take the owner past its quota of bytes or snapshots.
            ValueError: ``kind`` is not a :class:`SnapshotKind`'s word.
        """
        self.sweep()
        usage = self.usage(owner)
        if usage.count + 1 > self.max_count:
            raise QuotaExceeded(
                f"{usage.count} snapshots kept; the daemon keeps at most {self.max_count} per "
                "principal (snapshot_max_count): delete one (jaild snapshots rm ID)")
        if usage.bytes + len(blob) > self.quota_bytes:
            raise QuotaExceeded(
                f"this snapshot is {len(blob)} bytes and the principal's snapshots hold "
                f"{usage.bytes}; the quota is {self.quota_bytes} bytes (snapshot_quota_mb)")
        if self.total_bytes and self.total() + len(blob) > self.total_bytes:
            # how full, and with whose, is the others' business: only that it is
            raise QuotaExceeded(
                f"this snapshot is {len(blob)} bytes and the daemon's snapshot store has no "
                "room for it (snapshot_total_quota_mb, every principal's together): delete "
                "one of yours, or wait for others' to expire")
        now = self._clock()
        entry = SnapshotEntry(
            id=new_snapshot_id(), policy=policy, bytes=len(blob), created=now,
            expires=now + ttl_s, session=session, kind=SnapshotKind(kind),
            sha256=hashlib.sha256(blob).hexdigest(), labels=tuple(sorted(labels)),
        )
        directory = os.path.join(self.root, _owner_dir(owner))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._check_dir(directory)
        self._write(directory, f"{entry.id}.snap", blob)
        meta = {"owner": owner, "entry": entry.to_wire()}
        self._write(directory, f"{entry.id}.json", json.dumps(meta).encode())
        return entry

    def entry(self, owner: Tenant, snapshot_id: str) -> SnapshotEntry:
        """``owner``'s snapshot of that id (an expired one is gone).

        Raises:
            UnknownSnapshot: none of ``owner``'s has that id.
        """
        found = self._entry(os.path.join(self.root, _owner_dir(owner)), snapshot_id, owner)
        if found is None or found.expires <= self._clock():
            raise UnknownSnapshot(f"no snapshot {snapshot_id} of yours")
        return found

    def load(self, owner: Tenant, snapshot_id: str) -> tuple[SnapshotEntry, bytes]:
        """The entry and the bytes (checked against the digest the entry recorded).

        Raises:
            UnknownSnapshot: as :meth:`entry`, or its bytes are not what was saved.
        """
        entry = self.entry(owner, snapshot_id)
        path = os.path.join(self.root, _owner_dir(owner), f"{snapshot_id}.snap")
        try:
            blob = self._read(path, entry.bytes + 1)
        except OSError as exc:
            raise UnknownSnapshot(f"snapshot {snapshot_id} cannot be read: {exc.strerror}") \
                from None
        if len(blob) != entry.bytes or hashlib.sha256(blob).hexdigest() != entry.sha256:
            self._remove(os.path.join(self.root, _owner_dir(owner)), snapshot_id)
            raise UnknownSnapshot(f"snapshot {snapshot_id} is damaged on disk; deleted")
        return entry, blob

    def entries(self, owner: Tenant) -> list[SnapshotEntry]:
        """``owner``'s snapshots, oldest first."""
        directory = os.path.join(self.root, _owner_dir(owner))
        now = self._clock()
        out = [e for e in self._entries(directory, owner) if e.expires > now]
        return sorted(out, key=lambda e: e.created)

    def delete(self, owner: Tenant, snapshot_id: str) -> None:
        """Raises UnknownSnapshot as :meth:`entry`."""
        self.entry(owner, snapshot_id)
        self._remove(os.path.join(self.root, _owner_dir(owner)), snapshot_id)

    def total(self) -> int:
        """The bytes every principal's unexpired snapshots and paused sessions hold."""
        now = self._clock()
        return sum(e.bytes for directory in self._owner_dirs()
                   for e in self._entries(directory, None) if e.expires > now)

    def usage(self, owner: Tenant) -> Usage:
        kept = list(self._entries(os.path.join(self.root, _owner_dir(owner)), owner))
        return Usage(len(kept), sum(e.bytes for e in kept))

    def sweep(self, pauses_too: bool = False, keep: Collection[str] = ()) -> int:
        """Delete expired snapshots (and, with ``pauses_too``, every paused session's state
        and every parked run's not in ``keep``: at start), half-written files and anything
        else the store did not make. Returns how many snapshots went."""
        gone = 0
        now = self._clock()
        for directory in self._owner_dirs():
            names = set(os.listdir(directory))
            for name in names:
                stem, _, ext = name.partition(".")
                if not (_is_id(stem) and ext in ("snap", "json")):
                    self._unlink(directory, name)  # a temporary left by a crash, or a stray
                elif ext == "snap" and f"{stem}.json" not in names:
                    self._unlink(directory, name)  # its entry was never written
            for entry in self._entries(directory, None):
                stale = entry.kind is SnapshotKind.PAUSE or (
                    entry.kind is SnapshotKind.PARKED and entry.id not in keep)
                if entry.expires <= now or (pauses_too and stale):
                    self._remove(directory, entry.id)
                    gone += 1
        return gone

    # -- internals

    def _owner_dirs(self) -> Iterator[str]:
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                yield path

    def _entries(self, directory: str, owner: Tenant | None) -> Iterator[SnapshotEntry]:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return
        for name in sorted(names):
            stem, _, ext = name.partition(".")
            if ext == "json" and _is_id(stem):
                entry = self._entry(directory, stem, owner)
                if entry is not None:
                    yield entry

    def _entry(self, directory: str, snapshot_id: str, owner: Tenant | None
               ) -> SnapshotEntry | None:
        if not _is_id(snapshot_id):
            return None
        try:
            meta = json.loads(self._read(os.path.join(directory, f"{snapshot_id}.json"), 1 << 16))
            if owner is not None and meta["owner"] != owner:
                return None
            entry = SnapshotEntry.from_wire(meta["entry"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("snapshot entry %s/%s unreadable (%s); deleting it", directory,
                        snapshot_id, exc)
            self._remove(directory, snapshot_id)
            return None
        return entry if entry.id == snapshot_id else None

    def _check_dir(self, path: str) -> None:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise RuntimeError(f"{path} must be a directory of the daemon's own, not a link")

    def _write(self, directory: str, name: str, data: bytes) -> None:
        dir_fd = os.open(directory, _DIR_FLAGS)
        temp = f".{name}.{secrets.token_hex(4)}"
        try:
            fd = os.open(temp, _CREATE, 0o600, dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        finally:
            os.close(dir_fd)

    @staticmethod
    def _read(path: str, limit: int) -> bytes:
        fd = os.open(path, _READ)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(0, "not a regular file")
            chunks = []
            left = limit
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _remove(self, directory: str, snapshot_id: str) -> None:
        self._unlink(directory, f"{snapshot_id}.json")  # the entry first: then it is gone
        self._unlink(directory, f"{snapshot_id}.snap")

    @staticmethod
    def _unlink(directory: str, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


__all__ = ["SnapshotStore", "Usage", "new_snapshot_id"]
