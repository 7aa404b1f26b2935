"""What one run of a jail measured, besides its machine's tally; and the run's record.

The :class:`~jaild.daemon.core.machine.JobMachine` counts what a run's jail sent (output, tool
calls: its :class:`~jaild.daemon.core.machine.Tally`). A :class:`RunAccount` keeps the rest, as
the job's driver (:class:`~jaild.daemon.jails.job.JailedJob`) performs the machine's actions: when
the job was taken and its code sent and ended, the cgroup's CPU counters at the run's start
and end, how long the client's stream held the jail's output back and how much it skipped,
and the code's result and files. From both it builds the run's record with
:func:`jaild.daemon.core.records.job_record` -- where every rule of the record's shape is.

A session's jail serves one run after another: :meth:`RunAccount.reset` starts the next.
"""

from __future__ import annotations

import time
from typing import Any

from jaild.daemon.core import records
from jaild.daemon.core.machine import JobSpec, Tally
from jaild.daemon.jails.launch.handle import JailHandle
from jaild.policy.compile import file_limits
from jaild.policy.schema import Policy
from jaild.protocol.messages import CodeFinished
from jaild.protocol.records import JobRecord, Usage
from jaild.runtime.files import validate_collected


class RunAccount:
    """The measures of one jail's current run (its cgroup and output pipes: ``handle``'s)."""

    def __init__(self, handle: JailHandle) -> None:
        self._handle = handle
        self.job_started = time.monotonic()  # when the jail was given its job (duration_s)
        self._paused_since: float | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the last run: times, CPU counters, stream, result, files."""
        self._code_started: float | None = None
        self._code_ended: float | None = None
        self._cpu_base: tuple[float, float] | None = None
        self._cpu_end: tuple[float, float] | None = None
        self._stream_dropped = 0
        self._stream_paused = 0.0
        self.result: bytes | None = None
        self.downloads: dict[str, bytes] = {}
        self._files: list[dict[str, Any]] = []
        self._files_skipped: list[dict[str, Any]] = []
        self._network_refused: int | None = None

    @property
    def code_sent_at(self) -> float | None:
        """When the run's ``RunCode`` went (monotonic seconds), or None: not yet."""
        return self._code_started

    @property
    def code_ended_at(self) -> float | None:
        """When the runtime reported the code's end (monotonic seconds), or None: not (yet)."""
        return self._code_ended

    # -- the run's steps, as the driver performs the machine's actions

    def run_started(self) -> None:
        """Before ``RunCode``: the cgroup's peak counters restart, its CPU time is the base."""
        cgroup = self._handle.cgroup
        if cgroup is not None:
            cgroup.reset_peak_memory()
            self._cpu_base = cgroup.start_cpu_count()

    def code_sent(self) -> None:
        """``RunCode`` is on its way: the code's wall-clock time counts from here."""
        self._code_started = time.monotonic()

    def code_ended(self, report: CodeFinished, policy: Policy) -> None:
        """The runtime's report: the code's time ends; its result, files and count of
        refused network attempts are taken."""
        self.result = report.result
        self._network_refused = report.network_refused
        self._code_ended = time.monotonic()
        cgroup = self._handle.cgroup
        if cgroup is not None:
            self._cpu_end = cgroup.cpu_times()
        self._take_files(report.files, policy)

    def cpu_used_s(self) -> float | None:
        """CPU time (user + system, every process of the jail) used since the run started;
        None when the cgroup cannot tell."""
        cgroup = self._handle.cgroup
        if cgroup is None or self._cpu_base is None:
            return None
        now = cgroup.cpu_times()
        if now is None:
            return None
        return sum(now) - sum(self._cpu_base)

    def withhold_files(self) -> None:
        """Information flow withholds the downloads: their listing (names, sizes, digests)
        goes too."""
        self.downloads = {}
        self._files = []
        self._files_skipped = []

    def _take_files(self, wire: Any, policy: Policy) -> None:
        """What the runtime collected -- hostile input: checked entry by entry."""
        if wire is None:
            return
        collected = validate_collected(wire, file_limits(policy))
        self._files = [dict(f) for f in collected.files]
        self._files_skipped = [dict(f) for f in collected.skipped]
        self.downloads = collected.data

    # -- the client's stream

    def pause_output(self) -> None:
        """Stop reading the jail's stdout/stderr (a slow client): the jail blocks on write."""
        if self._paused_since is None:
            self._paused_since = time.monotonic()
            self._handle.pause_output()

    def resume_output(self) -> None:
        if self._paused_since is not None:
            self._stream_paused += time.monotonic() - self._paused_since
            self._paused_since = None
            self._handle.resume_output()

    def output_dropped(self, n: int) -> None:
        """The client's stream skipped ``n`` bytes of output (still in the record)."""
        self._stream_dropped += n

    # -- the record

    def record(
        self,
        spec: JobSpec,
        status: str,
        error: dict[str, Any] | None,
        tally: Tally,
        egress: dict[str, Any] | None = None,
        flow: dict[str, Any] | None = None,
    ) -> JobRecord:
        """The run's record (``egress``: its door's usage, for an egress policy; ``flow``:
        its labels and what they closed). Only an ``ok`` run keeps its result and files."""
        if status != "ok":
            self.result = None
            self.downloads = {}
        return records.job_record(
            job_id=spec.job_id,
            policy=spec.policy,
            limits=spec.limits,
            status=status,
            error=error,
            stdout=tally.stdout,
            stderr=tally.stderr,
            tool_calls=tally.calls,
            tool_calls_omitted=tally.calls_omitted,
            duration_s=time.monotonic() - self.job_started,
            usage=self._usage(tally),
            files=self._files,
            files_skipped=self._files_skipped,
            egress=egress,
            network_refused=self._network_refused,
            flow=flow,
        )

    def _usage(self, tally: Tally) -> Usage:
        """What this run consumed (the cgroup's counters from its ``RunCode`` on)."""
        cgroup = self._handle.cgroup
        cpu_end = self._cpu_end
        if cpu_end is None and cgroup is not None:
            cpu_end = cgroup.cpu_times()
        if self._paused_since is not None:
            self.resume_output()
        return records.run_usage(
            code_started=self._code_started,
            code_ended=self._code_ended if self._code_ended is not None else time.monotonic(),
            cpu_base=self._cpu_base,
            cpu_end=cpu_end,
            memory_peak_bytes=cgroup.peak_memory_bytes() if cgroup else None,
            pids_peak=cgroup.peak_pids() if cgroup else None,
            output_bytes=tally.output_bytes,
            tool_calls=len(tally.calls) + tally.calls_omitted,
            tool_time_s=tally.tool_time_s,
            stream_paused_s=self._stream_paused,
            stream_dropped_bytes=self._stream_dropped,
        )


__all__ = ["RunAccount"]
