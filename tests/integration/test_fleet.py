"""jaild.fleet against real daemons on real Unix sockets: spreading (with its control, one
connection's jobs all on one daemon), a full node, ``kill -9`` of a node with jobs and
sessions on it, and a draining node.

Where a job ran is the daemons' word, never the fleet's: the audit line of the job in the
daemon's log, or the daemon's own list of running jobs (``jobs()``). Jobs are held in a
tool call (released by the test) wherever the test needs them in flight at a moment.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.errors import Busy, NodeLost, SessionLost
from jaild.fleet import Fleet, current_attempt
from tests.conftest import DaemonHandle, guard, until, wait_listening

POLICIES = {"default": "[limits]\nwall_time_s = 30\n"}

Factory = Callable[..., DaemonHandle]


def daemons(private_daemon: Factory, tmp_path: Path, *configs: str) -> list[DaemonHandle]:
    """One daemon per config (``jaild.toml`` text; "" for none), started side by side, each
    serving only ``default``."""
    handles = []
    for i, text in enumerate(configs):
        args: tuple[str, ...] = ()
        if text:
            path = tmp_path / f"jaild{i}.toml"
            path.write_text(text)
            args = ("--config", str(path))
        handles.append(private_daemon(POLICIES, with_repo_policies=False, args=args, wait=False))
    for handle in handles:
        wait_listening(handle.socket, handle.proc, handle.log_path)
        handle.subtree_dirs  # noqa: B018 -- where it placed itself, remembered while it runs
    return handles


def ran_on(handles: list[DaemonHandle], job_id: str) -> int:
    """The index of the daemon whose audit log has ``job_id``'s end (exactly one has)."""
    where = [i for i, h in enumerate(handles) if h.audited(job_id) is not None]
    assert len(where) == 1, (job_id, where)
    return where[0]


def running(handle: DaemonHandle) -> set[str]:
    """The job ids the daemon runs now, as it says (root sees every uid's)."""
    with Client(handle.socket) as c:
        return {j["id"] for j in c.jobs() if j["kind"] == "job"}


class Held:
    """A tool that holds each job in its call until released; it counts calls per nonce and
    notes the attempt each call saw (a plain handler: it runs in a worker thread)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.attempts: dict[str, list[int]] = defaultdict(list)

    def hold(self, nonce: str) -> int:
        """Hold the job until the test releases it."""
        with self.lock:
            self.calls[nonce] += 1
            self.attempts[nonce].append(current_attempt())
        self.release.wait(guard(60))
        return current_attempt()

    @staticmethod
    def code(nonce: str) -> str:
        return f"await tools.hold(nonce={nonce!r})"


def test_a_fleet_spreads_the_jobs_one_connection_pins_to_one_daemon(
    private_daemon: Factory, tmp_path: Path
) -> None:
    ds = daemons(private_daemon, tmp_path, "", "", "")
    # the control: one client's jobs all run on the daemon at its connection's end
    with Client(ds[0].socket) as c:
        jobs = [c.submit("6 * 7") for _ in range(30)]
        assert [j.result(guard(60)).result for j in jobs] == [42] * 30
    assert Counter(ran_on(ds, j.job_id) for j in jobs) == {0: 30}
    with Fleet([d.socket for d in ds]) as fleet:
        submitted = [fleet.submit("6 * 7") for _ in range(30)]
        results = [j.result(guard(60)) for j in submitted]
        placed = [s.placed for s in fleet.stats()]
    assert {(r.status, r.result, r.attempt) for r in results} == {("ok", 42, 1)}
    where = Counter(ran_on(ds, r.job_id) for r in results)
    assert len(where) >= 2, where
    assert all(ds[ran_on(ds, r.job_id)].socket == r.node for r in results)  # its word is true
    assert placed == [where[i] for i in range(3)]


def test_a_full_node_s_jobs_complete_on_the_others(private_daemon: Factory,
                                                   tmp_path: Path) -> None:
    ds = daemons(private_daemon, tmp_path, "", "", "[limits]\nmax_jobs = 1\n")
    full = ds[2]
    held = Held()
    with Fleet([d.socket for d in ds]) as fleet:
        jobs = [fleet.submit(held.code(str(i)), tools=[held.hold]) for i in range(6)]
        until(lambda: len(held.calls) == 6, "six jobs in their tool calls")
        on = [running(d) for d in ds]
        assert len(on[2]) == 1 and len(on[0]) + len(on[1]) == 5, on
        assert set().union(*on) == {j.job_id for j in jobs}
        # the positive control: the node is full, and says so to anyone
        with pytest.raises(Busy, match=r"limits\.max_jobs"), Client(full.socket) as c:
            c.run("1")
        stats = fleet.stats()[2]
        assert stats.refused_busy >= 1 and stats.placed == 1, stats
        assert "limits.max_jobs" in stats.last_refused
        held.release.set()
        results = [j.result(guard(60)) for j in jobs]
    assert {(r.status, r.result) for r in results} == {("ok", 1)}


def test_kill_9_of_a_node_non_idempotent_jobs_raise_node_lost_idempotent_ones_run_again(
    private_daemon: Factory, tmp_path: Path
) -> None:
    ds = daemons(private_daemon, tmp_path, "", "", "")
    victim = ds[0]
    # the other two are reachable once the test links them: until then every job is the
    # victim's
    links = [tmp_path / "b.sock", tmp_path / "c.sock"]
    held = Held()
    with Fleet([victim.socket, *map(str, links)]) as fleet:
        once = [fleet.submit(held.code(f"once{i}"), tools=[held.hold]) for i in range(2)]
        again = [fleet.submit(held.code(f"again{i}"), tools=[held.hold], idempotent=True)
                 for i in range(2)]
        until(lambda: len(held.calls) == 4, "four jobs in their tool calls")
        assert running(victim) == {j.job_id for j in once + again}
        for link, d in zip(links, ds[1:], strict=True):
            link.symlink_to(d.socket)
        until(lambda: all(s.state == "up" for s in fleet.stats()), "the others connected")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(guard(10))
        for job in once:
            with pytest.raises(NodeLost) as lost:
                job.result(guard(60))
            assert lost.value.node == victim.socket, lost.value
            assert "not run again" in lost.value.message
        until(lambda: all(held.calls[f"again{i}"] == 2 for i in range(2)),
              "the idempotent jobs' second attempts in their tool calls")
        held.release.set()
        results = [j.result(guard(60)) for j in again]
        stats = fleet.stats()
    assert [(r.status, r.result, r.attempt) for r in results] == [("ok", 2, 2)] * 2
    assert sorted(r.node for r in results) == sorted(map(str, links))  # one each
    for r in results:  # the daemon the fleet names ran it
        assert ds[ran_on(ds, r.job_id)].socket == Path(r.node).resolve().as_posix()
    assert held.calls == {"once0": 1, "once1": 1, "again0": 2, "again1": 2}  # never re-run
    assert held.attempts["again0"] == held.attempts["again1"] == [1, 2]
    assert (stats[0].jobs_lost, stats[0].connections_lost) == (4, 1)


def test_a_session_on_a_killed_node_is_lost_the_others_go_on(private_daemon: Factory,
                                                             tmp_path: Path) -> None:
    ds = daemons(private_daemon, tmp_path, "", "")
    victim, survivor = ds
    with Fleet([d.socket for d in ds]) as fleet:
        first, second = fleet.session().open(), fleet.session().open()
        # a session counts as load: the second goes to the other node
        assert {first.node, second.node} == {victim.socket, survivor.socket}
        doomed, kept = (first, second) if first.node == victim.socket else (second, first)
        doomed.run("x = 'doomed'")
        kept.run("x = 'kept'")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(guard(10))
        with pytest.raises(SessionLost) as lost:
            doomed.run("x")
        assert lost.value.node == victim.socket
        assert doomed.closed == "lost"
        assert kept.run("x").result == "kept"
        with fleet.session() as third:  # new sessions open on the node left
            assert third.node == survivor.socket
        kept.close()


def test_a_draining_node_gets_no_new_jobs(private_daemon: Factory, tmp_path: Path) -> None:
    ds = daemons(private_daemon, tmp_path, "[daemon]\ndrain_s = 60\n", "")
    draining, other = ds
    held = Held()
    with Fleet([d.socket for d in ds]) as fleet:
        # the control: both nodes take the fleet's jobs (the least loaded: one each)
        before = [fleet.submit(held.code(f"before{i}"), tools=[held.hold]) for i in range(2)]
        assert {j.node for j in before} == {draining.socket, other.socket}
        until(lambda: len(held.calls) == 2, "two jobs in their tool calls")
        draining.proc.send_signal(signal.SIGTERM)
        until(lambda: "draining: 1 job(s) running" in draining.log(), "the drain to start")
        after = [fleet.submit(held.code(f"after{i}"), tools=[held.hold]) for i in range(2)]
        assert [j.node for j in after] == [other.socket] * 2
        stats = fleet.stats()[0]
        assert stats.refused_busy >= 1 and "draining" in stats.last_refused, stats
        held.release.set()
        results = [j.result(guard(60)) for j in before + after]
    assert {(r.status, r.result) for r in results} == {("ok", 1)}
    assert draining.proc.wait(guard(60)) == 0
    assert "drained: every running job finished" in draining.log()
