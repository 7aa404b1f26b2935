"""The durable runs of a daemon, and what they keep on disk: files, journals, quotas.

Theory of operation
-------------------
:class:`ParkedRuns` holds every durable run (:class:`~jaild.daemon.approvals.DurableRun`) of
the daemon by id, and everything of them on disk: the parked run's file
(``<state_dir>/parked/<instance>/<job id>.run``, a
:class:`~jaild.daemon.core.parked.ParkedRunFile`, written to a temporary name and renamed
once the journal is synced), its journal beside it (:mod:`jaild.daemon.state.journal`), the
quotas per principal on both, and a parked session run's state before the run (a snapshot
of kind ``parked`` in the snapshot store). It knows nothing of sessions or connections:
the sessions (:mod:`jaild.daemon.sessions`) and the approvals service
(:mod:`jaild.daemon.approvals`) are built on it, in that order (ARCHITECTURE.md, "Wiring").

Both files are made by the daemon only: never a name or a format from a jail or a client.
A file read back is checked whole (:meth:`ParkedRunFile.from_wire
<jaild.protocol.fields.Struct.from_wire>`); one that does not check, or whose journal is
not what the file records, is dropped at start, logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import msgpack

from jaild.daemon.core import parked
from jaild.daemon.core.parked import ParkedRunFile, Phase, RunLife
from jaild.daemon.core.peer import Tenant
from jaild.daemon.state.journal import ApprovalQuota, Journal, Journaled
from jaild.daemon.state.snapshots import SnapshotStore
from jaild.errors import JaildError
from jaild.policy.schema import Policy
from jaild.protocol.records import SnapshotKind

log = logging.getLogger("jaild")

MAX_FILE_BYTES = 1 << 30


class StoredRun(Protocol):
    """What this store needs of a durable run (:class:`jaild.daemon.approvals.DurableRun`)."""

    job_id: str
    owner_key: Tenant
    owner_name: str
    policy: Policy
    journal: Journal
    life: RunLife
    session_id: str | None
    state_id: str | None
    before: bytes | None
    before_labels: tuple[str, ...]

    def to_file(self) -> ParkedRunFile: ...


DurableRun = TypeVar("DurableRun", bound=StoredRun)


class ParkedRuns(Generic[DurableRun]):
    """See the module docstring.

    Args:
        directory: where parked runs and every durable run's journal are kept.
        quota: the limits per principal on parked runs and journals.
        snapshots: the daemon's snapshot store (made on first use).
    """

    def __init__(self, directory: str, quota: ApprovalQuota,
                 snapshots: Callable[[], SnapshotStore]) -> None:
        self.directory = directory
        self.quota = quota
        self.snapshots = snapshots
        self._runs: dict[str, DurableRun] = {}

    # -- the runs

    def add(self, run: DurableRun) -> None:
        self._runs[run.job_id] = run

    def get(self, job_id: str) -> DurableRun | None:
        return self._runs.get(job_id)

    def __getitem__(self, job_id: str) -> DurableRun:
        return self._runs[job_id]

    def __iter__(self) -> Iterator[DurableRun]:
        return iter(list(self._runs.values()))

    def __len__(self) -> int:
        return len(self._runs)

    def rename(self, run: DurableRun, job_id: str) -> None:
        """The run took a pooled jail: its id is the jail's (before any call)."""
        self._runs.pop(run.job_id, None)
        run.job_id = job_id
        run.journal.rename(self.path(job_id, "journal"))
        self._runs[job_id] = run

    def ended(self, run: DurableRun) -> None:
        """Its run ended (not parked): forget it, and what it kept on disk."""
        if self._runs.get(run.job_id) is run:
            del self._runs[run.job_id]
            self._delete(run)
            self.delete_state(run)
        run.life.end()

    def drop(self, run: DurableRun, why: str) -> None:
        """Forget a parked run for good (and its session's state)."""
        if self._runs.get(run.job_id) is run:
            del self._runs[run.job_id]
        self._delete(run)
        self.delete_state(run)
        run.life.end()
        log.info("approvals: run %s dropped: %s", run.job_id, why)

    def expired(self, now: float | None = None) -> list[DurableRun]:
        """The parked runs not decided and continued within their policy's ``max_wait_s``."""
        now = time.time() if now is None else now
        return [run for run in self._runs.values() if run.life.phase is Phase.PARKED
                and now - run.life.parked_at > run.policy.approvals.max_wait_s]

    def parked_of(self, owner: Tenant) -> int:
        return sum(1 for r in self._runs.values() if r.life.parked and r.owner_key == owner)

    def usage(self, owner: Tenant | None) -> tuple[int, int, int]:
        """(durable runs, of which parked, their journals' bytes): of ``owner``'s runs, or
        of all (None)."""
        runs = [r for r in self._runs.values() if owner is None or r.owner_key == owner]
        return (len(runs), sum(1 for r in runs if r.life.parked),
                self.quota.total() if owner is None else self.quota.held[owner])

    def states(self) -> set[str]:
        """The snapshot ids of parked session runs' states (kept by the start's sweep)."""
        return {run.state_id for run in self._runs.values() if run.state_id is not None}

    # -- quotas and journals

    def may_park(self, run: DurableRun) -> None:
        """Raises QuotaExceeded when ``run``'s principal has the most runs parked."""
        self.quota.may_park(run.owner_key, run.owner_name, self.parked_of(run.owner_key))

    def journal_append(self, run: DurableRun, entry: Journaled) -> None:
        """Journal one reply of ``run`` (its file, and its principal's bytes).

        Raises:
            QuotaExceeded: it would take the principal's journals past their quota;
            OSError: it could not be written.
        """
        size = len(entry.pack())
        self.quota.may_journal(run.owner_key, run.owner_name, size)
        if run.journal.entries == 0:
            self._make_directory()
        added = run.journal.append(entry)
        self.quota.add(run.owner_key, added)

    # -- a session run's state before it

    def keep_state(self, run: DurableRun) -> str | None:
        """A session run parks: its session's state before it goes to the snapshot store
        (kind ``parked``); its id, or None if it was not saved (the run then waits live)."""
        blob = run.before
        if blob is None or run.session_id is None:
            return None
        ttl_s = run.policy.approvals.max_wait_s + 86400.0
        try:
            entry = self.snapshots().save(
                run.owner_key, blob, policy=run.policy.name, session=run.session_id,
                ttl_s=ttl_s, kind=SnapshotKind.PARKED, labels=run.before_labels)
        except (JaildError, OSError) as exc:
            log.warning("session %s: run %s waits live, not parked: its state was not saved "
                        "(%s)", run.session_id, run.job_id, getattr(exc, "message", exc))
            return None
        run.before = None
        return entry.id

    def delete_state(self, run: DurableRun) -> None:
        """The state a session run parked with, if any: deleted."""
        if run.state_id is not None:
            with contextlib.suppress(JaildError, OSError):
                self.snapshots().delete(run.owner_key, run.state_id)
            run.state_id = None

    # -- disk

    def path(self, job_id: str, kind: str) -> str:
        return os.path.join(self.directory, f"{job_id}.{kind}")

    def _make_directory(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)

    def save(self, run: DurableRun) -> None:
        """Write the run's file (a live run's only once it has something to keep)."""
        if not run.life.on_disk:
            return
        self._make_directory()
        run.journal.sync()  # what the run's file will name is on disk first
        path = self.path(run.job_id, "run")
        temp = f"{path}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, msgpack.packb(run.to_file().to_wire(), use_bin_type=True))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)

    def forget(self, run: DurableRun) -> None:
        """The parked run's file (it runs live again; its journal stays, for a later
        park)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(run.job_id, "run"))

    def _delete(self, run: DurableRun) -> None:
        """Everything on disk of ``run`` (its file, its journal), and its journal's bytes
        from its principal's."""
        self.quota.remove(run.owner_key, run.journal.bytes)
        run.journal.delete()
        self._delete_files(run.job_id)

    def _delete_files(self, job_id: str) -> None:
        for kind in ("run", "journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(job_id, kind))

    def load(self, policies: Mapping[str, Policy],
             make: Callable[[ParkedRunFile, Policy, Journal], DurableRun]) -> int:
        """At start: the parked runs on disk (those past ``max_wait_s``, and those whose
        file or journal is damaged, are dropped, logged), each made by ``make``. Their
        journals count against their principals' quota, even past it (the quota was
        lowered): nothing parked is lost to a quota; new parks are refused until they are
        under it."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return 0
        now = time.time()
        for name in names:
            path = os.path.join(self.directory, name)
            if name.endswith(".journal"):
                continue  # its run's (below), or a run's that was live at a crash
            if not name.endswith(".run"):
                with contextlib.suppress(OSError):
                    os.unlink(path)  # a temporary left by a crash
                continue
            try:
                saved, rewrite = self._read(path)
                policy = policies.get(saved.policy)
                journal = Journal(self.path(saved.job_id, "journal"), saved.journal_entries,
                                  saved.journal_bytes)
                journal.check()
            except Exception as exc:
                log.warning("parked run %s unreadable (%s); dropped", name, exc)
                self._delete_files(name[:-4])
                continue
            if policy is None or saved.job_id != name[:-4] or saved.held is None \
                    or now - saved.parked_at > policy.approvals.max_wait_s:
                self._delete_files(name[:-4])  # a run live at a crash is lost, as any
                continue  # running job (its session's state, if any, goes in the sweep)
            run = make(saved, policy, journal)
            self._runs[run.job_id] = run
            self.quota.add(run.owner_key, run.journal.bytes)
            if rewrite:
                self.save(run)  # in this format from now on
        for name in names:  # journals of runs live at a crash (or dropped above)
            if name.endswith(".journal") and name[:-8] not in self._runs:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
        return len(self._runs)

    def _read(self, path: str) -> tuple[ParkedRunFile, bool]:
        """A parked run's file, checked (and whether it is of an earlier format: then
        rewritten once its run is made).

        Raises:
            LocalProtocolError, ValueError, KeyError, TypeError, OSError: not a file this
                daemon wrote, or damaged.
        """
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            data: Any = msgpack.unpackb(os.read(fd, MAX_FILE_BYTES), raw=False)
        finally:
            os.close(fd)
        if not isinstance(data, dict):
            raise ValueError("not a map")
        version = data.get("format")
        if version == parked.FILE_FORMAT:
            return ParkedRunFile.from_wire(data), False
        if version == 1:  # the journal inline: moved to its own file
            data = self._move_inline_journal(data)
        elif version != 2:
            raise ValueError(f"format {version!r}")
        return ParkedRunFile.from_wire(parked.upgrade(data)), True

    def _move_inline_journal(self, data: dict[str, Any]) -> dict[str, Any]:
        job_id = data["job_id"]
        if not isinstance(job_id, str) or os.path.basename(job_id) != job_id \
                or job_id.startswith("."):
            raise ValueError("a job id that is not a file name")
        journal = Journal(self.path(job_id, "journal"))
        journal.delete()
        if data["journal"]:
            self._make_directory()
        for j in data["journal"]:
            journal.append(Journaled(j[0], j[1], j[2], j[3], tuple(j[4]) if len(j) > 4 else ()))
        journal.sync()
        return {**data, "journal": {"entries": journal.entries, "bytes": journal.bytes}}


__all__ = ["ParkedRuns", "StoredRun"]
