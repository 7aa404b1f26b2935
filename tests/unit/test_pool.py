"""The warm pool's sizing rules, with stand-in jails (the real ones: tests/integration)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from jaild.policy.schema import load_policy_text
from jaild.pool import JailPool, poolable


class FakeJail:
    """What the pool uses of a JailedJob."""

    made = 0

    def __init__(self, ok: bool = True) -> None:
        FakeJail.made += 1
        self.ok = ok
        self.ready_at: float | None = None
        self.discarded = ""
        self.done = asyncio.Event()

    @property
    def alive(self) -> bool:
        return self.ready_at is not None and not self.done.is_set()

    async def prepare(self) -> bool:
        await asyncio.sleep(0)
        if self.ok:
            self.ready_at = time.monotonic()
        return self.ok

    async def finished(self) -> None:
        await self.done.wait()

    async def discard(self, reason: str) -> None:
        self.discarded = reason
        self.done.set()

    def cleanup(self) -> None:
        self.done.set()


def pool_of(text: str, make: Any = FakeJail) -> JailPool:
    return JailPool(load_policy_text(text, "p.toml"), make)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_min_jails_are_made_at_start_and_taken_jails_replaced_after_their_job() -> None:
    async def scenario() -> None:
        pool = pool_of("[pool]\nmin = 2\nmax = 4\n")
        pool.start()
        await settle()
        assert pool.size == 2 and pool.stats.made == 2
        jail = pool.take()
        assert jail is not None and pool.stats.hits == 1
        await settle()
        assert pool.size == 1  # the replacement waits for the job, not to compete with it
        jail.done.set()  # type: ignore[attr-defined]
        await settle()
        assert pool.size == 2 and pool.stats.made == 3
        await pool.close()

    asyncio.run(scenario())


def test_misses_grow_the_pool_up_to_max_and_idle_jails_shrink_it_to_min() -> None:
    async def scenario() -> None:
        pool = pool_of("[pool]\nmin = 1\nmax = 3\nidle_s = 0.2\n")
        pool.start()
        await settle()
        taken = [pool.take() for _ in range(5)]  # one hit, then misses
        assert sum(j is not None for j in taken) == 1
        assert pool.stats.misses == 4 and pool.target == 3  # grown to max, not beyond
        for j in taken:
            if j is not None:
                j.done.set()  # type: ignore[attr-defined]
        await asyncio.sleep(0.1)
        assert pool.size == 3
        await asyncio.sleep(0.5)  # idle past idle_s: recycled, the target falls back to min
        assert pool.target == 1 and pool.stats.recycled >= 2
        await asyncio.sleep(0.1)
        assert pool.size == 1
        await pool.close()

    asyncio.run(scenario())


def test_a_pool_whose_jails_fail_stops_retrying_after_three_in_a_row() -> None:
    async def scenario() -> None:
        FakeJail.made = 0
        pool = pool_of("[pool]\nmin = 2\nmax = 2\n", lambda: FakeJail(ok=False))
        pool.start()
        await asyncio.sleep(2.5)  # retries come a second apart
        assert pool.size == 0 and pool.stats.failed >= 3
        made = FakeJail.made
        await asyncio.sleep(1.5)  # no more attempts until the idle sweep (every idle_s / 4)
        assert FakeJail.made == made
        assert pool.take() is None  # jobs still run: the caller makes a jail of its own
        await pool.close()

    asyncio.run(scenario())


def test_close_discards_the_waiting_jails() -> None:
    async def scenario() -> None:
        pool = pool_of("[pool]\nmin = 2\nmax = 2\n")
        pool.start()
        await settle()
        waiting = list(pool._ready)
        await pool.close()
        assert all(j.discarded == "the daemon is stopping" for j in waiting)
        assert pool.size == 0

    asyncio.run(scenario())


def test_only_jobs_with_the_policys_own_jail_limits_use_the_pool() -> None:
    policy = load_policy_text("", "p.toml")
    assert poolable(policy, policy.limits)
    from jaild.policy.schema import effective_limits

    assert poolable(policy, effective_limits(policy, {"wall_time_s": 1, "output_bytes": 10}))
    assert not poolable(policy, effective_limits(policy, {"memory_mb": 32}))
    assert not poolable(policy, effective_limits(policy, {"cpu_time_s": 1}))
