"""Durable runs' journals on disk, and the quotas per principal on parked runs and journals.

Theory of operation
-------------------
A run under a policy with ``[approvals] park_after_s`` journals every tool reply
(:mod:`jaild.daemon.approvals`): a continuation replays the run and answers its earlier calls
from the journal. The journal lives on disk, not in the daemon's memory: what the daemon
holds of one is its path, its count of entries and its size (:class:`Journal`), whatever the
number of calls.

The file is ``<state_dir>/parked/<instance>/<job id>.journal`` (the directory is the
daemon's, 0700; the file 0600, opened ``O_NOFOLLOW``; its name is made by the daemon, never
by a client or a jail). It is a stream of msgpack arrays, one per reply, appended as replies
arrive::

    [tool name (str), packed arguments (bin), ok (bool),
     value (ok: the packed value, bin; else [error type, message]), labels ([str])]

An append that fails part-way is cut back to the size before it, so the file always ends on
an entry. Nothing is synced while the run is live (a crash then loses the run, as it loses
any running job); when the run parks, the file is synced before the run's own file
(``<job id>.run``) is written, and the run's file records the journal's entries and bytes.
At start a journal is checked against that record: longer (a reply that came after the
record, while the decided call ran) is cut back to it; shorter, or not decoding, is
:class:`~jaild.errors.JournalDamaged` and the run is dropped (logged). A replay reads the
entries one at a time from an offset, so a continuation holds one entry at a time.

Quotas (:class:`ApprovalQuota`, the daemon's ``limits.approvals_parked_max_count`` and
``limits.approvals_journal_quota_mb``) are per principal (the tenant key, as the snapshot
store's): how many of its runs may be parked at once, and how many bytes its runs' journals
(live and parked) may hold together. Past the first, a run that would park is refused
parking; past the second, the run whose reply would not fit is stopped. Both raise
:class:`~jaild.errors.QuotaExceeded` naming the key, the principal's use and the limit.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from jaild.daemon.core.peer import Tenant
from jaild.errors import JournalDamaged, QuotaExceeded

_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_ENTRY_BYTES = 1 << 31  # far above any one reply (the policy's tool_payload_bytes)


@dataclass
class Journaled:
    """One call's reply, as the tool host gave it (or the daemon decided it)."""

    name: str
    args: bytes
    ok: bool
    value: Any  # ok: the packed value (bytes); else [error type, message]
    labels: tuple[str, ...] = ()  # the reply's own (the replay gives them again)

    def pack(self) -> bytes:
        packed: bytes = msgpack.packb(
            [self.name, self.args, self.ok, self.value, list(self.labels)], use_bin_type=True)
        return packed

    @classmethod
    def of(cls, data: Any) -> Journaled | None:
        """An entry as unpacked, or None when it is not one's shape."""
        if not isinstance(data, list) or len(data) != 5:
            return None
        name, args, ok, value, labels = data
        if not isinstance(name, str) or not isinstance(args, bytes) or not isinstance(ok, bool):
            return None
        if ok and not isinstance(value, bytes):
            return None
        if not ok and not (isinstance(value, list) and len(value) == 2
                           and all(isinstance(v, str) for v in value)):
            return None
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            return None
        return cls(name, args, ok, value, tuple(labels))


class Journal:
    """One run's journal: its file, its count of entries and its size (see the module)."""

    def __init__(self, path: str, entries: int = 0, size: int = 0) -> None:
        self.path = path
        self.entries = entries
        self.bytes = size

    def __repr__(self) -> str:
        return f"Journal({self.path!r}, entries={self.entries}, bytes={self.bytes})"

    def __len__(self) -> int:
        return self.entries

    def append(self, entry: Journaled) -> int:
        """Write ``entry`` at the end; the bytes it took.

        Raises:
            OSError: it could not be written (the file is cut back to its size before).
        """
        data = entry.pack()
        fd = os.open(self.path, _APPEND, 0o600)
        try:
            written = 0
            try:
                while written < len(data):
                    written += os.write(fd, data[written:])
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self.bytes)
                raise
        finally:
            os.close(fd)
        self.entries += 1
        self.bytes += len(data)
        return len(data)

    def sync(self) -> None:
        """Make what was appended durable (before the run's own file names it)."""
        if self.entries == 0:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, offset: int) -> tuple[Journaled, int]:
        """The entry at byte ``offset`` and the offset of the next.

        Raises:
            JournalDamaged: the file ends inside it, or it is not an entry.
        """
        if offset >= self.bytes:
            raise JournalDamaged(f"journal {self.path}: no entry at byte {offset} (it holds "
                                 f"{self.bytes} bytes)")
        try:
            fd = os.open(self.path, _READ)
        except OSError as exc:
            raise JournalDamaged(f"journal {self.path} cannot be read: {exc.strerror}") \
                from None
        with os.fdopen(fd, "rb") as f:
            f.seek(offset)
            unpacker = _unpacker(f, self.bytes - offset)
            found = _next(unpacker, self.path, offset)
            return found, offset + unpacker.tell()

    def __iter__(self) -> Iterator[Journaled]:
        """Every entry, first to last (read as it goes)."""
        offset = 0
        while offset < self.bytes:
            entry, offset = self.read(offset)
            yield entry

    def check(self) -> None:
        """At start: the file is the journal its run's file recorded (``entries`` entries in
        ``bytes`` bytes); longer, it is cut back to that.

        Raises:
            JournalDamaged: shorter, or bytes that are not entries, or another count.
        """
        if self.entries == 0 and self.bytes == 0:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise JournalDamaged(f"journal {self.path} cannot be read: {exc.strerror}") \
                from None
        with os.fdopen(fd, "r+b") as f:
            size = os.fstat(fd).st_size
            if size < self.bytes:
                raise JournalDamaged(f"journal {self.path} is cut short: {size} bytes of the "
                                     f"{self.bytes} its run recorded")
            if size > self.bytes:
                f.truncate(self.bytes)
            unpacker = _unpacker(f, self.bytes)
            count = 0
            while unpacker.tell() < self.bytes:
                _next(unpacker, self.path, unpacker.tell())
                count += 1
            if count != self.entries:
                raise JournalDamaged(f"journal {self.path} holds {count} entries; its run "
                                     f"recorded {self.entries}")

    def rename(self, path: str) -> None:
        if self.entries:
            os.rename(self.path, path)
        self.path = path

    def delete(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.entries = self.bytes = 0


def _unpacker(f: Any, limit: int) -> msgpack.Unpacker:
    return msgpack.Unpacker(f, raw=False, max_buffer_size=max(1, min(limit, _MAX_ENTRY_BYTES)),
                            strict_map_key=True)


def _next(unpacker: msgpack.Unpacker, path: str, offset: int) -> Journaled:
    try:
        data = unpacker.unpack()
    except msgpack.OutOfData:
        raise JournalDamaged(f"journal {path} is cut short: it ends inside the entry at byte "
                             f"{offset}") from None
    except Exception as exc:  # msgpack raises outside its own hierarchy too
        raise JournalDamaged(f"journal {path}: byte {offset} does not decode "
                             f"({type(exc).__name__}: {exc})") from None
    entry = Journaled.of(data)
    if entry is None:
        raise JournalDamaged(f"journal {path}: the item at byte {offset} is not an entry "
                             "([name, args, ok, value, labels])")
    return entry


@dataclass
class ApprovalQuota:
    """The quotas per principal on durable runs, and the journals' bytes held by each.

    ``max_parked``: runs one principal may have parked at once; ``journal_bytes``: bytes its
    runs' journals may hold together (live and parked)."""

    max_parked: int
    journal_bytes: int

    def __post_init__(self) -> None:
        self.held: Counter[Tenant] = Counter()  # journal bytes, by principal

    def may_park(self, owner: Tenant, who: str, parked: int) -> None:
        """Raises QuotaExceeded when one more parked run (``parked`` now) is past the count."""
        if parked + 1 > self.max_parked:
            raise QuotaExceeded(
                f"runs of {who} parked for approval: {parked}; the daemon parks at most "
                f"{self.max_parked} per principal (limits.approvals_parked_max_count): decide "
                "and resume one (jaild approvals, client.resume_run), or let one pass its "
                "max_wait_s")

    def may_journal(self, owner: Tenant, who: str, adding: int) -> None:
        """Raises QuotaExceeded when ``adding`` bytes take ``owner``'s journals past the
        quota."""
        held = self.held[owner]
        if held + adding > self.journal_bytes:
            raise QuotaExceeded(
                f"this reply's journal entry is {adding} bytes and the journals of {who}'s "
                f"durable runs hold {held}; the quota is {self.journal_bytes} bytes per "
                "principal (limits.approvals_journal_quota_mb)")

    def add(self, owner: Tenant, size: int) -> None:
        self.held[owner] += size

    def remove(self, owner: Tenant, size: int) -> None:
        left = self.held[owner] - size
        if left > 0:
            self.held[owner] = left
        else:
            self.held.pop(owner, None)

    def total(self) -> int:
        return sum(self.held.values())


__all__ = ["ApprovalQuota", "Journal", "Journaled"]
