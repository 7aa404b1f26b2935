"""Zygotes per (policy, client uid), and warm pools per uid, with stand-in zygotes and jails
(the real ones: tests/hostile/test_zygote_tenancy.py). On the virtual clock of test_pool."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import jaild.daemon.jails.launch.zygotes
import jaild.daemon.jails.pool
from jaild.daemon.jails.launch.zygotes import ZygoteSet
from jaild.daemon.jails.pool import TenantPools
from jaild.policy.schema import Policy, load_policy_text
from tests.unit.test_pool import FakeJail, VirtualTimeLoop, settle

POLICY = load_policy_text('[pool]\nmode = "zygote"\nmin = 1\nmax = 1\n', "z.toml")
OWN, A, B = 0, 1000, 1001


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[VirtualTimeLoop]:
    virtual = VirtualTimeLoop()
    clock = SimpleNamespace(monotonic=virtual.time)
    monkeypatch.setattr(jaild.daemon.jails.launch.zygotes, "time", clock)
    monkeypatch.setattr(jaild.daemon.jails.pool, "time", clock)
    yield virtual
    virtual.close()


class FakeZygote:
    """What the zygote set uses of a Zygote."""

    def __init__(self, policy: Policy, tenant: int | None) -> None:
        self.policy, self.tenant = policy, tenant
        self.alive = False
        self.stopped = False
        self.jails = 0
        self.pid = 100 + (tenant or 0)

    async def ensure_started(self) -> None:
        await asyncio.sleep(0.5)  # a zygote takes a while to come up
        self.alive = not self.stopped

    def stop(self) -> None:
        self.stopped, self.alive = True, False


def zygote_set(**kwargs: Any) -> tuple[ZygoteSet, list[FakeZygote]]:
    made: list[FakeZygote] = []

    def make(policy: Policy, tenant: int | None) -> Any:
        made.append(FakeZygote(policy, tenant))
        return made[-1]

    zygotes = ZygoteSet(make, own_uid=OWN, **kwargs)
    zygotes.serve(POLICY)
    return zygotes, made


def test_a_uids_first_job_is_spawned_while_its_own_zygote_starts(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        zygotes, made = zygote_set()
        await zygotes.start(POLICY.name)  # start-up: the daemon's own uid's
        zygotes.run()
        assert zygotes.for_job(POLICY, OWN, pooled=False) is made[0]
        assert zygotes.for_job(POLICY, A, pooled=False) is None  # spawned; A's starts
        assert zygotes.for_job(POLICY, A, pooled=False) is None  # not started twice
        await asyncio.sleep(1)
        a = zygotes.for_job(POLICY, A, pooled=False)
        assert a is made[1] and a.tenant == A and len(made) == 2
        # B is never given A's zygote, nor root's: it gets a spawned jail, and its own zygote
        assert zygotes.for_job(POLICY, B, pooled=False) is None
        await asyncio.sleep(1)
        b = zygotes.for_job(POLICY, B, pooled=False)
        assert b is made[2] and b.tenant == B and b is not a
        # a job whose uid is unknown is never forked
        assert zygotes.for_job(POLICY, None, pooled=False) is None and len(made) == 3
        zygotes.stop_all()
        await zygotes.close()
        assert all(z.stopped for z in made)

    loop.run_until_complete(scenario())


def test_policy_scope_shares_one_zygote_between_uids(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        zygotes, made = zygote_set(scope="policy")
        await zygotes.start(POLICY.name)
        zygotes.run()
        assert zygotes.for_job(POLICY, A, pooled=False) is made[0]
        assert zygotes.for_job(POLICY, B, pooled=False) is made[0]
        assert zygotes.for_job(POLICY, None, pooled=False) is made[0] and len(made) == 1
        zygotes.stop_all()
        await zygotes.close()

    loop.run_until_complete(scenario())


def test_an_idle_uids_zygote_is_retired_once_no_jail_of_it_runs(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        zygotes, made = zygote_set(idle_s=10)
        retired: list[tuple[str, int]] = []

        async def hook(policy: str, uid: int) -> None:
            retired.append((policy, uid))

        zygotes.on_retire(hook)
        zygotes.run()
        zygotes.for_job(POLICY, A, pooled=False)
        await asyncio.sleep(1)
        a = made[0]
        a.jails = 1  # a job runs: past idle_s its pool is emptied, but it stays
        await asyncio.sleep(12)
        assert retired and retired[0] == (POLICY.name, A) and not a.stopped
        a.jails = 0
        await asyncio.sleep(6)
        assert a.stopped and zygotes.get(POLICY.name, A) is None
        # a pooled jail made for A is no use of A's zygote: it does not keep it
        assert zygotes.for_job(POLICY, A, pooled=True) is None
        zygotes.stop_all()
        await zygotes.close()

    loop.run_until_complete(scenario())


def test_the_daemons_own_zygote_is_never_retired_when_idle(loop: VirtualTimeLoop) -> None:
    # A policy without a warm pool: no jail of the own zygote waits, and no job comes. A
    # client uid's zygote as idle is retired (the control); the daemon's own stays.
    async def scenario() -> None:
        zygotes, made = zygote_set(idle_s=10)
        await zygotes.start(POLICY.name)
        zygotes.run()
        zygotes.for_job(POLICY, A, pooled=False)
        await asyncio.sleep(60)
        own, a = made
        assert a.stopped and zygotes.get(POLICY.name, A) is None
        assert not own.stopped and zygotes.for_job(POLICY, OWN, pooled=False) is own
        zygotes.stop_all()
        await zygotes.close()

    loop.run_until_complete(scenario())


def test_at_max_zygotes_the_least_used_idle_one_goes_or_the_job_is_spawned(
        loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        zygotes, made = zygote_set(max_zygotes=1)
        await zygotes.start(POLICY.name)
        zygotes.run()
        own = made[0]  # the daemon's own: not counted, never made to go
        zygotes.for_job(POLICY, A, pooled=False)
        await asyncio.sleep(1)
        a = made[1]
        a.jails = 1  # A's job runs
        assert zygotes.for_job(POLICY, B, pooled=False) is None
        await asyncio.sleep(1)
        assert len(made) == 2 and not a.stopped  # at the cap, none could go: B is spawned
        a.jails = 0
        assert zygotes.for_job(POLICY, B, pooled=False) is None
        await asyncio.sleep(1)
        assert a.stopped and made[2].tenant == B  # A (idle, least used) made room for B
        assert not own.stopped
        assert zygotes.for_job(POLICY, B, pooled=False) is made[2]
        zygotes.stop_all()
        await zygotes.close()

    loop.run_until_complete(scenario())


def test_each_uid_takes_only_jails_of_its_own_pool(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        made: list[int | None] = []
        up = {OWN}

        def make(uid: int | None) -> Any:
            made.append(uid)
            jail = FakeJail()
            jail.uid = uid  # type: ignore[attr-defined]
            return jail

        touched: list[int | None] = []
        zygotes: Any = SimpleNamespace(
            own_uid=OWN,
            ready=lambda policy, uid: uid in up,
            touch=lambda policy, uid: touched.append(uid),
        )
        pools = TenantPools(POLICY, make, zygotes)
        pools.start()
        await settle()
        assert made == [OWN] and pools.size == 1
        assert pools.take(None) is None and pools.take(A) is None  # A's zygote is not up
        assert made == [OWN]
        up.add(A)
        assert pools.take(A) is None  # a miss: A's pool starts
        await settle()
        assert made == [OWN, A] and pools.size == 2
        mine = pools.take(A)
        assert mine is not None and mine.uid == A  # type: ignore[attr-defined]
        root = pools.take(OWN)
        assert root is not None and root.uid == OWN  # type: ignore[attr-defined]
        assert touched == [A, OWN]  # a pooled jail taken is use of its uid's zygote
        assert pools.take(B) is None  # B's zygote is not up: nothing of A's or root's
        # jaild policies and the metrics count every uid's pool (root's alone: 1 hit)
        totals = pools.total_stats()
        assert (totals.hits, totals.made) == (2, 2) and pools.total_target == 2
        assert pools.stats.hits == 1
        await pools.retire(POLICY.name, A)  # A's zygote is retired: its pool goes
        up.discard(A)
        # ... and its counters stay counted (Prometheus counters never go down)
        assert pools.total_stats().hits >= totals.hits and pools.total_target == 1
        assert pools.take(A) is None
        await pools.close()

    loop.run_until_complete(scenario())
