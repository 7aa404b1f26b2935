"""Where the daemon's parts are made and joined: one place, in dependency order.

Each part gets what it needs as it is made, and no part is joined to another by assigning
an attribute afterwards. The order is the parts' dependencies (an arrow: "is given")::

    registry, observers, catalog (the daemon's), snapshot store (made on first use)
      -> parked runs (durable runs and their files; knows no session)
        -> sessions (a session closed with its run parked drops the run)
          -> the sessions' part in parked runs (ParkedSessions)
            -> approvals (told the sessions when a session's run parks or is dropped)
              -> pipeline (every run to its record, a parked run's continuation too)
                -> requests (what each request of a client does: the dispatch table)
                  -> the waiting room (requests that wait for a starting daemon)

so a session never calls the approvals, nor the approvals the pipeline: a continuation that
a decision or a ``ResumeRun`` makes due is started by the requests' handler, which asks the
approvals (:meth:`~jaild.daemon.approvals.Approvals.decide` returns the run) and then the
pipeline (:meth:`~jaild.daemon.pipeline.Pipeline.continue_run`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from jaild.daemon.approvals import Approvals, DurableRun
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core import admission
from jaild.daemon.core.readiness import Phase, Readiness
from jaild.daemon.observe import Observers
from jaild.daemon.pipeline import Pipeline
from jaild.daemon.registry import Registry
from jaild.daemon.requests import Requests
from jaild.daemon.sessions import ParkedSessions, Sessions
from jaild.daemon.startup import Served
from jaild.daemon.state.journal import ApprovalQuota
from jaild.daemon.state.parkedruns import ParkedRuns
from jaild.daemon.state.snapshots import SnapshotStore
from jaild.daemon.waiting import WaitingRoom


@dataclass(frozen=True)
class Parts:
    """A daemon's parts that serve its requests, joined."""

    registry: Registry
    snapshots: Callable[[], SnapshotStore]
    parked_runs: ParkedRuns[DurableRun]
    sessions: Sessions
    approvals: Approvals
    pipeline: Pipeline
    requests: Requests
    waiting: WaitingRoom


def snapshot_store(config: DaemonConfig) -> Callable[[], SnapshotStore]:
    """The daemon's snapshot store, made on first use (``config.snapshot_dir``)."""

    @functools.cache
    def store() -> SnapshotStore:
        return SnapshotStore(config.snapshot_dir, config.snapshot_quota_mb << 20,
                             config.snapshot_max_count,
                             total_bytes=config.snapshot_total_quota_mb << 20)

    return store


def build(config: DaemonConfig, served: Served, observers: Observers,
          catalog: Callable[[], admission.Catalog], *, reap_orphans: bool = True,
          ready: bool = False) -> Parts:
    """The parts of a daemon of ``config`` (see the module docstring); ``ready``: it
    serves from the start (given what it serves with, as :mod:`jaild.testing` does)."""
    registry = Registry()
    snapshots = snapshot_store(config)
    parked_runs: ParkedRuns[DurableRun] = ParkedRuns(
        os.path.join(config.state_dir, "parked", config.instance),
        ApprovalQuota(config.approvals_parked_max_count,
                      config.approvals_journal_quota_mb << 20),
        snapshots)
    observers.metrics.approvals(lambda: parked_runs.usage(None))
    sessions = Sessions(config, registry, served, observers, catalog, snapshots, parked_runs)
    parked_sessions = ParkedSessions(sessions)
    approvals = Approvals(parked_runs, parked_sessions)
    pipeline = Pipeline(config, registry, sessions, served, observers, catalog,
                        approvals=approvals, parked_sessions=parked_sessions,
                        reap_orphans=reap_orphans)
    requests = Requests(registry, pipeline, sessions, approvals, parked_runs, served, observers,
                        catalog)
    waiting = WaitingRoom(Readiness(config.startup_wait_s,
                                    Phase.READY if ready else Phase.STAGING),
                          config, catalog, requests.refused)
    return Parts(registry, snapshots, parked_runs, sessions, approvals, pipeline, requests,
                 waiting)


__all__ = ["Parts", "build", "snapshot_store"]
