"""jaild.fleet without root: the placement rules alone (pure), the tools' attempt wrapper,
and the fleet itself over in-memory daemons (:mod:`jaild.testing`: the real daemon core,
its admission and its ``Busy`` answers, with fake jails).

A node is "killed" here by shutting down the client's ends of its socketpairs (the client
reads the end of its stream, as from a daemon that died) and refusing every new connection
to it; the real kill -9 is tests/integration/test_fleet.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import random
import re
import socket
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import pytest

from jaild.client import AsyncClient
from jaild.daemon.config import DaemonConfig
from jaild.errors import (
    Busy,
    DaemonUnavailable,
    NodeLost,
    SessionLost,
    UnknownPolicy,
    UnknownSnapshot,
)
from jaild.fleet import (
    COOL_MAX_S,
    COOL_MIN_S,
    RETRY_MAX_S,
    RETRY_MIN_S,
    AsyncFleet,
    Slot,
    choose,
    cool_down_s,
    current_attempt,
    for_attempt,
    retry_delay_s,
    split_ref,
    state_ref,
)
from jaild.testing import FakeDaemon, fake_daemon
from jaild.toolspec import normalize_tools, tool
from tests.conftest import guard

POLICY = "[limits]\nwall_time_s = 20\ntool_call_timeout_s = 20\n"

# ----------------------------------------------------------------------------- placement


def slots(*loads: int) -> list[Slot]:
    out = []
    for i, load in enumerate(loads):
        s = Slot(i, f"node{i}", state="up")
        s.in_flight = load
        out.append(s)
    return out


def test_choose_takes_the_least_loaded_slot() -> None:
    rng = random.Random(1)
    picked = {choose(slots(3, 1, 2), set(), 0.0, rng).index for _ in range(50)}  # type: ignore[union-attr]
    assert picked == {1}


def test_choose_breaks_ties_at_random() -> None:
    rng = random.Random(1)
    picks = Counter(choose(slots(1, 0, 0, 5), set(), 0.0, rng).index  # type: ignore[union-attr]
                    for _ in range(400))
    assert set(picks) == {1, 2}  # both tied slots, never the loaded ones
    assert min(picks.values()) > 100  # neither is favoured (binomial: p of failing ~1e-20)


@dataclasses.dataclass(eq=False)
class OpenSession:
    closed: str | None


def test_choose_skips_slots_down_or_refused_and_counts_sessions_as_load() -> None:
    rng = random.Random(1)
    s = slots(0, 0, 1)
    s[0].state = "down"
    s[1].sessions.update(OpenSession(None) for _ in range(2))  # type: ignore[misc]
    s[2].sessions.add(OpenSession("idle"))  # type: ignore[arg-type]  # ended: no jail held
    assert choose(s, set(), 0.0, rng) is s[2]  # 1 job in flight < 2 sessions
    assert choose(s, {2}, 0.0, rng) is s[1]
    assert choose(s, {1, 2}, 0.0, rng) is None


def test_a_slot_cooling_down_after_busy_is_ranked_after_every_other() -> None:
    rng = random.Random(1)
    s = slots(0, 5)
    s[0].refused(now=10.0)  # a draining daemon: no load, but it said Busy
    assert s[0].cool_until == 10.0 + COOL_MIN_S
    assert choose(s, set(), 10.0, rng) is s[1]
    assert choose(s, {1}, 10.0, rng) is s[0]  # still tried when nothing else is left
    assert choose(s, set(), 10.0 + COOL_MIN_S, rng) is s[0]  # cooled down: by load again


def test_cool_down_doubles_with_refusals_in_a_row_and_acceptance_clears_it() -> None:
    assert [cool_down_s(n) for n in (1, 2, 3)] == [COOL_MIN_S, 2 * COOL_MIN_S, 4 * COOL_MIN_S]
    assert cool_down_s(50) == COOL_MAX_S
    s = Slot(0, "n", state="up")
    for _ in range(3):
        s.refused(now=0.0)
    assert (s.refused_busy, s.refusals_in_a_row, s.cool_until) == (3, 3, 4 * COOL_MIN_S)
    s.accepted()
    assert (s.placed, s.refusals_in_a_row, s.cool_until, s.refused_busy) == (1, 0, 0.0, 3)


def test_a_refused_job_waits_longer_each_round_up_to_a_cap() -> None:
    assert [retry_delay_s(r) for r in range(3)] == [RETRY_MIN_S, 2 * RETRY_MIN_S, 4 * RETRY_MIN_S]
    assert retry_delay_s(40) == RETRY_MAX_S


# ----------------------------------------------------------------------------- the attempt


def lookup(query: str, limit: int = 3, *, exact: bool = False) -> list[str]:
    """Look a word up."""
    return [f"{query}:{current_attempt()}"] * limit


async def alookup(query: list[str] | None, mode: Literal["a", "b"] = "a") -> int:
    """Look words up, asynchronously."""
    await asyncio.sleep(0)
    return current_attempt()


@tool(approval=True, timeout_s=5, name="guarded")
def marked(x: int) -> int:
    """Needs approval."""
    return current_attempt() + x


def test_the_attempt_wrapper_keeps_every_tool_spec_as_it_was() -> None:
    tools = normalize_tools([lookup, alookup, marked])
    wrapped = for_attempt(tools, 2)
    for name, original in tools.items():
        assert wrapped[name].spec() == original.spec(), name
        assert wrapped[name].is_async == original.is_async, name
        assert wrapped[name].handler is not original.handler
        # the wrapper itself still reads as the function: described again from it (toolspec
        # introspects the signature, the type hints and the docstring), the same schema
        again = normalize_tools({name: wrapped[name].handler})[name]
        assert (again.description, again.parameters) == (original.description,
                                                         original.parameters), name
        assert inspect.signature(wrapped[name].handler) == inspect.signature(original.handler)
    assert (wrapped["guarded"].approval, wrapped["guarded"].timeout_s) == (True, 5)


def test_tool_handlers_see_their_attempt_plain_in_a_worker_thread_or_async() -> None:
    assert current_attempt() == 1  # outside a fleet's handler
    tools = for_attempt(normalize_tools([lookup, alookup]), 3)

    async def main() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as AsyncClient runs it
            plain = await loop.run_in_executor(pool, lambda: tools["lookup"].handler("q", 1))
        return plain, await tools["alookup"].handler(None)

    assert asyncio.run(main()) == (["q:3"], 3)
    assert current_attempt() == 1  # set for the call only


# ----------------------------------------------------------------------------- constructor


def test_the_constructor_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="at least one endpoint"):
        AsyncFleet([])
    with pytest.raises(ValueError, match="at least one per endpoint"):
        AsyncFleet(["a", "b", "c"], connections=2)
    with pytest.raises(ValueError, match="max_attempts"):
        AsyncFleet(["a"], max_attempts=0)
    with pytest.raises(TypeError, match="not one string"):
        AsyncFleet("/run/jaild/jaild.sock")
    with pytest.raises(TypeError, match="not both"):
        AsyncFleet(["a"], client_factory=AsyncClient, name="x")
    # the clients' options wrong for an endpoint: named now, not an InvalidStateError later
    with pytest.raises(ValueError, match=re.escape(
            "fleet endpoint 'tls://127.0.0.1:9': a tls:// address needs this client's")):
        AsyncFleet(["tls://127.0.0.1:9"])
    with pytest.raises(ValueError, match=re.escape(
            "fleet endpoint '/run/x.sock': cert, key, ca and tls are for a tls:// address")):
        AsyncFleet(["/run/x.sock", "tls://127.0.0.1:9"], cert="/c.pem", key="/k.pem")
    assert len(AsyncFleet(["a"]).stats()) == 3  # one load-balanced address: 3 connections
    assert [s.endpoint for s in AsyncFleet(["a", "b"], connections=4).stats()] == [
        "a", "b", "a", "b"]


# ----------------------------------------------------------------------------- in memory


class Nodes:
    """Fake daemons by name, the fleet's ``client_factory`` for them, and a way to kill one."""

    def __init__(self, fakes: dict[str, FakeDaemon]) -> None:
        self.fakes = fakes
        self.dead: set[str] = set()
        self.sockets: dict[str, list[socket.socket]] = defaultdict(list)

    def client(self, endpoint: str) -> AsyncClient:
        if endpoint in self.dead:  # nobody listens there: DaemonUnavailable on connect
            return AsyncClient(f"/nonexistent/jaild-test/{endpoint}.sock")
        sock = self.fakes[endpoint].raw_connection()
        self.sockets[endpoint].append(sock)
        return AsyncClient(endpoint, sock=sock)

    def kill(self, endpoint: str) -> None:
        """The node dies: its connections read the end of their streams; none is made again."""
        self.dead.add(endpoint)
        for sock in self.sockets.pop(endpoint, []):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def running(self, endpoint: str) -> int:
        """Jobs the node's daemon itself holds now."""
        return len(self.fakes[endpoint].daemon.registry.jobs())


@contextlib.asynccontextmanager
async def nodes(*names: str, configs: dict[str, DaemonConfig] | None = None
                ) -> AsyncIterator[Nodes]:
    async with contextlib.AsyncExitStack() as stack:
        fakes = {}
        for name in names:
            config = (configs or {}).get(name)
            fakes[name] = await stack.enter_async_context(
                fake_daemon({"default": POLICY}, config=config))
        yield Nodes(fakes)


def tiny(max_jobs: int) -> DaemonConfig:
    return DaemonConfig(socket_path="<jaild.testing>", probe_policies=False, max_jobs=max_jobs)


class Held:
    """A tool that holds each job in its call until released; it counts calls per nonce and
    notes the attempt each call saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: Counter[str] = Counter()
        self.attempts: dict[str, list[int]] = defaultdict(list)

    async def hold(self, nonce: str) -> int:
        """Hold the job."""
        self.calls[nonce] += 1
        self.attempts[nonce].append(current_attempt())
        await self.release.wait()
        return current_attempt()

    def code(self, nonce: str) -> str:
        return f"await tools.hold(nonce={nonce!r})"


async def until(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    """Wait for ``condition()``; ``timeout`` is a liveness guard only."""
    try:
        async with asyncio.timeout(guard(timeout)):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what} did not happen within {guard(timeout)} s") from None


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        async with asyncio.timeout(guard(120)):
            await test()

    asyncio.run(main())


def test_jobs_in_flight_spread_evenly_over_the_nodes() -> None:
    async def test() -> None:
        held = Held()
        async with nodes("a", "b", "c") as n, AsyncFleet(
                ["a", "b", "c"], client_factory=n.client) as fleet:
            jobs = await asyncio.gather(*(fleet.submit(held.code(str(i)), tools=[held.hold])
                                          for i in range(6)))
            await until(lambda: len(held.calls) == 6, "every job in its tool call")
            # the daemons' own count, not the fleet's: two each
            assert [n.running(x) for x in "abc"] == [2, 2, 2]
            assert sorted(j.node for j in jobs) == ["a", "a", "b", "b", "c", "c"]
            assert [s.in_flight for s in fleet.stats()] == [2, 2, 2]
            held.release.set()
            results = [await j.result() for j in jobs]
            assert {(r.status, r.result, r.attempt) for r in results} == {("ok", 1, 1)}
            assert [(s.in_flight, s.placed) for s in fleet.stats()] == [(0, 2)] * 3

    run(test)


def test_a_busy_node_s_jobs_go_to_the_others() -> None:
    async def test() -> None:
        held = Held()
        async with nodes("full", "free", configs={"full": tiny(1)}) as n, AsyncFleet(
                ["full", "free"], client_factory=n.client) as fleet:
            jobs = [await fleet.submit(held.code(str(i)), tools=[held.hold]) for i in range(4)]
            await until(lambda: len(held.calls) == 4, "every job in its tool call")
            assert (n.running("full"), n.running("free")) == (1, 3)
            full = fleet.stats()[0]
            assert full.refused_busy >= 1 and full.placed == 1
            held.release.set()
            assert [(await j.result()).status for j in jobs] == ["ok"] * 4

    run(test)


def test_when_every_node_is_busy_a_job_waits_then_raises_the_busy() -> None:
    async def test() -> None:
        held = Held()
        async with nodes("full", configs={"full": tiny(1)}) as n, AsyncFleet(
                ["full"], connections=1, client_factory=n.client, place_timeout_s=0.3) as fleet:
            first = await fleet.submit(held.code("first"), tools=[held.hold])
            with pytest.raises(Busy, match=r"limits\.max_jobs"):
                await fleet.run("1")
            refused = fleet.stats()[0].refused_busy
            assert refused >= 1
            # the control: a job that waits while the node is full is placed once the
            # node has room, within its place_timeout_s
            fleet.place_timeout_s = guard(60)
            waiting = asyncio.ensure_future(fleet.run("2 + 2"))
            await until(lambda: fleet.stats()[0].refused_busy > refused, "a refusal")
            held.release.set()
            assert (await first.result()).status == "ok"
            r = await waiting
            assert (r.status, r.result, r.node) == ("ok", 4, "full")

    run(test)


def test_other_refusals_are_raised_at_once() -> None:
    async def test() -> None:
        async with nodes("a", "b") as n, AsyncFleet(
                ["a", "b"], client_factory=n.client, place_timeout_s=guard(600)) as fleet:
            with pytest.raises(UnknownPolicy):
                await fleet.run("1", policy="nonesuch")
            assert sum(s.refused_busy for s in fleet.stats()) == 0

    run(test)


def test_a_lost_node_s_jobs_raise_node_lost_or_run_again_if_idempotent() -> None:
    async def test() -> None:
        held = Held()
        async with nodes("a", "b") as n:
            n.dead.add("b")  # every job on a, first
            async with AsyncFleet(["a", "b"], client_factory=n.client) as fleet:
                once = await fleet.submit(held.code("once"), tools=[held.hold])
                again = await fleet.submit(held.code("again"), tools=[held.hold],
                                           idempotent=True)
                await until(lambda: len(held.calls) == 2, "both jobs in their tool calls")
                assert (once.node, again.node) == ("a", "a")
                n.dead.discard("b")
                await until(lambda: fleet.stats()[1].state == "up", "b connected")
                n.kill("a")
                with pytest.raises(NodeLost) as lost:
                    await once.result()
                assert lost.value.node == "a" and "not run again" in lost.value.message
                await until(lambda: held.calls["again"] == 2, "the idempotent job's attempt 2")
                held.release.set()
                r = await again.result()
                assert (r.status, r.result, r.attempt, r.node) == ("ok", 2, 2, "b")
                assert (again.attempt, again.node) == (2, "b")
                assert held.calls == {"once": 1, "again": 2}  # never re-run: once
                assert held.attempts["again"] == [1, 2]
                a = fleet.stats()[0]
                assert (a.jobs_lost, a.connections_lost, a.state) == (2, 1, "down")

    run(test)


def test_an_idempotent_job_is_run_at_most_max_attempts_times() -> None:
    async def test() -> None:
        held = Held()
        async with nodes("a", "b") as n:
            n.dead.add("b")
            async with AsyncFleet(["a", "b"], client_factory=n.client, max_attempts=1) as fleet:
                job = await fleet.submit(held.code("x"), tools=[held.hold], idempotent=True)
                await until(lambda: held.calls["x"] == 1, "the job in its tool call")
                n.dead.discard("b")
                await until(lambda: fleet.stats()[1].state == "up", "b connected")
                n.kill("a")
                with pytest.raises(NodeLost, match="attempt 1 of 1"):
                    await job.result()
                assert held.calls["x"] == 1

    run(test)


def test_a_session_on_a_lost_node_raises_session_lost_the_others_go_on() -> None:
    async def test() -> None:
        held = Held()
        async with nodes("a", "b") as n, AsyncFleet(["a", "b"], client_factory=n.client) as fleet:
            s1 = await fleet.session(tools=[held.hold]).open()
            s2 = await fleet.session(tools=[held.hold]).open()  # the least loaded: the other
            assert {s1.node, s2.node} == {"a", "b"}
            await s1.run("x = 1")
            await s2.run("x = 2")
            doomed, kept = (s1, s2) if s1.node == "a" else (s2, s1)
            in_flight = await doomed.submit(held.code("run"))
            await until(lambda: held.calls["run"] == 1, "the session's run in its tool call")
            n.kill("a")
            with pytest.raises(SessionLost) as lost:  # the run in flight
                await in_flight.result()
            assert lost.value.node == "a"
            with pytest.raises(SessionLost) as lost:  # and the next
                await doomed.run("x")
            assert lost.value.node == "a"
            assert doomed.closed == "lost"
            assert (await kept.run("x")).result == (2 if kept is s2 else 1)
            await kept.close()
            held.release.set()

    run(test)


def test_a_draining_node_gets_no_new_jobs() -> None:
    async def test() -> None:
        held = Held()
        async with nodes("draining", "b") as n, AsyncFleet(
                ["draining", "b"], client_factory=n.client) as fleet:
            assert (await fleet.run("1")).status == "ok"  # both serve
            drain = asyncio.ensure_future(n.fakes["draining"].daemon.drain(30))
            await until(lambda: n.fakes["draining"].daemon._draining is not None, "the drain")
            # a job held on b: the least-loaded node is then the draining one, so the fleet
            # asks it first (unless it already refused this job) -- a tie would be broken at
            # random, and four jobs could all go to b without asking it
            on_b = await fleet.submit(held.code("b"), tools=[held.hold])
            await until(lambda: held.calls["b"] == 1, "the held job in its tool call")
            assert on_b.node == "b"
            results = [await fleet.run("6 * 7") for _ in range(4)]
            assert {(r.node, r.result) for r in results} == {("b", 42)}
            assert fleet.stats()[0].refused_busy >= 1  # asked, and it refused
            held.release.set()
            assert (await on_b.result()).status == "ok"
            await drain

    run(test)


def test_a_name_becomes_one_endpoint_per_address_it_resolves_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from jaild.fleet import endpoints_of

    found = endpoints_of("tls://localhost:7443")  # /etc/hosts: 127.0.0.1, perhaps ::1 too
    assert "tls://127.0.0.1:7443" in found
    assert len(found) == len(set(found))
    assert endpoints_of("tls://127.0.0.1:7443") == ["tls://127.0.0.1:7443"]  # an address
    assert endpoints_of("/run/jaild/jaild.sock") == ["/run/jaild/jaild.sock"]  # not a name
    def nothing(*args: object, **kwargs: object) -> None:  # no lookup leaves this machine
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nothing)
    with pytest.raises(DaemonUnavailable, match="does not resolve"):
        endpoints_of("tls://jaild.agents.svc:7443")


def test_a_factory_that_fails_closes_its_connection_and_the_fleet_names_why() -> None:
    """A client_factory raising (its own mistake) is not retried forever nor lost in the
    task group: the connection closes with the error, and a fleet with no other says it."""
    def broken(endpoint: str) -> AsyncClient:
        raise ValueError(f"no way to reach {endpoint}")

    async def main() -> str:
        fleet = AsyncFleet(["x"], client_factory=broken)
        with pytest.raises(DaemonUnavailable) as refused:
            await fleet.connect()
        assert [s.state for s in fleet.stats()] == ["closed"] * 3
        return refused.value.message

    assert "no way to reach x" in asyncio.run(main())


def test_a_fleet_follows_discovery_and_retires_a_node_only_once_its_work_ends() -> None:
    """``discover=``: a node that appears takes work; a node that leaves discovery takes no
    new work, its held job ends where it runs (run once, not again), then its connection
    closes. Without discover the fleet keeps what it was given (the control)."""
    async def test() -> None:
        held = Held()
        found = ["a"]
        async with nodes("a", "b") as n, AsyncFleet(
                ["a"], client_factory=n.client, discover=lambda: list(found),
                rediscover_s=0.05) as fleet:
            on_a = await fleet.submit(held.code("a"), tools=[held.hold])
            await until(lambda: held.calls["a"] == 1, "the job on a in its tool call")
            found[:] = ["b"]  # a rollout: a's pod replaced by b
            await until(lambda: any(s.endpoint == "b" and s.state == "up"
                                    for s in fleet.stats()), "b connected")
            results = [await fleet.run("6 * 7") for _ in range(3)]
            assert {(r.node, r.result) for r in results} == {("b", 42)}
            assert [s.state for s in fleet.stats() if s.endpoint == "a"] == ["up"]  # still busy
            held.release.set()
            done = await on_a.result()
            assert (done.status, done.node, done.attempt) == ("ok", "a", 1)
            assert held.calls["a"] == 1  # run once, not again because a was retired
            await until(lambda: [s.state for s in fleet.stats() if s.endpoint == "a"]
                        == ["closed"], "a's connection closed once its job ended")
            assert fleet.endpoints == ("b",)
        async with nodes("a", "b") as n, AsyncFleet(["a"], client_factory=n.client) as still:
            await asyncio.sleep(0.2)  # the control: nothing is asked, nothing changes
            assert [s.endpoint for s in still.stats()] == ["a"] * 3

    run(test)


def test_discovery_that_fails_or_finds_nothing_keeps_the_endpoints() -> None:
    async def test() -> None:
        calls = 0

        def flaky() -> list[str]:
            nonlocal calls
            calls += 1
            if calls % 2:
                raise OSError("name does not resolve")
            return []

        async with nodes("a") as n, AsyncFleet(["a"], client_factory=n.client, discover=flaky,
                                               rediscover_s=0.02) as fleet:
            await until(lambda: calls >= 4, "discovery asked a few times")
            assert (await fleet.run("1")).result == 1
            assert [(s.endpoint, s.state) for s in fleet.stats()] == [("a", "up")]
        with pytest.raises(TypeError, match="discover= or connections="):
            AsyncFleet(["a"], discover=flaky, connections=2)

    run(test)


# ----------------------------------------------------------------------------- state on nodes


def test_a_reference_names_the_node_and_a_bare_id_is_refused() -> None:
    assert split_ref(state_ref("snap-0f3a", "node-a")) == ("snap-0f3a", "node-a")
    assert split_ref(state_ref("job-1", "tls://10.0.0.7:7070")) == ("job-1", "tls://10.0.0.7:7070")
    for bare in ("snap-0f3a", "@node-a", "snap-0f3a@"):
        with pytest.raises(ValueError, match="ID@NODE"):
            split_ref(bare)


def test_state_on_a_node_with_no_connection_is_unavailable_naming_the_node() -> None:
    """The fleet waits ``place_timeout_s`` for a connection to the node that holds the state,
    then names it and the nodes it does have; the control: the node it is connected to is
    reached at once (a fake daemon names its node as its config says)."""

    async def test() -> None:
        config = DaemonConfig(socket_path="<jaild.testing>", probe_policies=False,
                              node_name="node-a")
        snap = "snap-" + "0" * 32
        async with nodes("a", configs={"a": config}) as n, AsyncFleet(
                ["a"], connections=1, client_factory=n.client, place_timeout_s=0.2) as fleet:
            assert await fleet.snapshots() == []
            assert await fleet.approvals() == []
            with pytest.raises(DaemonUnavailable, match=re.escape(
                    f"node node-b, which holds snapshot {snap}, has no connection of the fleet "
                    "up within 0.2 s (nodes connected: node-a)")):
                await fleet.delete_snapshot(f"{snap}@node-b")
            with pytest.raises(UnknownSnapshot):  # reached: it has no such snapshot
                await fleet.delete_snapshot(f"{snap}@node-a")

    run(test)
