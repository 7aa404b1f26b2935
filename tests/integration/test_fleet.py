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


def daemons(private_daemon: Factory, tmp_path: Path, *configs: str,
            policies: dict[str, str] = POLICIES) -> list[DaemonHandle]:
    """One daemon per config (``jaild.toml`` text; "" for none), started side by side, each
    serving only ``policies`` (``default``)."""
    handles = []
    for i, text in enumerate(configs):
        args: tuple[str, ...] = ()
        if text:
            path = tmp_path / f"jaild{i}.toml"
            path.write_text(text)
            args = ("--config", str(path))
        handles.append(private_daemon(policies, with_repo_policies=False, args=args, wait=False))
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


DURABLE = ('[pool]\nmax = 0\n[limits]\nwall_time_s = 900\n[access]\napprove = ["send"]\n'
           '[approvals]\npark_after_s = 0.5\n')
PARKING = """\
found = tools.search("x")
sent = tools.send(found)
(found, sent)
"""


def holder_args(tmp_path: Path, holder: DaemonHandle, ds: list[DaemonHandle]) -> tuple[str, ...]:
    """The config ``daemons`` gave ``holder`` (its node's name)."""
    return ("--config", str(tmp_path / f"jaild{ds.index(holder)}.toml"))


class Sender:
    """A parking run's tools, counting the calls the host really makes."""

    def __init__(self) -> None:
        self.sent = 0

    def search(self, q: str) -> list[str]:
        return [q, "hit"]

    def send(self, found: list[str]) -> str:
        self.sent += 1
        return f"sent {found}"


def test_snapshots_and_parked_runs_are_reached_on_the_node_that_holds_them(
    private_daemon: Factory, tmp_path: Path
) -> None:
    """State lives on one node: the fleet names the node in the references it gives out
    (``ID@NODE``) and sends restore, approve and resume there -- from another fleet (a
    replaced agent), and after the node's daemon restarted. The control: the other node's
    daemon knows none of it (a fleet that picked a connection by load would fail half the
    time, and every one of the four restores here must land)."""
    from jaild.errors import UnknownJob, UnknownSnapshot

    ds = daemons(private_daemon, tmp_path, '[access]\nnode_name = "node-a"\n',
                 '[access]\nnode_name = "node-b"\n',
                 policies={**POLICIES, "durable": DURABLE})
    sockets = {"node-a": ds[0].socket, "node-b": ds[1].socket}
    sender = Sender()
    with Fleet(list(sockets.values())) as fleet:
        sessions = [fleet.session().open() for _ in range(4)]  # least load: two per node
        refs = []
        for i, session in enumerate(sessions):
            session.run(f"x = {i}")
            refs.append(session.snapshot()["id"])
        for session in sessions:
            session.close()
        assert sorted(r.split("@")[1] for r in refs) == ["node-a"] * 2 + ["node-b"] * 2, refs
        assert sorted(e["id"] for e in fleet.snapshots()) == sorted(refs)
        parking = fleet.submit(PARKING, "durable", tools=[sender.search, sender.send])
        until(lambda: any(a["parked"] for a in fleet.approvals()), "the run to park")
        [waiting] = fleet.approvals()
        assert waiting["job_id"] == parking.ref and waiting["node"] == parking.ref.split("@")[1]
    # another fleet, as a replacement agent pod would make: it finds and reaches each one
    with Fleet(list(sockets.values())) as fleet:
        for i, ref in enumerate(refs):
            with fleet.restore(ref) as again:
                assert again.run("x").result == i, ref
        ident, node = waiting["job_id"].split("@")
        other = sockets["node-b" if node == "node-a" else "node-a"]
        with Client(other) as stranger:  # the control: the other node knows none of it
            with pytest.raises(UnknownJob):
                stranger.approve(ident, waiting["call_id"])
            for ref in refs:
                if not ref.endswith("@" + node):
                    continue
                with pytest.raises(UnknownSnapshot), stranger.restore(ref.split("@")[0]) as s:
                    s.run("x")
        fleet.approve(waiting["job_id"], waiting["call_id"], True, "fine")
        resumed = fleet.resume_run(waiting["job_id"], [sender.search, sender.send])
        assert resumed.result(guard(60)).result == [["x", "hit"], "sent ['x', 'hit']"]
        assert sender.sent == 1
        with pytest.raises(ValueError, match="ID@NODE"):
            fleet.restore(refs[0].split("@")[0])  # a daemon's bare id names no node
        # the node's daemon restarts (a rollout: the same node, its state on its volume)
        holder = ds[0] if refs[0].endswith("@node-a") else ds[1]
        assert holder.stop() == 0
        restarted = private_daemon({**POLICIES, "durable": DURABLE}, with_repo_policies=False,
                                   args=holder_args(tmp_path, holder, ds), socket=holder.socket)
        assert restarted.socket == holder.socket
        with fleet.restore(refs[0]) as again:  # waits for the connection to be made again
            assert again.run("x").result == 0
