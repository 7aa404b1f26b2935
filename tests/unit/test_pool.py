"""The warm pool's sizing rules, with stand-in jails (the real ones: tests/integration).

The scenarios run on an event loop with a virtual clock: when nothing is ready to run, the
clock jumps to the next timer instead of waiting for it. The pool's timings (idle_s, the
retry a second after a failure, the idle sweep) are then exact whatever the host's load --
a real-time loop stalled for a moment recycles jails the scenario still counts as fresh.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import jaild.daemon.jails.pool
from jaild.daemon.jails.pool import JailPool, poolable
from jaild.policy.schema import load_policy_text


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)  # the loop's own wake-ups, if any
        if not ready and timeout is not None and timeout > 0:
            self._clock[0] += timeout  # nothing to do until the next timer: skip to it
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._clock = [1000.0]
        super().__init__(_VirtualSelector(self._clock))

    def time(self) -> float:
        return self._clock[0]


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[VirtualTimeLoop]:
    """The loop the scenarios run on; the pool's time.monotonic() is its clock."""
    virtual = VirtualTimeLoop()
    monkeypatch.setattr(jaild.daemon.jails.pool, "time", SimpleNamespace(monotonic=virtual.time))
    yield virtual
    virtual.close()


class _Done(asyncio.Event):
    """A jail's end, as JailedJob has it: an event, and callbacks called soon after it."""

    def __init__(self) -> None:
        super().__init__()
        self.callbacks: list[Any] = []

    def set(self) -> None:
        super().set()
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            asyncio.get_running_loop().call_soon(callback)


class FakeJail:
    """What the pool uses of a JailedJob."""

    made = 0

    def __init__(self, ok: bool = True) -> None:
        FakeJail.made += 1
        self.ok = ok
        self.ready_at: float | None = None
        self.discarded = ""
        self.done = _Done()
        self.warm_up = True

    def without_warm_up(self) -> None:
        self.warm_up = False

    @property
    def alive(self) -> bool:
        return self.ready_at is not None and not self.done.is_set()

    async def prepare(self) -> bool:
        await asyncio.sleep(0)
        if self.ok:
            self.ready_at = asyncio.get_running_loop().time()
        return self.ok

    def outcome(self) -> tuple[str, dict[str, Any] | None]:
        return ("ok", None) if self.ok else ("error", {"type": "JailError", "message": "no"})

    async def finished(self) -> None:
        await self.done.wait()

    def when_finished(self, callback: Any) -> None:
        if self.done.is_set():
            asyncio.get_running_loop().call_soon(callback)
        else:
            self.done.callbacks.append(callback)

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


def test_min_jails_are_made_at_start_and_taken_jails_replaced_after_their_job(loop: VirtualTimeLoop) -> None:
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

    loop.run_until_complete(scenario())


def test_misses_grow_the_pool_up_to_max_and_idle_jails_shrink_it_to_min(loop: VirtualTimeLoop) -> None:
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

    loop.run_until_complete(scenario())


def test_jails_made_while_jobs_miss_the_pool_skip_the_warm_up(loop: VirtualTimeLoop) -> None:
    made: list[FakeJail] = []

    def make() -> FakeJail:
        made.append(FakeJail())
        return made[-1]

    async def scenario() -> None:
        pool = pool_of("[pool]\nmin = 1\nmax = 3\n", make)
        pool.start()
        await settle()
        assert [j.warm_up for j in made] == [True]  # made ahead, nobody waiting
        assert pool.take() is not None
        assert pool.take() is None  # a miss: the pool grows, and is behind
        await settle()
        assert len(made) == 3 and [j.warm_up for j in made[1:]] == [False, False]
        await asyncio.sleep(jaild.daemon.jails.pool.WARM_UP_QUIET_S)
        taken = pool.take()  # a hit, after a quiet second: its replacement warms up
        assert isinstance(taken, FakeJail)
        taken.done.set()
        await settle()
        assert len(made) == 4 and made[-1].warm_up
        await pool.close()

    loop.run_until_complete(scenario())


def test_a_pool_whose_jails_fail_stops_retrying_after_three_in_a_row(
    loop: VirtualTimeLoop, caplog: pytest.LogCaptureFixture
) -> None:
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

    loop.run_until_complete(scenario())
    failed = [r.getMessage() for r in caplog.records if "failed to start" in r.getMessage()]
    assert failed and failed[0].endswith("(1 in a row): error (JailError: no)"), failed


def test_close_discards_the_waiting_jails(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        pool = pool_of("[pool]\nmin = 2\nmax = 2\n")
        pool.start()
        await settle()
        waiting = list(pool._ready)
        await pool.close()
        assert all(j.discarded == "the daemon is stopping" for j in waiting)
        assert pool.size == 0

    loop.run_until_complete(scenario())


class SlowJail(FakeJail):
    """A jail whose start waits for the scenario's word."""

    go = asyncio.Event()

    async def prepare(self) -> bool:
        await SlowJail.go.wait()
        return await super().prepare()


def test_close_waits_for_a_jail_being_made_then_discards_it(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        SlowJail.go = asyncio.Event()
        made: list[SlowJail] = []
        pool = pool_of("[pool]\nmin = 1\nmax = 1\n", lambda: made.append(SlowJail()) or made[-1])
        pool.start()
        await settle()
        assert len(made) == 1 and pool.size == 0  # being made
        closing = asyncio.ensure_future(pool.close())
        await settle()
        assert not closing.done()  # the pool's work is not abandoned
        SlowJail.go.set()
        await closing
        assert made[0].discarded == "the pool does not need it"
        # nothing of the pool is left running: its task group waited for all of it
        assert asyncio.all_tasks() == {asyncio.current_task()}

    loop.run_until_complete(scenario())


def test_close_ends_the_idle_sweep_and_the_waits_for_replacements(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        pool = pool_of("[pool]\nmin = 2\nmax = 2\nidle_s = 3600\n")
        pool.start()
        await settle()
        taken = pool.take()  # its replacement waits for its job, which never ends
        assert taken is not None
        before = loop.time()
        await pool.close()
        assert loop.time() - before < 1.0  # not the sweep's interval (5 s)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        assert pool.size == 0 and pool.stats.made == 2  # no replacement after close

    loop.run_until_complete(scenario())


def test_cancelling_close_cancels_the_pools_work(loop: VirtualTimeLoop) -> None:
    async def scenario() -> None:
        SlowJail.go = asyncio.Event()
        pool = pool_of("[pool]\nmin = 1\nmax = 1\n", SlowJail)
        pool.start()
        await settle()
        closing = asyncio.ensure_future(pool.close())
        await settle()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await settle()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    loop.run_until_complete(scenario())


def test_a_crash_in_the_pools_work_is_logged_and_ends_the_pool(
    loop: VirtualTimeLoop, caplog: pytest.LogCaptureFixture
) -> None:
    def make() -> FakeJail:
        if FakeJail.made >= 1:
            raise ValueError("a jaild bug")
        return FakeJail()

    async def scenario() -> None:
        FakeJail.made = 0
        pool = pool_of("[pool]\nmin = 1\nmax = 2\n", make)
        pool.start()
        await settle()
        assert pool.take() is not None and pool.size == 0
        assert pool.take() is None  # a miss: the pool grows, and making the jail crashes
        await settle()
        assert "pool p: crashed" in caplog.text and "a jaild bug" in caplog.text
        assert pool.take() is None and pool.target == 2  # jobs get jails of their own
        await asyncio.sleep(10)
        assert FakeJail.made == 1  # and the pool makes no more
        await pool.close()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    loop.run_until_complete(scenario())


def test_only_jobs_with_the_policys_own_jail_limits_use_the_pool() -> None:
    policy = load_policy_text("", "p.toml")
    assert poolable(policy, policy.limits)
    from jaild.policy.schema import effective_limits

    assert poolable(policy, effective_limits(policy, {"wall_time_s": 1, "output_bytes": 10}))
    assert not poolable(policy, effective_limits(policy, {"memory_mb": 32}))
    assert not poolable(policy, effective_limits(policy, {"cpu_time_s": 1}))
