"""Warm pools: per policy, jails made ahead of their jobs, hardened and waiting.

Theory of operation
-------------------
A pooled jail is an ordinary :class:`~jaild.daemon.jails.job.JailedJob` that has been
prepared -- started, sent ``Harden``, its seccomp digest checked -- and stops
there, before ``RunCode``. :meth:`JailPool.take` hands one to a job, which then
sends its code; the wall-clock limit starts at that moment. Each jail serves
exactly one job and is gone afterwards. Taking one makes a replacement once that
job is over (or after ``REFILL_WAIT_S``): making a jail costs CPU, and on a small
host the job it would compete with is the one a client is waiting for.

The pool's *target* size moves between the policy's ``pool.min`` and
``pool.max``: a job that finds the pool empty (a miss) raises it by one, and a
jail that waited ``pool.idle_s`` without a job is recycled and lowers it by one.
So a burst grows the pool, quiet shrinks it back to ``min``, and no jail is
older than ``idle_s``.

A zygote's pooled jail runs a throwaway job once it is ready (the warm-up,
:func:`jaild.runtime.execute.warm_up`): the pages a job's code path writes are copied
from the zygote then, not on the job's clock. That costs the jail ~2 ms of CPU; it pays
when the jail waits for its job, and is lost when a job takes it at once. So a jail made
while jobs are missing the pool (a miss in the last ``WARM_UP_QUIET_S``) skips it: under
a flat-out load every jail is taken the moment it is ready, and CPU is what is short.

In ``daemon.zygote_scope = "uid"`` a zygote-mode policy's pool is a :class:`TenantPools`:
one pool per client uid, each of jails forked from that uid's zygote. The daemon's own
uid's pool is made at start (its zygote is too); another uid's is made when that uid's
zygote is up (its first job found none), and discarded when the zygote is retired.

Only jobs whose jail-level limits (memory, pids, CPU time and cores, file size,
open files) are the policy's own can take a pooled jail: those limits were set
when the jail was made. Other jobs get a jail made for them (a cold start).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

from jaild.daemon.core.peer import Tenant
from jaild.daemon.jails.job import JailedJob
from jaild.daemon.jails.launch.zygotes import ZygoteSet
from jaild.policy.schema import ONE_SHOT_JAIL_LIMITS, Limits, Policy

log = logging.getLogger("jaild.daemon.jails.pool")

REFILL_WAIT_S = 0.05
WARM_UP_QUIET_S = 1.0
"""A pooled jail warms up only if no job missed the pool for this long (see above)."""


def poolable(policy: Policy, limits: Limits) -> bool:
    """Can a job with ``limits`` use a jail prepared with the policy's own limits?"""
    return all(getattr(limits, n) == getattr(policy.limits, n) for n in ONE_SHOT_JAIL_LIMITS)


@dataclasses.dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    made: int = 0
    failed: int = 0
    recycled: int = 0

    def add(self, other: PoolStats) -> None:
        """Count ``other``'s events in these too."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class JailPool:
    """The warm pool of one policy.

    Its work -- jails being made, replacements waiting for a job to end, the idle sweep --
    runs in one task group, entered at :meth:`start` and left at :meth:`close`, which
    waits for all of it.
    """

    def __init__(self, policy: Policy, make: Callable[[], JailedJob]) -> None:
        self.policy = policy
        self._make = make
        self._ready: collections.deque[JailedJob] = collections.deque()
        self._preparing = 0  # jails being made now
        self.target = policy.pool.min
        self.stats = PoolStats()
        self._closing = asyncio.Event()
        self._work: asyncio.TaskGroup | None = None  # while the pool runs
        self._scope: asyncio.Task[None] | None = None  # the task that holds it
        self._consecutive_failures = 0
        self._missed_at = float("-inf")  # time.monotonic() of the last miss

    @property
    def size(self) -> int:
        """Jails ready now."""
        return len(self._ready)

    @property
    def held(self) -> int:
        """Jails that exist for the pool now: ready, or being made (each holds its memory
        limit against the daemon's ceiling before any job takes it)."""
        return len(self._ready) + self._preparing

    @property
    def total_target(self) -> int:
        """Ready jails the pool aims to keep (for every uid's pool of a :class:`TenantPools`)."""
        return self.target

    def total_stats(self) -> PoolStats:
        """The pool's counters (for a :class:`TenantPools`, every uid's pool's, retired ones
        included, so they only grow)."""
        return dataclasses.replace(self.stats)

    def ready_ids(self) -> list[str]:
        """The ids of the ready jails (each the id its job will have)."""
        return [jail.jail_id for jail in self._ready]

    def start(self) -> None:
        """Begin: make ``pool.min`` jails, and sweep the idle ones, until :meth:`close`."""
        self._scope = asyncio.get_running_loop().create_task(
            self._run(), name=f"pool {self.policy.name}"
        )

    async def _run(self) -> None:
        """The pool's life: its task group, open until :meth:`close`. A crash in its work
        (a jaild bug) is logged and ends the pool: jobs then get jails made for them."""
        try:
            async with asyncio.TaskGroup() as work:
                self._work = work
                work.create_task(self._recycle_idle())
                self._refill()
                await self._closing.wait()
        except Exception:
            log.exception("pool %s: crashed; it makes no more jails", self.policy.name)
        finally:
            self._work = None
            self._closing.set()

    def take(self, tenant: Tenant | None = None) -> JailedJob | None:
        """A ready jail for a job of uid ``tenant``, or None (the caller makes one; the pool
        grows). This pool's jails are anyone's (a :class:`TenantPools` keeps them apart)."""
        while self._ready:
            jail = self._ready.popleft()
            if jail.alive:
                self.stats.hits += 1
                if self._work is not None and not self._closing.is_set():
                    self._refill_after(jail)
                return jail
            jail.cleanup()
        self.stats.misses += 1
        self._missed_at = time.monotonic()
        if self.target < self.policy.pool.max:
            self.target += 1
        self._refill()
        return None

    def _refill_after(self, jail: JailedJob) -> None:
        """Make the replacement once the taken jail's job is over (or REFILL_WAIT_S has
        passed): making a jail costs CPU the job would otherwise wait for. (Callbacks, not a
        task: this is on every warm job's path; a second call of _refill does nothing.)"""
        timer = asyncio.get_running_loop().call_later(REFILL_WAIT_S, self._refill)

        def finished() -> None:
            timer.cancel()
            self._refill()

        jail.when_finished(finished)

    def _refill(self) -> None:
        work = self._work
        if work is None or self._closing.is_set() or self._consecutive_failures >= 3:
            return
        while len(self._ready) + self._preparing < self.target:
            self._preparing += 1
            work.create_task(self._prepare_one())

    async def _prepare_one(self) -> None:
        try:
            await self._prepare()
        finally:
            self._preparing -= 1

    async def _prepare(self) -> None:
        jail = self._make()
        if time.monotonic() - self._missed_at < WARM_UP_QUIET_S:
            jail.without_warm_up()  # jobs are waiting for jails: see the module docstring
        try:
            ready = await jail.prepare()
        except Exception:  # a jaild bug: do not spin on it
            log.exception("pool %s: preparing a jail crashed", self.policy.name)
            ready = False
        if not ready or self._closing.is_set():
            if not ready:
                self.stats.failed += 1
                self._consecutive_failures += 1
                status, error = jail.outcome()
                log.warning(
                    "pool %s: a jail failed to start (%d in a row): %s%s",
                    self.policy.name,
                    self._consecutive_failures,
                    status,
                    f" ({error.get('type')}: {error.get('message')})" if error else "",
                )
                if self._consecutive_failures < 3:
                    asyncio.get_running_loop().call_later(1.0, self._refill)
            await jail.discard("the pool does not need it")
            return
        self._consecutive_failures = 0
        self.stats.made += 1
        self._ready.append(jail)

    async def _recycle_idle(self) -> None:
        idle_s = self.policy.pool.idle_s
        while not await self._closed_within(min(idle_s / 4, 5.0)):
            now = time.monotonic()
            keep: collections.deque[JailedJob] = collections.deque()
            old: list[JailedJob] = []
            for jail in self._ready:
                if jail.ready_at is not None and now - jail.ready_at >= idle_s:
                    old.append(jail)
                elif jail.alive:
                    keep.append(jail)
                else:
                    jail.cleanup()
            self._ready = keep
            if old:
                self.stats.recycled += len(old)
                self.target = max(self.policy.pool.min, self.target - len(old))
                for jail in old:
                    await jail.discard("idle too long in the pool")
            self._consecutive_failures = 0
            self._refill()

    async def _closed_within(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if the pool is closed meanwhile; is it?"""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closing.wait()
        return self._closing.is_set()

    async def close(self) -> None:
        """Stop: the pool's work ends and is awaited (a jail being made is made, then
        discarded; the idle sweep stops; a replacement is no longer made), then the
        waiting jails are discarded. Cancelling ``close`` cancels that work."""
        self._closing.set()
        if self._scope is not None:
            await self._scope
        ready, self._ready = list(self._ready), collections.deque()
        await asyncio.gather(*(j.discard("the daemon is stopping") for j in ready))


class TenantPools(JailPool):
    """The warm pool of a zygote-mode policy in ``uid`` scope: itself the pool of the
    daemon's own uid, and one more pool per other client principal (uid or pod) whose
    zygote is up.

    ``make(uid)`` makes a jail for ``uid`` (forked from that uid's zygote); ``zygotes`` says
    whose zygote is up, and hears of every jail a job takes (use that keeps the zygote).
    It calls :meth:`retire` (an ``on_retire`` hook) before it retires a uid's zygote.
    """

    def __init__(
        self, policy: Policy, make: Callable[[Tenant], JailedJob], zygotes: ZygoteSet
    ) -> None:
        own = zygotes.own_uid
        super().__init__(policy, lambda: make(own))
        self._make_for = make
        self._own = own
        self._zygotes = zygotes
        self._tenants: dict[Tenant, JailPool] = {}
        self._retired = PoolStats()  # the counters of uids' pools that were retired
        self._retiring: list[JailPool] = []  # being closed

    @property
    def size(self) -> int:
        """Jails ready now, for every uid."""
        return super().size + sum(p.size for p in self._tenants.values())

    @property
    def held(self) -> int:
        """Jails that exist for every uid's pool now."""
        return super().held + sum(p.held for p in self._tenants.values())

    @property
    def total_target(self) -> int:
        return self.target + sum(p.target for p in self._tenants.values())

    def total_stats(self) -> PoolStats:
        stats = super().total_stats()
        stats.add(self._retired)
        for pool in [*self._tenants.values(), *self._retiring]:
            stats.add(pool.stats)
        return stats

    def ready_ids(self) -> list[str]:
        return super().ready_ids() + [i for p in self._tenants.values() for i in p.ready_ids()]

    def take(self, tenant: Tenant | None = None) -> JailedJob | None:
        """A ready jail of ``tenant``'s own, or None (the caller makes one). The first
        miss after the uid's zygote came up starts the uid's pool."""
        if tenant is None:
            return None
        if tenant == self._own:
            jail = super().take(tenant)
        elif tenant in self._tenants:
            jail = self._tenants[tenant].take(tenant)
        elif not self._closing.is_set() and self._zygotes.ready(self.policy.name, tenant):
            pool = self._tenants[tenant] = JailPool(
                self.policy, functools.partial(self._make_for, tenant)
            )
            pool.start()
            jail = pool.take(tenant)  # a miss, which makes it grow from min
        else:
            jail = None
        if jail is not None:
            self._zygotes.touch(self.policy.name, tenant)
        return jail

    async def retire(self, policy: str, tenant: Tenant) -> None:
        """``tenant``'s zygote of ``policy`` is retired: discard that uid's waiting jails.
        The own uid's pool stays, and so, while it holds jails, does its zygote."""
        pool = self._tenants.pop(tenant, None) if policy == self.policy.name else None
        if pool is not None:
            self._retiring.append(pool)  # still counted while it closes
            try:
                await pool.close()
            finally:
                self._retiring.remove(pool)
                self._retired.add(pool.stats)

    async def close(self) -> None:
        pools, self._tenants = list(self._tenants.values()), {}
        await asyncio.gather(super().close(), *(p.close() for p in pools))


__all__ = ["JailPool", "PoolStats", "TenantPools", "poolable"]
