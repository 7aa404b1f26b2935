"""The jaild client library: :class:`AsyncClient` for asyncio, :class:`Client` for plain code.

::

    from jaild import Client

    def search(query: str) -> list[str]:
        "Search the catalogue."
        return [query.upper()]

    with Client() as c:
        r = c.run("print(await tools.search(query='x'))", tools={"search": search}, timeout=10)
        r.status, r.result, r.stdout, r.error

Tool handlers may be plain or ``async`` functions. Plain handlers run in worker
threads, so a slow one never stalls other jobs; ``async`` ones run on the
client's event loop. Many jobs may run at once over one client (and the sync
:class:`Client` is safe to use from many threads): each job's tool calls are
answered concurrently.

Both clients share one core: :class:`Client` runs an :class:`AsyncClient` on a
private event-loop thread, each of its methods declared from the asyncio one
(:mod:`jaild.blocking`, as :class:`~jaild.fleet.Fleet` is). How the client connects is one
record, :class:`~jaild.transport.Transport` (``transport=``); the handlers of a job's tool
calls run in :class:`~jaild.toolhost.ToolHost`.

A job or session started where an OpenTelemetry span is current carries that span's
context to the daemon (``RunJob.traceparent``, :func:`jaild.tracing.current_traceparent`;
the blocking client hands the calling thread's context to its own): a daemon that traces
makes the job's spans part of the caller's trace (docs/using/tracing.md).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import inspect
import itertools
import logging
import socket
import typing
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar, Unpack

from jaild import loops, tracing
from jaild.address import socket_from_env
from jaild.blocking import Portal, blocking, wrapping
from jaild.errors import (
    ConnectionLost,
    JaildError,
    RemoteProtocolError,
    SessionLost,
    SessionPaused,
    UnknownSnapshot,
    error_from_wire,
)
from jaild.errors import (
    SessionClosed as SessionClosedError,
)
from jaild.protocol import PROTOCOL_VERSION, unpack
from jaild.protocol.messages import (
    ApprovalList,
    ApprovalPending,
    ApprovalRecorded,
    ApproveCall,
    CancelJob,
    ClientCallTool,
    CloseSession,
    DeleteSnapshot,
    Error,
    GetStats,
    Hello,
    JobAccepted,
    JobDescription,
    JobFinished,
    JobList,
    JobOutput,
    Kill,
    Killed,
    ListApprovals,
    ListJobs,
    ListPolicies,
    ListSnapshots,
    Message,
    OpenSession,
    PauseSession,
    PolicyList,
    ResumeRun,
    ResumeSession,
    RunJob,
    RunParked,
    SessionClosed,
    SessionOpened,
    SnapshotDeleted,
    SnapshotList,
    SnapshotSession,
    SnapshotTaken,
    Stats,
)
from jaild.protocol.messages import SessionPaused as SessionPausedMsg
from jaild.protocol.records import JobRecord
from jaild.toolhost import Approver as Approver  # the API names it here
from jaild.toolhost import ToolHost
from jaild.toolspec import HostTool, normalize_tools
from jaild.transfer import Uploads, load_uploads, save_files
from jaild.transport import MAX_FRAME as MAX_FRAME  # jaild.testing's, from here
from jaild.transport import Transport, TransportOptions, Wire, transport_of
from jaild.version import __version__

log = logging.getLogger("jaild.client")
T = TypeVar("T")

OutputCallback = Callable[[str], Any]


@dataclass(frozen=True)
class JobResult:
    """The result record of one job (the CLI's ``--json`` prints :meth:`to_dict`).

    The fields are plain values -- maps and lists, ready for JSON -- as they have always
    been. :attr:`record` is the same record typed (:class:`~jaild.protocol.records.JobRecord`),
    for code that prefers attributes to keys: ``r.record.usage.wall_s``,
    ``r.record.error.limit``, ``r.record.tool_calls[0].duration_s``.
    """

    job_id: str
    status: str
    result: Any
    stdout: str
    stderr: str
    error: dict[str, Any] | None
    tool_calls: list[dict[str, Any]]
    duration_s: float
    limits: dict[str, Any]
    policy: str = ""
    tool_calls_omitted: int = 0
    """Calls beyond the 1000 listed in ``tool_calls`` (a job that floods its tools)."""
    usage: dict[str, Any] = field(default_factory=dict)
    """What the job consumed: wall_s, cpu_user_s, cpu_system_s, memory_peak_bytes, pids_peak,
    output_bytes, tool_calls, tool_time_s, stream_paused_s, stream_dropped_bytes."""
    files: list[dict[str, Any]] = field(default_factory=list)
    """Files the run created or changed in its working directory: path, size, sha256."""
    files_skipped: list[dict[str, Any]] = field(default_factory=list)
    """Entries not listed or not downloaded, each with its reason (a symlink, a FIFO, ...)."""
    downloads: dict[str, bytes] = field(default_factory=dict)
    """Contents of the files that matched ``download``."""
    session: dict[str, Any] | None = None
    """For a session's run: the session ``id``, the ``run`` number, and ``closed`` (the
    reason) if this run ended the session."""
    network_refused: int | None = None
    """Network attempts the policy refused with ``PermissionError`` (a policy without a
    network), as the jail's runtime counted them: the jail's own word. None when it did not
    report."""
    egress: dict[str, Any] | None = None
    """An egress policy's traffic: requests, bytes in and out, hosts, refusals
    (docs/using/egress.md). None for a policy without egress."""
    flow: dict[str, Any] | None = None
    """The labels the job holds, the sends they closed and what was withheld from you
    (docs/using/flow.md). None when the job received no labelled result and nothing was
    refused by a flow rule."""
    _record: JobRecord | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def record(self) -> JobRecord:
        """The record, typed (checked as the wire checks it).

        Raises:
            LocalProtocolError: a hand-made result whose fields are not a valid record.
        """
        if self._record is None:
            view = {name: getattr(self, name) for name in RECORD_FIELDS}
            typed = JobRecord.from_wire({**view, "usage": self.usage or None})
            object.__setattr__(self, "_record", typed)
        assert self._record is not None
        return self._record

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def save_files(self, directory: str, *, overwrite: bool = False,
                   dotfiles: bool = False) -> list[str]:
        """Write :attr:`downloads` below ``directory``; never outside it (names are checked
        again here, and no symlink is followed). Returns the paths written.

        An existing file is not written over unless ``overwrite``; a dotfile (a path with
        a component starting with ``.``) is not written unless ``dotfiles``. Raises
        :class:`~jaild.errors.UnsafePath` naming the file and what to pass, before writing
        anything (:func:`jaild.transfer.refusals` lists them all beforehand)."""
        return save_files(directory, self.downloads, overwrite=overwrite, dotfiles=dotfiles)

    def to_dict(self) -> dict[str, Any]:
        """The record's own view (:meth:`JobRecord.to_dict`: a field at its default is left
        out), with ``result`` after ``status`` and ``usage`` always a map."""
        view = self.record.to_dict()
        return {"job_id": view.pop("job_id"), "status": view.pop("status"),
                "result": self.result, **view, "usage": view.get("usage") or {}}

    @classmethod
    def from_wire(
        cls,
        record: JobRecord | Mapping[str, Any],
        packed: bytes | None,
        files: Mapping[str, bytes] | None = None,
    ) -> JobResult:
        """The result of ``JobFinished``: its record, its packed result and its files.

        Raises:
            LocalProtocolError: ``record`` is a map that is not a valid record.
        """
        typed = record if isinstance(record, JobRecord) else JobRecord.from_wire(record)
        result = None
        if packed is not None:
            try:
                result = unpack(packed)
            except RemoteProtocolError:
                result = None
        view = typed.to_dict()  # leaves out what is empty: those are taken as they are
        fields = {name: view[name] if name in view else _plain(getattr(typed, name))
                  for name in RECORD_FIELDS}
        out = cls(**{**fields, "usage": fields["usage"] or {}}, result=result,
                  downloads=dict(files or {}))
        object.__setattr__(out, "_record", typed)
        return out


def _plain(value: Any) -> Any:
    """A record's field left out of its view (empty, or None) as JobResult holds it."""
    return list(value) if isinstance(value, tuple) else value


RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(JobRecord))
"""The record's fields, which :class:`JobResult` has too, plus ``result`` and ``downloads``
(tests/unit/test_client_api.py holds the two lists equal)."""


class RunOptions(TypedDict, total=False):
    """The keywords of every run: ``run`` and ``submit`` of both clients and of both kinds
    of session. Declared once, here; each of those methods takes them as
    ``**options: Unpack[RunOptions]`` (type checkers and IDEs see each keyword and its
    type), and ``help()`` shows them in its signature and its ``Args``, with their
    defaults (:data:`RUN_OPTION_DEFAULTS`). Any other keyword is a ``TypeError``."""

    timeout: float | None
    """Wall-clock seconds (shorthand for ``limits={"wall_time_s": ...}``)."""
    limits: Mapping[str, float] | None
    """Limits for this run (``{"memory_mb": 64, "pids": 8}``, ``wall_time_s``, tool
    limits); each may only be stricter than the policy's. In a session, memory and pids
    are the session's, set when it opened."""
    on_stdout: OutputCallback | None
    """Called with the run's stdout text as the run produces it."""
    on_stderr: OutputCallback | None
    """Called with the run's stderr text as the run produces it."""
    filename: str
    """The code's file name in tracebacks."""
    files: Uploads | None
    """Uploads into the jail's working directory before the code runs:
    ``{"path/in/jail": bytes or a local path}``, or local paths (a directory goes in
    recursively)."""
    download: Iterable[str] | bool
    """Patterns (``fnmatch``, ``*`` crosses ``/``) of files in the working directory whose
    contents come back in ``result.downloads``; ``True``: every file the run created or
    changed."""
    approve: Approver | None
    """The approval callback for this run's tools marked ``approval`` (default: the
    session's, if it has one, else the client's); without one such calls are denied."""
    labels: Iterable[str]
    """Information-flow labels the job holds from its first instruction, as if a tool
    result had carried them (in a session: added to the session's): pass on what the code's
    author read -- a model that saw a labelled result (``result.flow["labels"]``) writes the
    next job (docs/using/flow.md, "Labels a caller passes on")."""


RUN_OPTION_DEFAULTS: dict[str, Any] = {
    "timeout": None, "limits": None, "on_stdout": None, "on_stderr": None,
    "filename": "<job>", "files": None, "download": (), "approve": None, "labels": (),
}
"""What each of :class:`RunOptions` is when not given."""


def _run_options(options: RunOptions) -> dict[str, Any]:
    """``options`` with every default filled in; an unknown keyword is a ``TypeError``,
    as a written-out signature would raise."""
    unknown = options.keys() - RUN_OPTION_DEFAULTS.keys()
    if unknown:
        raise TypeError(f"unexpected keyword argument {min(unknown)!r}; a run takes "
                        f"{', '.join(RUN_OPTION_DEFAULTS)}")
    return {**RUN_OPTION_DEFAULTS, **options}


@dataclass
class _Job:
    tools: dict[str, HostTool]
    on_stdout: OutputCallback | None
    on_stderr: OutputCallback | None
    finished: asyncio.Future[JobResult]
    approve: Approver | None = None
    decoders: dict[str, codecs.IncrementalDecoder] = field(default_factory=dict)
    calls: set[asyncio.Task[None]] = field(default_factory=set)
    parked: bool = False  # waited for approval past its policy's park_after_s (RunParked)
    session: AsyncSession | None = None  # a resumed session run's session (ResumeRun)


class AsyncJob:
    """A job started with :meth:`AsyncClient.submit`."""

    def __init__(self, client: AsyncClient, job_id: str, state: _Job) -> None:
        self._client = client
        self.job_id = job_id
        self._state = state

    @property
    def done(self) -> bool:
        return self._state.finished.done()

    @property
    def session(self) -> AsyncSession | None:
        """A resumed run of a session (:meth:`AsyncClient.resume_run`): that session, this
        connection's once the run has gone on (after :meth:`result`). Else None."""
        return self._state.session

    async def result(self) -> JobResult:
        """Wait for the job to end. Cancelling the waiting task cancels the job."""
        try:
            return await asyncio.shield(self._state.finished)
        except asyncio.CancelledError:
            if not self._state.finished.done():
                with contextlib.suppress(Exception):
                    await self._client.cancel(self.job_id)
            raise
        finally:
            if self._state.finished.done():
                self._client._forget(self.job_id)

    async def cancel(self) -> None:
        """Ask the daemon to stop the job; :meth:`result` then reports ``cancelled``."""
        if not self._state.finished.done():
            await self._client.cancel(self.job_id)


class AsyncSession:
    """A jail kept for a series of runs (:meth:`AsyncClient.session`).

    Each :meth:`run` sees the variables, functions and imports of the earlier runs, and
    top-level ``await`` works in every run. The session ends when it is closed, when it
    was idle for its ``idle_s``, at its ``max_lifetime_s``, when its client disconnects,
    when ``jaild kill`` ends it, or when a run hits a limit (that run's record says which;
    then :attr:`closed` holds the reason and further runs raise ``SessionClosed``).
    """

    def __init__(
        self,
        client: AsyncClient,
        policy: str | None,
        tools: dict[str, HostTool],
        limits: dict[str, float],
        idle_s: float | None,
        max_lifetime_s: float | None,
        from_snapshot: str | None = None,
        pause_after_s: float | None = None,
        labels: Iterable[str] = (),
    ) -> None:
        self._client = client
        self.policy = policy
        self._labels = tuple(sorted(set(labels)))
        self.from_snapshot = from_snapshot
        self._pause_after_s = pause_after_s
        self.paused = False
        """Paused to disk (asked, or after ``pause_after_s`` idle): the next run resumes it."""
        self._tools = tools
        self._limits = limits
        self._idle_s = idle_s
        self._max_lifetime_s = max_lifetime_s
        self.id: str | None = None
        self.closed: str | None = None
        """Why the session ended (``closed``, ``idle``, ``lifetime``, ``killed``, a run's
        status such as ``timeout`` or ``memory_limit``, ``disconnected``), or None."""
        self.close_message = ""
        self.info: dict[str, Any] = {}
        self.approve: Approver | None = None  # for this session's runs (default: the client's)
        self._lost: ConnectionLost | None = None  # its connection was lost: so was it

    async def open(self) -> AsyncSession:
        """Open the session: returns once its jail is ready (and, from a snapshot, holds
        the snapshot's state)."""
        tools = tuple(t.spec() for t in self._tools.values())
        if self.policy is None:  # restoring a snapshot: under the policy it was taken with
            self.policy = (await self._client._snapshot_entry(self.from_snapshot))["policy"]
        policy = self.policy
        assert policy is not None
        answer = await self._client._request(
            lambda ref: OpenSession(
                ref=ref,
                policy=policy,
                tools=tools,
                limits=self._limits,
                idle_s=self._idle_s,
                max_lifetime_s=self._max_lifetime_s,
                traceparent=tracing.current_traceparent(),
                from_snapshot=self.from_snapshot,
                pause_after_s=self._pause_after_s,
                labels=self._labels,
            )
        )
        self.id = answer.session_id
        self.info = answer.record.to_dict()
        self._client._sessions[answer.session_id] = self
        return self

    async def __aenter__(self) -> AsyncSession:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _closed(self, reason: str, message: str) -> None:
        self.closed = self.closed or reason
        self.close_message = self.close_message or message

    def _lose(self, exc: ConnectionLost) -> None:
        """Its connection was lost: the session (its jail, its state) is gone with it."""
        self._lost = exc
        self._closed("disconnected", exc.message)

    def _session_lost(self) -> SessionLost:
        lost = self._lost
        assert lost is not None
        return SessionLost(f"session {self.id} was lost with its connection: {lost.message}",
                           reason=lost.reason, node=self._client.address)

    def _check_open(self) -> str:
        if self._lost is not None:
            raise self._session_lost()
        if self.closed is not None:
            raise SessionClosedError(f"session {self.id} is closed ({self.closed}): "
                                     f"{self.close_message}", reason=self.closed)
        if self.id is None:
            raise SessionClosedError("the session is not open; use 'async with' or open()")
        return self.id

    async def run(
        self,
        code: str,
        **options: Unpack[RunOptions],
    ) -> JobResult:
        """Run ``code`` in the session's jail and return its result record. The session's
        policy and tools apply; a run that hits a limit ends the session.

        Args:
            code: Python source; sees what earlier runs defined; may use top-level
                ``await`` and the ``tools`` global.
            **options: the run's options: :class:`RunOptions`.

        Returns:
            The run's :class:`JobResult`; ``result.session`` says which run of which
            session, and ``closed`` if this run ended it. A run that fails is *not* an
            exception: look at ``result.status``.

        Raises:
            SessionClosed: the session is not open, or it ended before this run.
            JaildError: the daemon refused the run (looser limits, a change to the
                session's memory or pids, a run already in progress: ``Busy``, ...), or
                the connection failed.
            UploadError: a file in ``files`` cannot be uploaded (nothing was sent).
        """
        return await self._run(code, options)

    async def submit(
        self,
        code: str,
        **options: Unpack[RunOptions],
    ) -> AsyncJob:
        """Start a run in the session's jail; return once the daemon accepted it. Unlike
        :meth:`run`, this does not mark the session closed when the run ends it (the
        daemon's ``SessionClosed`` does, a moment later).

        Args:
            code: Python source; sees what earlier runs defined; may use top-level
                ``await`` and the ``tools`` global.
            **options: the run's options: :class:`RunOptions`.

        Returns:
            An :class:`AsyncJob`: its ``job_id``, ``await job.result()``, ``await job.cancel()``.

        Raises:
            SessionClosed: the session is not open, or it ended before this run.
            JaildError: the daemon refused the run (looser limits, a change to the
                session's memory or pids, a run already in progress: ``Busy``, ...), or
                the connection failed.
            UploadError: a file in ``files`` cannot be uploaded (nothing was sent).
        """
        return await self._submit(code, options)

    async def _run(self, code: str, options: RunOptions) -> JobResult:
        job = await self._submit(code, options)
        try:
            result = await job.result()
        except ConnectionLost as exc:
            if self._lost is None or isinstance(exc, SessionLost):
                raise
            raise self._session_lost() from exc
        ended = (result.session or {}).get("closed")
        if ended:  # its SessionClosed follows; the session is over already
            error = result.error or {}
            self._closed(str(ended), f"run {result.job_id} ended the session: "
                         f"{error.get('message', '')}")
            self._client._sessions.pop(self.id or "", None)
        return result

    async def _submit(self, code: str, options: RunOptions) -> AsyncJob:
        session_id = self._check_open()
        if options.get("approve") is None and self.approve is not None:
            options = {**options, "approve": self.approve}
        try:
            if self.paused:
                await self.resume()
            try:
                return await self._client._submit(code, self.policy or "", self._tools,
                                                  options, session_id)
            except SessionPaused:  # paused when idle as this run was on its way
                self.paused = True
                await self.resume()
                return await self._client._submit(code, self.policy or "", self._tools,
                                                  options, session_id)
        except SessionClosedError as exc:  # the daemon's word: why is its SessionClosed's
            exc.reason = exc.reason or self.closed
            raise
        except ConnectionLost as exc:
            if self._lost is None or isinstance(exc, SessionLost):
                raise
            raise self._session_lost() from exc

    async def snapshot(self, ttl_s: float | None = None) -> dict[str, Any]:
        """Snapshot the session (idle: between runs): its variables, functions, classes,
        imported modules' data and working directory, kept by the daemon for ``ttl_s``
        (default and most: the policy's ``session.snapshot_ttl_s``). What survives and
        what does not: docs/using/sessions.md.

        Returns:
            The snapshot's entry: ``id`` (for :meth:`AsyncClient.restore`), ``policy``,
            ``bytes``, ``created``, ``expires``, ``session``.

        Raises:
            SnapshotFailed: naming what could not be captured (a variable holding an open
                file, a generator; a symlink in the working directory; the size).
            QuotaExceeded: the principal's snapshots would exceed the daemon's quota.
        """
        session_id = self._check_open()
        if self.paused:
            await self.resume()
        answer = await self._client._request(
            lambda ref: SnapshotSession(ref=ref, session_id=session_id, ttl_s=ttl_s))
        entry: dict[str, Any] = answer.snapshot.to_dict()
        return entry

    async def fork(self, n: int, tools: Mapping[str, Any] | Iterable[Any] | None = None
                   ) -> list[AsyncSession]:
        """``n`` new sessions, each in its own fresh jail, each starting from this session's
        state and files; what one does, no other (nor this one) sees. They are open; close
        them (or ``async with`` each). ``tools``: theirs (default: this session's).

        Raises:
            SnapshotFailed, QuotaExceeded: as :meth:`snapshot`; JaildError: a fork's jail
                could not be opened (those opened are closed again).
        """
        if not 1 <= n <= 1024:
            raise ValueError(f"fork(n): n must be between 1 and 1024, not {n}")
        entry = await self.snapshot(ttl_s=3600)
        forks = [
            AsyncSession(self._client, self.policy, normalize_tools(tools) if tools is not None
                         else self._tools, dict(self._limits), self._idle_s,
                         self._max_lifetime_s, from_snapshot=entry["id"],
                         pause_after_s=self._pause_after_s)
            for _ in range(n)
        ]
        for f in forks:
            f.approve = self.approve
        try:
            opened = await asyncio.gather(*(f.open() for f in forks), return_exceptions=True)
            failed = [o for o in opened if isinstance(o, BaseException)]
            if failed:
                await asyncio.gather(*(f.close() for f in forks), return_exceptions=True)
                raise failed[0]
            return forks
        finally:
            with contextlib.suppress(JaildError):
                await self._client.delete_snapshot(entry["id"])

    async def pause(self) -> int:
        """Pause the session to disk now: its jail ends and its memory is released; the
        next run (or :meth:`resume`) restores it in a fresh jail. Returns the bytes kept."""
        session_id = self._check_open()
        if self.paused:
            return 0
        answer = await self._client._request(
            lambda ref: PauseSession(ref=ref, session_id=session_id))
        self.paused = True
        return int(answer.bytes)

    async def resume(self) -> None:
        """Bring a paused session back in a fresh jail (runs do it by themselves)."""
        session_id = self._check_open()
        await self._client._request(lambda ref: ResumeSession(ref=ref, session_id=session_id))
        self.paused = False

    async def upload(self, files: Uploads) -> JobResult:
        """Put files into the working directory (a run of no code); ``files`` as
        :meth:`run` takes them."""
        return await self._run("", {"files": files})

    async def download(self, *patterns: str) -> dict[str, bytes]:
        """The contents of files in the working directory matching ``patterns``
        (``fnmatch``, ``*`` crosses ``/``; none: every file)."""
        result = await self._run("", {"download": patterns or ("*",)})
        return result.downloads

    async def close(self) -> None:
        """End the session (its jail is killed). Idempotent."""
        if self.id is None or self.closed is not None:
            return
        self._closed("closed", "closed by the client")
        self._client._sessions.pop(self.id, None)
        with contextlib.suppress(JaildError):
            await self._client._send(CloseSession(session_id=self.id))


class AsyncClient:
    """An asyncio client of one jaild daemon: over its Unix socket, or over the network
    with mutual TLS (``tls://HOST:PORT``).

    Args:
        address: the daemon's socket (default: ``$JAILD_SOCKET`` or ``/run/jaild/jaild.sock``),
            or ``tls://HOST:PORT``.
        name: how this client introduces itself (shown in daemon logs).
        handler_threads: worker threads for plain (non-async) tool handlers: how many of
            them may block at once across this client's jobs.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        transport: Transport | None = None,
        name: str = "",
        handler_threads: int = 64,
        approve: Approver | None = None,
        sock: socket.socket | None = None,
        **shorthand: Unpack[TransportOptions],
    ) -> None:
        """A client of the daemon at ``address`` (default: ``$JAILD_SOCKET``, else
        ``/run/jaild/jaild.sock``); :meth:`connect` (or ``async with``) connects.

        Args:
            address: the daemon's Unix socket path (or ``unix:///path``), or
                ``tls://HOST:PORT`` for a daemon's network listener.
            transport: how to connect (:class:`~jaild.transport.Transport`: TLS material,
                the daemon's certificate name, the connect and liveness timeouts).
            name: what the client calls itself in its ``Hello`` (the daemon's logs).
            handler_threads: threads for synchronous tool handlers.
            approve: asked for tools that need approval (see :data:`Approver`).
            sock: a connected stream socket to speak over instead of connecting to
                ``address`` (one end of a socketpair: :mod:`jaild.testing`).
            **shorthand: ``Transport``'s fields as keywords (``cert=``, ``key=``, ``ca=``,
                ``server_name=``, ``tls=``, ``liveness_timeout_s=``,
                ``connect_timeout_s=``), building the ``transport``: the spelling of
                earlier releases, kept for this one (not with ``transport=``).

        Raises:
            TypeError: ``transport`` and shorthand keywords both, or an unknown keyword.
            ValueError: TLS material for an address that is not ``tls://``.
            DaemonUnavailable: a ``tls://`` address without a usable certificate and key.
        """
        self.transport = transport_of(transport, shorthand)
        """How this client connects (:class:`~jaild.transport.Transport`)."""
        self._wire = Wire(socket_from_env(address)[0], self.transport, sock=sock,
                          deliver=self._handle, ended=self._fail_all)
        self.address = self._wire.address
        self.kind, self.host, self.port = self._wire.kind, self._wire.host, self._wire.port
        self.socket_path = self._wire.socket_path
        self._approve = approve
        self._name = name or f"jaild-py/{__version__}"
        self.node = ""
        """The node the daemon keeps its state on, as its ``Welcome`` named it ("" before
        connecting, or from a daemon that does not name it)."""
        self._starting: dict[str, Any] | None = None  # Welcome.starting
        self._refs = itertools.count(1)
        self._accepting: dict[int, tuple[asyncio.Future[str], _Job]] = {}
        self._requests: dict[int, asyncio.Future[Any]] = {}
        self._jobs: dict[str, _Job] = {}
        self._sessions: dict[str, AsyncSession] = {}
        self._broken: JaildError | None = None
        self._tools = ToolHost(handler_threads)

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect and handshake. Raises DaemonUnavailable if nobody answers."""
        welcome = await self._wire.open(Hello(protocol=PROTOCOL_VERSION, client=self._name))
        self.node = welcome.node
        self._starting = welcome.starting.to_wire() if welcome.starting else None

    async def close(self) -> None:
        self._fail_all(ConnectionLost("the client was closed", reason="local"))
        await self._wire.close()
        self._tools.close()

    # ------------------------------------------------------------------ API

    async def submit(
        self,
        code: str,
        policy: str = "default",
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        **options: Unpack[RunOptions],
    ) -> AsyncJob:
        """Start ``code`` in a fresh jail; return once the daemon accepted it (the daemon
        says so with the job's first output, tool call or end, and within about 10 ms of a
        job that is still running).

        Args:
            code: Python source; may use top-level ``await`` and the ``tools`` global.
            policy: the policy to run under.
            tools: host tools, as ``{"name": fn}`` or ``[fn, ...]`` (plain or async functions).
            **options: the run's options: :class:`RunOptions`.

        Returns:
            An :class:`AsyncJob`: its ``job_id``, ``await job.result()``, ``await job.cancel()``.

        Raises:
            JaildError: the daemon refused the job (``UnknownPolicy``, ``PolicyUnavailable``,
                ``BadRequest`` for looser limits, ``PermissionDenied``, ``Busy``, ...;
                ``Starting``: the daemon was still starting when its
                ``limits.startup_wait_s`` had passed -- until then the job waits), or
                the connection failed (``ConnectionLost``).
            TypeError, ValueError: a tool that is not callable, a bad or repeated tool
                name, or a file in ``files`` that cannot be uploaded (``UploadError``);
                nothing was sent.
        """
        return await self._submit(code, policy, tools, options)

    async def run(
        self,
        code: str,
        policy: str = "default",
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        **options: Unpack[RunOptions],
    ) -> JobResult:
        """Run ``code`` in a fresh jail and return its result record (:meth:`submit`, then
        :meth:`AsyncJob.result`). If the awaiting task is cancelled, the job is cancelled too.

        Args:
            code: Python source; may use top-level ``await`` and the ``tools`` global.
            policy: the policy to run under.
            tools: host tools, as ``{"name": fn}`` or ``[fn, ...]`` (plain or async functions).
            **options: the run's options: :class:`RunOptions`.

        Returns:
            The job's :class:`JobResult`. A job that runs and fails is *not* an exception:
            look at ``result.status``.

        Raises:
            JaildError: the daemon refused the job (``UnknownPolicy``, ``PolicyUnavailable``,
                ``BadRequest`` for looser limits, ``PermissionDenied``, ``Busy``, ...;
                ``Starting``: the daemon was still starting when its
                ``limits.startup_wait_s`` had passed -- until then the job waits), or
                the connection failed (``ConnectionLost``).
            TypeError, ValueError: a tool that is not callable, a bad or repeated tool
                name, or a file in ``files`` that cannot be uploaded (``UploadError``);
                nothing was sent.
        """
        return await self._run(code, policy, tools, options)

    async def _run(
        self,
        code: str,
        policy: str,
        tools: Mapping[str, Any] | Iterable[Any] | None,
        options: RunOptions,
    ) -> JobResult:
        job = await self._submit(code, policy, tools, options)
        return await job.result()

    async def _submit(
        self,
        code: str,
        policy: str,
        tools: Mapping[str, Any] | Iterable[Any] | None,
        options: RunOptions,
        session_id: str | None = None,
    ) -> AsyncJob:
        """Send the ``RunJob`` (the one place one is built) and wait for ``JobAccepted``."""
        host_tools = normalize_tools(tools)
        run = _run_options(options)
        uploads = load_uploads(run["files"]) if run["files"] else {}
        download = run["download"]
        patterns = () if isinstance(download, bool) else tuple(download)
        wanted = dict(run["limits"] or {})
        if run["timeout"] is not None:
            wanted["wall_time_s"] = float(run["timeout"])
        ref = next(self._refs)
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[str] = loop.create_future()
        job = _Job(host_tools, run["on_stdout"], run["on_stderr"], loop.create_future(),
                   run["approve"] or self._approve)
        self._tools.prepare(host_tools.values(), job.approve)  # its worker, before a call
        self._accepting[ref] = (accepted, job)
        msg = RunJob(
            ref=ref,
            job=JobDescription(
                code=code,
                filename=run["filename"],
                tools=tuple(t.spec() for t in host_tools.values()),
                files=uploads,
                download=patterns,
                download_changed=download is True,
            ),
            policy=policy,
            limits=wanted,
            session_id=session_id,
            traceparent=tracing.current_traceparent(),  # the caller's span, if it has one
            labels=tuple(sorted(set(run["labels"]))),
        )
        try:
            await self._send(msg)
            job_id = await accepted
        finally:
            self._accepting.pop(ref, None)
        return AsyncJob(self, job_id, job)

    async def _request(self, make: Callable[[int], Message]) -> Any:
        """Send ``make(ref)`` and wait for the answer to ``ref``."""
        ref = next(self._refs)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._requests[ref] = fut
        try:
            await self._send(make(ref))
            return await fut
        finally:
            self._requests.pop(ref, None)

    async def policies(self) -> list[dict[str, Any]]:
        """The policies this daemon serves to this user."""
        answer = await self._request(lambda ref: ListPolicies(ref=ref))
        return [p.to_dict() for p in answer.policies]

    async def jobs(self) -> list[dict[str, Any]]:
        """Running jobs and open sessions (``jaild ps``): all for root, else this uid's."""
        answer = await self._request(lambda ref: ListJobs(ref=ref))
        return [j.to_dict() for j in answer.jobs]

    async def kill(self, ident: str) -> str:
        """End a running job or an open session of this uid's (any, for root), from any
        connection. Returns ``"job"`` or ``"session"``."""
        answer = await self._request(lambda ref: Kill(ref=ref, id=ident))
        return str(answer.kind)

    async def stats(self) -> dict[str, Any]:
        """Usage totals per policy and per uid since the daemon started (``jaild stats``)."""
        answer = await self._request(lambda ref: GetStats(ref=ref))
        stats: dict[str, Any] = answer.stats.to_dict()
        return stats

    async def approve(self, job_id: str, call_id: int, allow: bool = True,
                      reason: str = "") -> None:
        """Decide a tool call waiting for approval (``jaild approvals`` lists them): of any
        run whose policy's ``[approvals] approvers`` include this client's principal.

        Raises:
            UnknownJob: no such call waits; PermissionDenied: not an approver of it.
        """
        await self._request(lambda ref: ApproveCall(ref=ref, job_id=job_id, call_id=call_id,
                                                    allow=allow, reason=reason))

    async def approvals(self) -> list[dict[str, Any]]:
        """The tool calls waiting for approval that this client's principal may decide."""
        answer = await self._request(lambda ref: ListApprovals(ref=ref))
        return [a.to_dict() for a in answer.approvals]

    async def resume_run(
        self,
        job_id: str,
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        approve: Approver | None = None,
    ) -> AsyncJob:
        """Host the tools of a parked run of this principal's (one that waited for approval
        past its policy's ``park_after_s``, from a connection that has gone, or from before
        the daemon restarted). Once its call is decided the run goes on in a fresh jail,
        from that call; ``await job.result()`` is its record. A session's run brings its
        session back (its state from before the run, the run replayed): ``job.session``,
        this connection's from then on.

        Raises:
            UnknownJob: no parked run of yours has that id; BadRequest: ``tools`` lacks one
                of the run's tools, or another connection hosts it.
        """
        host_tools = normalize_tools(tools)
        ref = next(self._refs)
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[str] = loop.create_future()
        job = _Job(host_tools, on_stdout, on_stderr, loop.create_future(),
                   approve or self._approve)
        self._accepting[ref] = (accepted, job)
        try:
            await self._send(ResumeRun(ref=ref, job_id=job_id,
                                       tools=tuple(t.spec() for t in host_tools.values())))
            await accepted
        finally:
            self._accepting.pop(ref, None)
        return AsyncJob(self, job_id, job)

    async def snapshots(self) -> list[dict[str, Any]]:
        """This principal's snapshots (and paused sessions' states, ``kind`` ``pause``)."""
        answer = await self._request(lambda ref: ListSnapshots(ref=ref))
        return [e.to_dict() for e in answer.snapshots]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete one of this principal's snapshots (UnknownSnapshot: none has that id)."""
        await self._request(lambda ref: DeleteSnapshot(ref=ref, snapshot_id=snapshot_id))

    async def _snapshot_entry(self, snapshot_id: str | None) -> dict[str, Any]:
        for entry in await self.snapshots():
            if entry["id"] == snapshot_id:
                return entry
        raise UnknownSnapshot(f"no snapshot {snapshot_id} of yours")

    def restore(
        self,
        snapshot_id: str,
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        policy: str | None = None,
        limits: Mapping[str, float] | None = None,
        idle_s: float | None = None,
        max_lifetime_s: float | None = None,
        pause_after_s: float | None = None,
        approve: Approver | None = None,
    ) -> AsyncSession:
        """A session whose state is the snapshot's, in a fresh jail (new namespaces, cgroup,
        uid, seccomp): as :meth:`session`, under the snapshot's policy (``policy``, if
        given, must be it). Works after the daemon restarted; the snapshot stays (restore
        it again, or delete it). Not yet open: ``async with client.restore(id) as s``.

        Raises (on opening): UnknownSnapshot (none of yours has that id), SnapshotFailed.
        """
        session = AsyncSession(
            self, policy, normalize_tools(tools), dict(limits or {}), idle_s, max_lifetime_s,
            from_snapshot=snapshot_id, pause_after_s=pause_after_s,
        )
        session.approve = approve
        return session

    def session(
        self,
        policy: str = "default",
        tools: Mapping[str, Any] | Iterable[Any] | None = None,
        *,
        limits: Mapping[str, float] | None = None,
        idle_s: float | None = None,
        max_lifetime_s: float | None = None,
        pause_after_s: float | None = None,
        approve: Approver | None = None,
        labels: Iterable[str] = (),
    ) -> AsyncSession:
        """A session: one jail kept for many runs that share variables, functions and imports.

        ``async with client.session(...) as s: await s.run("x = 1"); await s.run("x + 1")``.
        Nothing is sent until the session is opened (``async with`` or ``open()``).

        Args:
            policy: the policy the session's jail runs under.
            tools: host tools for every run, as ``{"name": fn}`` or ``[fn, ...]`` (plain or
                async functions).
            limits: the limits of each run (``wall_time_s``, ``cpu_time_s``, ...), and
                ``memory_mb`` / ``pids`` for the whole session; each may only be stricter
                than the policy's.
            idle_s: end the session after this many seconds without a run; may only
                tighten the policy's ``[session] idle_s``.
            max_lifetime_s: end the session this many seconds after it opened; may only
                tighten the policy's ``[session] max_lifetime_s``.
            pause_after_s: pause the session to disk after this many seconds without a
                run (its jail is released; the next run restores it); may only tighten the
                policy's ``[session] pause_after_s``.
            approve: the approval callback for the runs' tools marked ``approval``
                (default: the client's); without one such calls are denied.
            labels: information-flow labels the session holds from its start (as a run's
                ``labels``: what the caller passes on of what it read).

        Returns:
            An :class:`AsyncSession`, not yet open.

        Raises:
            TypeError, ValueError: a tool that is not callable, or a bad or repeated tool
                name.
        """
        session = AsyncSession(
            self, policy, normalize_tools(tools), dict(limits or {}), idle_s, max_lifetime_s,
            pause_after_s=pause_after_s, labels=labels,
        )
        session.approve = approve
        return session

    async def cancel(self, job_id: str) -> None:
        """Ask the daemon to cancel a running job (it then finishes with status ``cancelled``)."""
        await self._send(CancelJob(job_id=job_id))

    # ------------------------------------------------------------------ internals

    def _forget(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is not None:
            for task in job.calls:
                task.cancel()

    @property
    def lost(self) -> JaildError | None:
        """Why this client's connection is over (its ``ConnectionLost``, or the error that
        ended it); None while it is up."""
        return self._broken

    @property
    def starting(self) -> dict[str, Any] | None:
        """What the daemon said in its ``Welcome`` if it was still starting then: ``pending``
        (what it was doing, in words) and ``wait_s`` (how long a job, session, restore or
        approval waits for it to be ready; past that it raises
        :class:`~jaild.errors.Starting`). None: it was ready. Said once, at connect: a
        daemon starting then may be ready by now."""
        return self._starting

    async def wait_closed(self) -> None:
        """Until the connection has closed: the daemon closed it, it broke, it was found
        dead (liveness) or :meth:`close` was called."""
        await self._wire.closed()

    async def _send(self, msg: Message) -> None:
        broken = self._broken
        if isinstance(broken, ConnectionLost):  # nothing was sent: said so (a fleet then
            raise ConnectionLost(broken.message, reason="not_sent") from broken  # may retry)
        if broken is not None:
            raise broken
        await self._wire.send(msg)

    def _fail_all(self, exc: JaildError) -> None:
        self._broken = self._broken or exc
        self._wire.stop_watching()
        for sess in self._sessions.values():
            if isinstance(exc, ConnectionLost) and exc.reason != "local":
                sess._lose(exc)
            else:
                sess._closed("disconnected", exc.message)
        self._sessions.clear()
        for fut in [*(a for a, _ in self._accepting.values()), *self._requests.values()]:
            if not fut.done():
                fut.set_exception(exc)
        for job in self._jobs.values():
            if not job.finished.done():
                job.finished.set_exception(exc)
                job.finished.exception()  # result() still raises; unawaited jobs stay quiet

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, JobAccepted):
            pending = self._accepting.get(msg.ref)
            if pending is not None and not pending[0].done():
                self._jobs[msg.job_id] = pending[1]  # before any of its output can arrive
                if msg.session_id is not None:  # a parked session run, resumed here
                    back = AsyncSession(self, None, pending[1].tools, {}, None, None)
                    back.id = msg.session_id
                    back.approve = pending[1].approve
                    self._sessions[msg.session_id] = back
                    pending[1].session = back
                pending[0].set_result(msg.job_id)
            return
        if isinstance(msg, SessionPausedMsg):
            paused = self._sessions.get(msg.session_id)
            if paused is not None:
                paused.paused = True
        if isinstance(msg, (PolicyList, SessionOpened, JobList, Killed, Stats, SnapshotTaken,
                            SnapshotList, SnapshotDeleted, SessionPausedMsg, ApprovalRecorded,
                            ApprovalList)):
            req = self._requests.get(msg.ref)
            if req is not None and not req.done():
                req.set_result(msg)
            return
        if isinstance(msg, SessionClosed):
            sess = self._sessions.pop(msg.session_id, None)
            if sess is not None:
                sess._closed(msg.reason, msg.message)
            return
        if isinstance(msg, Error):
            err = error_from_wire(msg.code, msg.message)
            target: asyncio.Future[Any] | None = None
            if msg.ref is not None:
                accepting = self._accepting.get(msg.ref)
                target = accepting[0] if accepting else self._requests.get(msg.ref)
            elif msg.job_id is not None and msg.job_id in self._jobs:
                target = self._jobs[msg.job_id].finished
            if target is not None and not target.done():
                target.set_exception(err)
            elif msg.ref is None and msg.job_id is None:
                self._fail_all(err)
            else:
                log.warning("jaild error: %s: %s", msg.code, msg.message)
            return
        job_id = getattr(msg, "job_id", None)
        assert isinstance(job_id, str)
        job = self._jobs.get(job_id)
        if job is None:
            log.debug("ignoring %s for unknown job %s", msg.TYPE, job_id)
            return
        if isinstance(msg, JobOutput):
            callback = job.on_stdout if msg.stream == "stdout" else job.on_stderr
            if callback is not None:
                decoder = job.decoders.setdefault(
                    msg.stream, codecs.getincrementaldecoder("utf-8")(errors="replace")
                )
                text = decoder.decode(msg.data)
                if text:
                    try:
                        callback(text)
                    except Exception:
                        log.exception("on_%s callback failed", msg.stream)
        elif isinstance(msg, ClientCallTool):
            task = asyncio.get_running_loop().create_task(self._answer(job, msg))
            job.calls.add(task)
            task.add_done_callback(job.calls.discard)
        elif isinstance(msg, ApprovalPending):
            task = asyncio.get_running_loop().create_task(self._decide(job, msg))
            job.calls.add(task)
            task.add_done_callback(job.calls.discard)
        elif isinstance(msg, RunParked):
            job.parked = True
            log.info("job %s is parked: %s", msg.job_id, msg.message)
        elif isinstance(msg, JobFinished) and not job.finished.done():
            if job.session is not None and job.session.policy is None:
                job.session.policy = msg.record.policy
                job.session.info = {"policy": msg.record.policy}
            job.finished.set_result(JobResult.from_wire(msg.record, msg.result, msg.files))

    async def _answer(self, job: _Job, call: ClientCallTool) -> None:
        """Answer a job's tool call with its handler's result (:class:`ToolHost`)."""
        reply = await self._tools.call(job.tools, job.approve, call)
        with contextlib.suppress(JaildError, ConnectionError, OSError):
            await self._send(reply)

    async def _decide(self, job: _Job, pending: ApprovalPending) -> None:
        """A call held by the daemon for approval: the job's approve callback decides it
        (:meth:`ToolHost.decide`); without one, the policy's approvers do."""
        decision = await self._tools.decide(job.approve, pending)
        if decision is None:
            return
        try:
            await self.approve(pending.job_id, pending.call_id, *decision)
        except JaildError as exc:  # not an approver here, or decided by someone else
            log.warning("job %s: call %d not decided by this client: %s", pending.job_id,
                        pending.call_id, exc)


BLOCKING = {"AsyncClient": "Client", "AsyncJob": "Job", "AsyncSession": "Session",
            "async with": "with", "await ": "", "awaiting task is cancelled":
            "caller is interrupted (``KeyboardInterrupt``)"}
"""How an asyncio docstring reads for the blocking class (:func:`jaild.blocking.blocking`)."""


class Client:
    """A blocking client: the same API as :class:`AsyncClient`, without ``await``.

    Runs an :class:`AsyncClient` on a private event-loop thread (``event_loop``: "asyncio",
    "uvloop" or "auto", see :mod:`jaild.loops`). Output callbacks are called from that
    thread; plain tool handlers from worker threads. Connects in its constructor.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        transport: Transport | None = None,
        name: str = "",
        handler_threads: int = 64,
        approve: Approver | None = None,
        event_loop: str = loops.DEFAULT,
        **shorthand: Unpack[TransportOptions],
    ) -> None:
        """A connected client of the daemon at ``address``; the arguments are
        :class:`AsyncClient`'s, and ``event_loop`` the private loop's kind."""
        self._client = AsyncClient(
            address, transport=transport, name=name, handler_threads=handler_threads,
            approve=approve, **shorthand,
        )  # before the thread: a bad argument raises here, with nothing to stop
        self._portal = Portal(event_loop, "jaild-client")
        try:
            self._call(self._client.connect())
        except BaseException:
            self._portal.close()
            raise

    @property
    def _async(self) -> AsyncClient:
        return self._client

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's thread and wait for it (:meth:`Portal.call`)."""
        return self._portal.call(coro)

    @property
    def lost(self) -> JaildError | None:
        """As :attr:`AsyncClient.lost`: why the connection is over; None while it is up."""
        return self._client.lost

    @property
    def node(self) -> str:
        """As :attr:`AsyncClient.node`: the node the daemon keeps its state on."""
        return self._client.node

    @property
    def starting(self) -> dict[str, Any] | None:
        """As :attr:`AsyncClient.starting`: the daemon was still starting at connect."""
        return self._client.starting

    @property
    def transport(self) -> Transport:
        """As :attr:`AsyncClient.transport`: how this client connects."""
        return self._client.transport

    @property
    def socket_path(self) -> str:
        return self._client.socket_path

    @property
    def address(self) -> str:
        return self._client.address

    run = blocking(AsyncClient.run, renames=BLOCKING)
    submit = blocking(AsyncClient.submit, wrap=lambda c, job: Job(c, job), returns="Job",
                      renames=BLOCKING)
    policies = blocking(AsyncClient.policies, renames=BLOCKING)
    jobs = blocking(AsyncClient.jobs, renames=BLOCKING)
    kill = blocking(AsyncClient.kill, renames=BLOCKING)
    stats = blocking(AsyncClient.stats, renames=BLOCKING)
    session = wrapping(AsyncClient.session, lambda c, s: Session(c, s), returns="Session",
                       renames=BLOCKING)
    restore = wrapping(AsyncClient.restore, lambda c, s: Session(c, s), returns="Session",
                       renames=BLOCKING)
    approve = blocking(AsyncClient.approve, renames=BLOCKING)
    approvals = blocking(AsyncClient.approvals, renames=BLOCKING)
    resume_run = blocking(AsyncClient.resume_run, wrap=lambda c, job: Job(c, job),
                          returns="Job", renames=BLOCKING)  # job.session: a session run's
    snapshots = blocking(AsyncClient.snapshots, renames=BLOCKING)
    delete_snapshot = blocking(AsyncClient.delete_snapshot, renames=BLOCKING)
    cancel = blocking(AsyncClient.cancel, renames=BLOCKING)
    wait_closed = blocking(AsyncClient.wait_closed, renames=BLOCKING)

    def close(self) -> None:
        """Close the connection and stop the client's thread. Idempotent."""
        if self._portal.closed:
            return
        with contextlib.suppress(Exception):
            self._call(self._client.close())
        self._portal.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Job:
    """A job started with :meth:`Client.submit`."""

    def __init__(self, client: Client, job: AsyncJob) -> None:
        self._client = client
        self._job = job
        self.job_id = job.job_id

    @property
    def _async(self) -> AsyncJob:
        return self._job

    @property
    def _portal(self) -> Portal:
        return self._client._portal

    @property
    def done(self) -> bool:
        return self._job.done

    @property
    def session(self) -> Session | None:
        """As :attr:`AsyncJob.session`."""
        sess = self._job.session
        return None if sess is None else Session(self._client, sess)

    def result(self, timeout: float | None = None) -> JobResult:
        """Wait for the job (``timeout`` seconds at most: TimeoutError, the job keeps running)."""
        return self._portal.wait(self._job.result(), timeout)

    cancel = blocking(AsyncJob.cancel, renames=BLOCKING)


class Session:
    """A session of the blocking :class:`Client` (see :class:`AsyncSession`)."""

    def __init__(self, client: Client, session: AsyncSession) -> None:
        self._client = client
        self._session = session

    @property
    def _async(self) -> AsyncSession:
        return self._session

    @property
    def _portal(self) -> Portal:
        return self._client._portal

    @property
    def id(self) -> str | None:
        return self._session.id

    @property
    def closed(self) -> str | None:
        return self._session.closed

    @property
    def close_message(self) -> str:
        return self._session.close_message

    @property
    def info(self) -> dict[str, Any]:
        """What the daemon said when the session opened: policy, idle_s, max_lifetime_s,
        limits."""
        return self._session.info

    @property
    def paused(self) -> bool:
        return self._session.paused

    open = blocking(AsyncSession.open, wrap=lambda s, _: s, returns="Session",
                    renames=BLOCKING)

    def __enter__(self) -> Session:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    run = blocking(AsyncSession.run, renames=BLOCKING)
    submit = blocking(AsyncSession.submit, wrap=lambda s, job: Job(s._client, job),
                      returns="Job", renames=BLOCKING)
    snapshot = blocking(AsyncSession.snapshot, renames=BLOCKING)
    fork = blocking(AsyncSession.fork, returns="list[Session]", renames=BLOCKING,
                    wrap=lambda s, forks: [Session(s._client, f) for f in forks])
    pause = blocking(AsyncSession.pause, renames=BLOCKING)
    resume = blocking(AsyncSession.resume, renames=BLOCKING)
    upload = blocking(AsyncSession.upload, renames=BLOCKING)
    download = blocking(AsyncSession.download, renames=BLOCKING)

    def close(self) -> None:
        """End the session (its jail is killed). Idempotent."""
        if not self._portal.closed:
            self._portal.call(self._session.close())


# --------------------------------------------------------------------------- help()


def _option_docs() -> dict[str, str]:
    """Each run option's docstring, read from :class:`RunOptions`' source (attribute
    docstrings do not exist at run time); empty where the source is not at hand."""
    import ast
    import textwrap

    try:
        with open(__file__, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return {}
    start = source.find("\nclass RunOptions(")
    end = source.find("\n\n\n", start)
    if start < 0 or end < 0:
        return {}
    docs: dict[str, str] = {}
    body = ast.parse(textwrap.dedent(source[start + 1:end])).body[0]
    assert isinstance(body, ast.ClassDef)
    for stmt, after in itertools.pairwise(body.body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[stmt.target.id] = " ".join(str(after.value.value).split())
    return docs


def _publish_run_options() -> None:
    """Give every method taking ``**options: Unpack[RunOptions]`` the signature and the
    ``Args`` its options would have if written out, for ``help()`` and ``inspect``."""
    import textwrap

    hints = typing.get_type_hints(RunOptions)
    docs = _option_docs()
    keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                  annotation=hints[name])
                for name, default in RUN_OPTION_DEFAULTS.items()]
    methods: tuple[Any, ...] = (AsyncClient.run, AsyncClient.submit, AsyncSession.run,
                                AsyncSession.submit, Client.run, Client.submit, Session.run,
                                Session.submit)
    for method in methods:
        own = typing.get_type_hints(method)
        sig = inspect.signature(method)
        params = [p.replace(annotation=own.get(p.name, p.annotation))
                  for p in sig.parameters.values()
                  if p.kind is not p.VAR_KEYWORD and p.name not in RUN_OPTION_DEFAULTS]
        method.__signature__ = sig.replace(
            parameters=[*params, *keywords], return_annotation=own.get("return"))
        doc = method.__doc__ or ""
        line = next((x for x in doc.splitlines() if x.lstrip().startswith("**options:")), None)
        if line is None or not docs:
            continue
        indent = line[: len(line) - len(line.lstrip())]
        entries = "\n".join(
            textwrap.fill(f"{name}: {docs[name]}", 92, initial_indent=indent,
                          subsequent_indent=indent + "    ")
            for name in RUN_OPTION_DEFAULTS
        )
        method.__doc__ = doc.replace(line, entries)


_publish_run_options()
