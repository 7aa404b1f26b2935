"""The registry of live jobs, sessions and connections, without root or jails."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from jaild.daemon.core.peer import Peer, Principal
from jaild.daemon.registry import LiveJob, Registry


def conn(uid: int) -> Any:
    return SimpleNamespace(peer=Peer(pid=1, uid=uid, gid=uid))


def jail(pid: int | None = None) -> Any:
    return SimpleNamespace(pid=pid)


def session(sid: str, owner: Any) -> Any:
    return SimpleNamespace(id=sid, owner=owner)


def test_jobs_belong_to_their_connection() -> None:
    reg = Registry()
    a, b = conn(1000), conn(1001)
    reg.add_job(LiveJob("job-1", jail(11), a))
    reg.add_job(LiveJob("job-2", jail(None), b))
    assert reg.job("job-1") is not None and reg.job("job-1", owner=a) is not None
    assert reg.job("job-1", owner=b) is None  # not b's to cancel or answer
    assert [j.job_id for j in reg.jobs(owner=b)] == ["job-2"]
    assert (reg.job_count(), reg.job_count(a)) == (2, 1)
    assert list(reg.pids()) == [11]
    reg.remove_job("job-1")
    reg.remove_job("job-1")  # idempotent
    assert reg.job("job-1") is None and reg.job_count() == 1


def test_sessions_belong_to_their_connection_and_count_per_uid() -> None:
    reg = Registry()
    a, a2, b = conn(1000), conn(1000), conn(1001)
    for sess in (session("ses-1", a), session("ses-2", a2), session("ses-3", b)):
        reg.add_session(sess)
    assert reg.session("ses-1", owner=a2) is None and reg.session("ses-1", owner=a) is not None
    assert reg.session_count() == 3 and reg.session_count(1000) == 2
    assert [s.id for s in reg.sessions(owner=b)] == ["ses-3"]
    reg.remove_session(reg.sessions(owner=a)[0])
    assert reg.session_count(1000) == 1


def test_what_a_pod_holds_is_counted_by_its_pod_uid() -> None:
    """A pod's slot request is held against its jails by pod uid (admission), whatever its
    tenant key; a uid's principal of the same uid is not that pod."""
    def of_pod(pod_uid: str) -> Any:
        who = Principal("pod", 1000, pod_uid, "agents", "a", "default", slots=2)
        return SimpleNamespace(peer=Peer(pid=1, uid=1000, gid=1000, principal=who))

    reg = Registry()
    pod_a, pod_a2, pod_b, host = of_pod("uid-a"), of_pod("uid-a"), of_pod("uid-b"), conn(1000)
    reg.add_job(LiveJob("job-1", jail(), pod_a, memory_mb=64))
    reg.add_job(LiveJob("job-2", jail(), pod_b, memory_mb=64))
    reg.add_job(LiveJob("job-3", jail(), host, memory_mb=64))
    held = SimpleNamespace(id="ses-1", owner=pod_a2, holds_jail=True,
                           terms=SimpleNamespace(jail_limits=SimpleNamespace(memory_mb=128)))
    reg.add_session(held)
    assert (reg.held(pod_uid="uid-a").jails, reg.held(pod_uid="uid-a").memory_mb) == (2, 192)
    assert reg.held(pod_uid="uid-b").jails == 1
    assert reg.held(1000).jails == 1 and reg.held().jails == 4  # the uid's, everyone's


def test_drained_waits_for_jobs_and_retiring_jails() -> None:
    async def scenario() -> list[str]:
        reg = Registry()
        await reg.drained()  # nothing live: at once
        events: list[str] = []
        reg.add_job(LiveJob("job-1", jail(), conn(0)))
        waiter = asyncio.ensure_future(reg.drained())
        gate = asyncio.Event()

        async def retire() -> None:
            async with reg.retiring():
                events.append("retiring")
                gate.set()
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                events.append("retired")

        retiring = asyncio.ensure_future(retire())
        await gate.wait()
        reg.remove_job("job-1")
        await asyncio.sleep(0)
        assert not waiter.done()  # a session's jail is still being discarded
        await retiring
        await waiter
        events.append("drained")
        return events

    assert asyncio.run(scenario()) == ["retiring", "retired", "drained"]
