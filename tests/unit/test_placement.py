"""Placement without root: which jail a run goes to, and the one way it runs there."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from jaild.daemon import placement
from jaild.daemon.core import admission
from jaild.daemon.core.peer import Peer
from jaild.policy.schema import load_policy_text
from jaild.protocol.messages import JobDescription, RunJob

PEER = Peer(pid=1, uid=1000, gid=1000)
POLICY = load_policy_text("", "default.toml")


def admitted(**limits: float) -> admission.AdmittedJob:
    req = RunJob(ref=1, job=JobDescription(code="1"), policy="default", limits=dict(limits))
    return admission.admit_job(admission.Catalog({"default": POLICY}), PEER, req)


class FakeJail:
    def __init__(self, spec: Any = None, env: Any = None, route: Any = None, out: Any = None,
                 jail_id: str = "", trace: Any = None) -> None:
        self.spec, self.jail_id = spec, jail_id or (spec.job_id if spec else "")
        self.assigned: Any = None
        self.trace = trace
        self.result: bytes | None = b"r"
        self.downloads: dict[str, bytes] = {"f": b"x"}

    def assign(self, spec: Any, route: Any, out: Any, trace: Any = None) -> None:
        self.assigned, self.trace = spec, trace

    async def run(self) -> dict[str, Any]:
        return {"job_id": self.spec.job_id}

    async def run_next(self, spec: Any, route: Any, out: Any, trace: Any = None) -> Any:
        self.trace = trace
        return {"job_id": spec.job_id}, None, {}


class FakePool:
    def __init__(self, *jails: FakeJail) -> None:
        self.jails = list(jails)

    def take(self, tenant: int | None = None) -> FakeJail | None:
        self.tenant = tenant
        return self.jails.pop(0) if self.jails else None


def place(job: admission.AdmittedJob, pools: Any, session: Any = None) -> placement.Placed:
    nothing: Any = None
    return placement.place(job, "job-new", nothing, nothing, nothing, pools, session,
                           tenant=PEER.uid)


@pytest.fixture(autouse=True)
def fake_jails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "JailedJob", FakeJail)


def test_a_pooled_jail_is_taken_under_its_own_id_and_gets_its_code() -> None:
    warm: Any = FakeJail(jail_id="job-warm")
    placed = place(admitted(), {"default": FakePool(warm)})
    assert warm.assigned is placed.spec and not placed.spec.keep
    assert placed.pooled and placed.jail is warm and placed.job_id == "job-warm"
    assert placed.spec.tenant == PEER.uid  # the client's uid: whose zygote and pool


def test_an_empty_pool_means_a_fresh_jail() -> None:
    placed = place(admitted(), {"default": FakePool()})
    assert not placed.pooled and placed.job_id == "job-new"
    assert isinstance(placed.jail, FakeJail) and placed.jail.spec is placed.spec


def test_other_jail_level_limits_mean_a_fresh_jail() -> None:
    warm = FakeJail(jail_id="job-warm")
    for limits in ({"memory_mb": 64}, {"cpu_time_s": 1}):
        placed = place(admitted(**limits), {"default": FakePool(warm)})
        assert not placed.pooled and warm.assigned is None
    placed = place(admitted(wall_time_s=1), {"default": FakePool(warm)})  # a per-run limit
    assert placed.pooled


def test_a_session_run_goes_to_the_sessions_jail() -> None:
    jail: Any = FakeJail(jail_id="ses-1")
    placed = place(admitted(), {"default": FakePool(FakeJail())}, SimpleNamespace(jail=jail))
    assert placed.jail is jail and placed.job_id == "job-new" and placed.spec.keep


def test_every_placement_runs_to_record_result_and_files() -> None:
    one_shot = place(admitted(), {})
    assert asyncio.run(one_shot.run()) == ({"job_id": "job-new"}, b"r", {"f": b"x"})
    session = place(admitted(), {}, SimpleNamespace(jail=FakeJail(jail_id="ses-1")))
    assert asyncio.run(session.run()) == ({"job_id": "job-new"}, None, {})


def test_the_jobs_trace_reaches_its_jail_in_every_placement() -> None:
    trace: Any = object()  # a JobTrace, as the pipeline makes one when tracing is on
    nothing: Any = None

    def traced(pools: Any, session: Any = None) -> placement.Placed:
        return placement.place(admitted(), "job-new", nothing, nothing, nothing, pools, session,
                               tenant=PEER.uid, trace=trace)

    warm: Any = FakeJail(jail_id="job-warm")
    pooled = traced({"default": FakePool(warm)})
    assert (pooled.mode, pooled.trace, warm.trace) == ("pooled", trace, trace)
    fresh = traced({})
    assert (fresh.mode, fresh.trace) == ("fresh", trace) and fresh.jail.trace is trace  # type: ignore[attr-defined]
    jail: Any = FakeJail(jail_id="ses-1")
    in_session = traced({}, SimpleNamespace(jail=jail))
    assert in_session.mode == "session"
    asyncio.run(in_session.run())
    assert jail.trace is trace
    assert place(admitted(), {}).trace is None  # tracing off
