"""Placement: which jail an admitted run goes to -- a fresh one, a pooled one, or its
session's -- and the one way to run it there.

Theory of operation
-------------------
=================  ===============================================  ==================
run                jail                                             its id
=================  ===============================================  ==================
one-shot, pooled   taken from the policy's warm pool (only if the   the pooled jail's
                   job's ``ONE_SHOT_JAIL_LIMITS`` are the policy's  (made under it)
                   own); it gets its code at once (``assign``)
one-shot, fresh    made for it (a cold start: no pool, pool empty,  a new id
                   or other jail-level limits)
session run        the session's jail, kept between runs            a new id
=================  ===============================================  ==================

Every run carries its client's uid (``JobSpec.tenant``): a forked jail comes from that
uid's zygote and a pooled one from that uid's pool (:class:`jaild.daemon.jails.pool.TenantPools`),
so no two uids' jails are forks of one process (docs/security.md).

Whichever the jail, :meth:`Placed.run` ends in the same three values -- the
record, the result, the downloaded files -- so the pipeline has one path from
here to the record.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaild.daemon.core.admission import AdmittedJob, SessionTerms
from jaild.daemon.core.peer import Tenant
from jaild.daemon.jails.job import JailedJob, JailEnvironment, JobSpec, OutputSink, ToolRouter
from jaild.daemon.jails.pool import JailPool, poolable
from jaild.policy.schema import Policy
from jaild.protocol.messages import JobDescription
from jaild.protocol.records import JobRecord
from jaild.tracing import JobTrace

if TYPE_CHECKING:
    from jaild.daemon.registry import JailSession

RunOutcome = tuple[JobRecord, bytes | None, dict[str, bytes]]
"""What a run ends in: its record, its result (packed), its downloaded files."""


def new_job_id() -> str:
    return "job-" + secrets.token_hex(8)


@dataclass(frozen=True)
class Placed:
    """A run and the jail it runs in."""

    spec: JobSpec
    jail: JailedJob
    route_tool: ToolRouter
    output: OutputSink
    session: JailSession | None = None
    pooled: bool = False
    trace: JobTrace | None = None

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def mode(self) -> str:
        """How the run got its jail: ``session``, ``pooled`` or ``fresh`` (its trace says)."""
        return "session" if self.session is not None else "pooled" if self.pooled else "fresh"

    async def run(self) -> RunOutcome:
        """Run the code to its record (in a session's jail: this run only)."""
        if self.session is not None:
            return await self.jail.run_next(self.spec, self.route_tool, self.output, self.trace)
        record = await self.jail.run()
        return record, self.jail.result, self.jail.downloads


# -- every job spec the daemon makes is made here (the self-test's probe aside: startup.py)


def run_spec(job: AdmittedJob, job_id: str, tenant: Tenant | None, *, keep: bool = False,
             released: frozenset[str] = frozenset()) -> JobSpec:
    """An admitted run's spec (``keep``: in a session's jail; a continuation of a parked
    run is admitted again from what it was: :meth:`jaild.daemon.pipeline.Pipeline.continue_run`)."""
    return JobSpec(job_id=job_id, policy=job.policy, limits=job.limits, job=job.job,
                   keep=keep, tenant=tenant, released=released, hold=job.labels)


def session_jail_spec(jail_id: str, terms: SessionTerms, tenant: Tenant | None,
                      labels: frozenset[str]) -> JobSpec:
    """A session's jail, made before its first run, holding ``labels`` from its start."""
    return JobSpec(jail_id, terms.policy, terms.jail_limits,
                   JobDescription(code="", filename="<session>", tools=terms.tools),
                   keep=True, tenant=tenant, labels=labels)


def op_spec(job_id: str, terms: SessionTerms, tenant: Tenant | None, *, snapshot: bool,
            restore: bytes | None, labels: frozenset[str],
            released: frozenset[str]) -> JobSpec:
    """A snapshot (``snapshot``) or a restore (of ``restore``, whose labels are ``labels``)
    in a session's jail: a run whose result may be as large as the policy's snapshots."""
    policy = terms.policy
    limits = dataclasses.replace(terms.limits, result_bytes=policy.session.snapshot_max_bytes)
    what = "<snapshot>" if snapshot else "<restore>"
    return JobSpec(job_id, policy, limits,
                   JobDescription(code="", filename=what, tools=terms.tools), keep=True,
                   tenant=tenant, snapshot=snapshot, restore=restore, released=released,
                   labels=labels)


def pool_spec(jail_id: str, policy: Policy, tenant: Tenant | None) -> JobSpec:
    """A warm pool's jail, made before its job (which it takes at ``Assign``)."""
    return JobSpec(jail_id, policy, policy.limits, JobDescription(code="", filename="<pool>"),
                   tenant=tenant)


def place(
    job: AdmittedJob,
    job_id: str,
    route_tool: ToolRouter,
    output: OutputSink,
    env: JailEnvironment,
    pools: Mapping[str, JailPool],
    session: JailSession | None = None,
    tenant: Tenant | None = None,
    trace: JobTrace | None = None,
    released: frozenset[str] = frozenset(),
) -> Placed:
    """The jail for an admitted run (see the table above). A pooled jail is given its
    code here, so its run starts before the client hears ``JobAccepted``. ``tenant``: the
    client's uid; a jail forked from a zygote is forked from that uid's (see
    :class:`~jaild.daemon.jails.launch.zygotes.ZygoteSet`), a pooled one taken from its pool.
    ``trace``: the job's trace (None: tracing is off), which its jail feeds; ``released``:
    the labels whose withholding spares this caller (its ``[[flow.sink]] release_to``)."""
    if session is not None:
        spec = run_spec(job, job_id, tenant, keep=True, released=released)
        return Placed(spec, session.jail, route_tool, output, session, trace=trace)
    pool = pools.get(job.policy.name)
    usable = pool is not None and poolable(job.policy, job.limits)
    pooled = pool.take(tenant) if pool is not None and usable else None
    if pooled is not None:
        spec = run_spec(job, pooled.jail_id, tenant, released=released)  # the pooled jail's id
        pooled.assign(spec, route_tool, output, trace)  # its code is on its way now
        return Placed(spec, pooled, route_tool, output, pooled=True, trace=trace)
    spec = run_spec(job, job_id, tenant, released=released)
    jail = JailedJob(spec, env, route_tool, output, trace=trace)
    return Placed(spec, jail, route_tool, output, trace=trace)


__all__ = [
    "Placed", "RunOutcome", "new_job_id", "op_spec", "place", "pool_spec", "run_spec",
    "session_jail_spec",
]
