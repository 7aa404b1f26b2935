"""A fleet of real daemons on a network of their own (tests/fleet.py: a network namespace
per node on a bridge, the client in another, HAProxy in TCP mode in a third), reached over
mutual TLS: spreading, a tool storm, and each failure -- a daemon killed, a node silently
partitioned, a daemon frozen, a drain -- detected within the liveness bound on both sides,
nothing left on any node, each with its control. And scaling: three nodes through the
fleet give close to three times one node's throughput of sleep-bound jobs."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.errors import ConnectionLost, DaemonUnavailable, NodeLost
from jaild.fleet import AsyncFleet, Fleet, current_attempt
from tests.conftest import guard, until
from tests.fleet import Testbed, in_netns, require_testbed_host
from tests.hostile.conftest import standing
from tests.network import TlsDaemon, start_tls_daemon, start_tls_daemons
from tests.tls import Pki, make_pki

pytestmark = pytest.mark.integration

PORT, METRICS_PORT, LB_PORT = 7443, 9100, 8443
SLEEP_S, ROUNDS = 1.5, 3
"""The scaling test's jobs: each sleeps this long; each worker runs this many."""
LIVENESS_S = 3.0
"""Both ends' liveness bound in these tests (the daemons' and the clients')."""
SERVER_NAME = "jaild.test"
NODE_CONFIG = {"limits": {"max_jobs": 64, "max_jobs_per_uid": 64}, "daemon": {"drain_s": 10}}
"""Nodes 1-3: room for the tool storm's 50 jobs each; a drain on SIGTERM (a rolling
restart's)."""


@dataclass
class Node:
    index: int
    daemon: TlsDaemon
    directory: Path
    liveness_s: float

    @property
    def pid(self) -> int:
        return self.daemon.handle.proc.pid

    def job_ids(self) -> set[str]:
        return {str(r["job"]) for r in self.daemon.audit() if r.get("event") == "job"}

    def record(self, job_id: str) -> dict[str, object] | None:
        found = [r for r in self.daemon.audit() if r.get("job") == job_id]
        return found[-1] if found else None

    def left_behind(self) -> list[str]:
        """Job cgroups in this daemon's subtree (v1: memory's) but its standing jails'
        (zygotes, warm pools): what ended jobs left."""
        handle = self.daemon.handle
        keep = standing(handle) if handle.proc.poll() is None else set()
        return sorted(set(self.job_cgroups()) - keep)

    def job_cgroups(self) -> list[str]:
        """Every job and session cgroup in this daemon's subtree, standing jails' too."""
        root = self.daemon.handle.job_root
        return sorted(p.name for p in root.iterdir() if p.is_dir()
                      and p.name.startswith(("job-", "ses-"))) if root.is_dir() else []


class Fleetbed:
    """The bed, its PKI and a daemon per node."""

    def __init__(self, bed: Testbed, pki: Pki, directory: Path) -> None:
        self.bed, self.pki, self.directory = bed, pki, directory
        self.nodes: dict[int, Node] = {}

    def start(self, i: int, liveness_s: float = LIVENESS_S, port: int = PORT,
              **config: object) -> Node:
        """Node ``i``'s daemon, named ``node<i>`` (``access.node_name``), listening on
        ``port`` of its station's address."""
        station = self.bed.node(i)
        directory = self.directory / f"node{i}"
        d = start_tls_daemon(
            directory, self.pki, wrapper=tuple(station.nsenter()),
            listen=f"tls://{station.address}:{port}", access={"node_name": f"node{i}"},
            metrics=f"{station.address}:{METRICS_PORT}", liveness_s=liveness_s, **config,
        )
        node = self.nodes[i] = Node(i, d, directory, liveness_s)
        return node

    def address(self, i: int) -> str:
        return f"tls://{self.bed.node(i).address}:{PORT}"

    def options(self, liveness_s: float = LIVENESS_S) -> dict[str, object]:
        c = self.pki.client
        return {"cert": c.cert, "key": c.key, "ca": self.pki.ca.cert,
                "server_name": SERVER_NAME, "liveness_timeout_s": liveness_s}

    def fleet(self, nodes: tuple[int, ...] = (1, 2, 3), **kwargs: object) -> Fleet:
        with in_netns(self.bed.client):  # its loop thread (and its sockets) stay there
            return Fleet([self.address(i) for i in nodes], **self.options(), **kwargs)  # type: ignore[arg-type]

    def client(self, address: str, liveness_s: float = LIVENESS_S) -> Client:
        with in_netns(self.bed.client):
            return Client(address, **self.options(liveness_s))  # type: ignore[arg-type]

    def running_on(self, job_id: str) -> int:
        """The node running ``job_id`` now (asked of each daemon, as root on its socket)."""
        for i, node in self.nodes.items():
            if node.daemon.handle.proc.poll() is None:
                with Client(node.daemon.socket) as root:
                    if job_id in {j["id"] for j in root.jobs()}:
                        return i
        raise AssertionError(f"no node runs {job_id}")

    def which(self, job_id: str) -> int:
        (found,) = [i for i, n in self.nodes.items() if job_id in n.job_ids()]
        return found


@pytest.fixture(scope="module")
def fb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleetbed]:
    require_testbed_host()
    directory = tmp_path_factory.mktemp("fleetbed")
    with Testbed(nodes=4) as bed:
        ips = tuple(str(s.address) for s in (*bed.nodes, bed.lb))
        pki = make_pki(directory / "pki", server_names=(SERVER_NAME,), server_ips=ips)
        fb = Fleetbed(bed, pki, directory)
        try:
            for i in (1, 2, 3):
                fb.start(i, **NODE_CONFIG)  # type: ignore[arg-type]
            fb.start(4, liveness_s=0)  # the control: liveness off
            yield fb
        finally:
            for node in fb.nodes.values():
                node.daemon.handle.stop()


def wait_job_running(node: Node, job_id: str) -> None:
    with Client(node.daemon.socket) as root:  # root over the node's Unix socket sees all
        until(lambda: any(j["id"] == job_id and j["state"] == "running" for j in root.jobs()),
              f"{job_id} running on node {node.index}")


# ------------------------------------------------------------------ spreading


def test_through_haproxy_one_connection_pins_its_jobs_the_fleet_spreads_them(fb: Fleetbed) -> None:
    lb = fb.bed.start_haproxy(fb.bed.backends(PORT, METRICS_PORT, nodes=(1, 2, 3)),
                              port=LB_PORT, balance="roundrobin", check="http")
    lb.wait_up(3)
    address = f"tls://{fb.bed.lb.address}:{LB_PORT}"
    # the control: one multiplexed connection through the balancer -> one node
    with fb.client(address) as c:
        jobs = [c.submit("1") for _ in range(30)]
        ids = [j.job_id for j in jobs]
        assert all(j.result().status == "ok" for j in jobs)
    assert len({fb.which(i) for i in ids}) == 1
    # the fleet through the same address: a few connections, spread by the balancer
    with _lb_fleet(fb, address) as f:
        results = [f.submit("2") for _ in range(100)]
        done = [r.result() for r in results]
    assert all(r.status == "ok" for r in done)
    spread = Counter(fb.which(r.job_id) for r in done)
    assert len(spread) >= 2, spread


def _lb_fleet(fb: Fleetbed, address: str) -> Fleet:
    with in_netns(fb.bed.client):
        return Fleet([address], connections=3, **fb.options())  # type: ignore[arg-type]


# ------------------------------------------------------------------ the tool storm


def test_a_tool_storm_over_three_nodes_misroutes_no_answer(fb: Fleetbed) -> None:
    """3 nodes x 50 concurrent jobs x 20 tool calls, each answer carrying its job's nonce and
    the call's number: every job gets exactly its own answers."""
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def echo(nonce: str, n: int) -> list[object]:
        with lock:
            calls[nonce] += 1
        return [nonce, n]

    code = (
        "import asyncio\n"
        "out = await asyncio.gather(*(tools.echo(NONCE, i) for i in range(20)))\n"
        "bad = [o for i, o in enumerate(out) if o != [NONCE, i]]\n"
        "(len(out), bad)"
    )
    nonces = [secrets.token_hex(8) for _ in range(150)]
    with fb.fleet() as f:
        jobs = [f.submit(code.replace("NONCE", repr(n)), tools=[echo]) for n in nonces]
        results = [j.result() for j in jobs]
    assert [r.status for r in results] == ["ok"] * 150, [r.error for r in results if r.error][:3]
    assert [r.result for r in results] == [[20, []]] * 150
    assert calls == Counter({n: 20 for n in nonces})
    assert set(Counter(fb.which(r.job_id) for r in results)) == {1, 2, 3}


# ------------------------------------------------------------------ failures


def restart(fb: Fleetbed, i: int) -> Node:
    """Start node ``i``'s daemon again (same socket, same config): it sweeps what the
    last one left."""
    return fb.start(i, fb.nodes[i].liveness_s, **NODE_CONFIG)  # type: ignore[arg-type]


def test_kill_9_of_a_daemon_mid_job_is_seen_at_once_and_leaves_nothing(fb: Fleetbed) -> None:
    node = fb.nodes[2]
    with fb.client(fb.address(2)) as c:
        job = c.submit("import time\ntime.sleep(25)")
        wait_job_running(node, job.job_id)
        before = set(node.job_cgroups())
        assert job.job_id in before  # the control: the running job's cgroup is there
        started = time.monotonic()
        os.kill(node.pid, signal.SIGKILL)
        with pytest.raises(ConnectionLost) as info:
            job.result()
    assert time.monotonic() - started < LIVENESS_S  # a reset: no need to wait for the bound
    assert info.value.reason in ("reset", "closed")
    node.daemon.handle.proc.wait()
    fresh = restart(fb, 2)
    assert set(fresh.job_cgroups()) & before == set()  # the new daemon swept all of them


def test_a_silent_partition_is_found_within_the_bound_on_both_sides(fb: Fleetbed) -> None:
    node = fb.nodes[3]
    with fb.client(fb.address(3)) as c:
        job = c.submit("import time\ntime.sleep(25)")
        wait_job_running(node, job.job_id)
        fb.bed.partition(3)
        try:
            started = time.monotonic()
            with pytest.raises(ConnectionLost) as info:
                job.result()
            client_saw = time.monotonic() - started
            until(lambda: node.record(job.job_id) is not None, "the daemon ended the job")
            daemon_saw = time.monotonic() - started
        finally:
            fb.bed.heal(3)
    assert info.value.reason == "timeout"
    assert client_saw < LIVENESS_S + guard(2)
    record = node.record(job.job_id)
    assert record is not None and record["status"] == "cancelled"
    assert "the client was lost" in str(record["reason"])
    assert daemon_saw < LIVENESS_S + guard(2)
    lost = [r for r in node.daemon.audit() if r.get("event") == "connection_lost"]
    assert lost and lost[-1]["principal"]
    until(lambda: node.left_behind() == [], "nothing left on the node")


def test_without_liveness_a_partitioned_job_lingers_until_its_wall_time(fb: Fleetbed) -> None:
    """The control of the test above: node 4's daemon and this client have liveness off."""
    node = fb.nodes[4]
    with fb.client(fb.address(4), liveness_s=0) as c:
        job = c.submit("import time\ntime.sleep(25)", timeout=4)
        wait_job_running(node, job.job_id)
        fb.bed.partition(4)
        try:
            started = time.monotonic()
            until(lambda: node.record(job.job_id) is not None, "the job's end")
            ended = time.monotonic() - started
            assert not job.done  # the client never heard: it would wait with no bound
        finally:
            fb.bed.heal(4)
            c.close()
    record = node.record(job.job_id)
    assert record is not None and record["status"] == "timeout"  # ran to its wall time
    assert ended >= 2.5  # it was not cut short at the partition


def test_a_frozen_daemon_is_found_within_the_bound(fb: Fleetbed) -> None:
    node = fb.nodes[1]
    with fb.client(fb.address(1)) as c:
        job = c.submit("import time\ntime.sleep(25)")
        wait_job_running(node, job.job_id)
        os.kill(node.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(ConnectionLost) as info:
                job.result()
            assert time.monotonic() - started < LIVENESS_S + guard(2)
        finally:
            os.kill(node.pid, signal.SIGCONT)
    assert info.value.reason == "timeout"
    # thawed, the daemon finds the client gone and ends what it owned
    until(lambda: node.record(job.job_id) is not None, "the job's end once thawed")
    assert node.record(job.job_id)["status"] == "cancelled"  # type: ignore[index]
    until(lambda: node.left_behind() == [], "nothing left on the node")


def test_idempotent_jobs_survive_a_lost_node_and_others_raise_node_lost(fb: Fleetbed) -> None:
    attempts: dict[str, list[int]] = {}
    lock = threading.Lock()

    def mark(nonce: str) -> int:
        with lock:
            attempts.setdefault(nonce, []).append(current_attempt())
        return current_attempt()

    released = threading.Event()

    def hold() -> None:
        """Until the node is killed: the jobs are surely running then."""
        released.wait(guard(60))

    code = "a = await tools.mark(NONCE)\nawait tools.hold()\na"
    with fb.fleet(nodes=(1, 2)) as f:
        plain = [f.submit(code.replace("NONCE", f"'p{i}'"), tools=[mark, hold])
                 for i in range(4)]
        again = [f.submit(code.replace("NONCE", f"'i{i}'"), tools=[mark, hold],
                          idempotent=True) for i in range(4)]
        until(lambda: len(attempts) == 8, "every job called its tool")
        doomed = fb.running_on(plain[0].job_id)
        os.kill(fb.nodes[doomed].pid, signal.SIGKILL)
        fb.nodes[doomed].daemon.handle.proc.wait()
        released.set()
        outcomes = []
        for job in plain:
            try:
                outcomes.append(job.result().status)
            except NodeLost:
                outcomes.append("lost")
        finals = [job.result() for job in again]
    restart(fb, doomed)
    assert "lost" in outcomes  # those on the killed node
    assert all(attempts[f"p{i}"] == [1] for i in range(4))  # never re-run
    assert all(r.status == "ok" for r in finals)
    assert any(r.attempt == 2 and r.result == 2 for r in finals)  # re-run, and it said so
    for node in fb.nodes.values():
        until(lambda node=node: node.left_behind() == [], "nothing left on any node")


def test_a_drain_sends_new_jobs_elsewhere_while_the_running_job_ends(fb: Fleetbed) -> None:
    """A rolling restart: node 3 drains (SIGTERM, drain_s), its running job ends well, the
    fleet's new jobs go to the others; node 3 comes back and takes jobs again."""
    node = fb.nodes[3]
    with fb.client(fb.address(3)) as c, fb.fleet() as f:
        running = c.submit("import time\ntime.sleep(3)\n'done'")
        wait_job_running(node, running.job_id)
        node.daemon.handle.proc.send_signal(signal.SIGTERM)
        until(lambda: "draining" in node.daemon.handle.log(), "node 3 draining")
        during = [f.submit("1") for _ in range(12)]
        placed = [j.result() for j in during]
        assert all(r.status == "ok" for r in placed)
        assert 3 not in {fb.which(r.job_id) for r in placed}
        assert running.result().result == "done"  # the drain let it finish
        assert node.daemon.handle.proc.wait(timeout=guard(30)) == 0
        back = restart(fb, 3)
        ran: set[str] = set()

        def node3_took_one() -> bool:
            ran.update(f.run("1").job_id for _ in range(3))
            return bool(back.job_ids() & ran)  # the audit is written a moment after

        until(node3_took_one, "node 3 takes jobs again", timeout=60)


def test_a_node_rolled_to_a_new_address_takes_work_again_and_keeps_its_state(
        fb: Fleetbed) -> None:
    """A DaemonSet rollout gives a node's daemon a new address (its pod's); the node and the
    state on it stay. A fleet that re-resolves its endpoints (``discover=``) connects to the
    new address, runs jobs there, and restores the snapshot taken before the roll: its
    reference names the node (``...@node1``), not an address. The control: a fleet given the
    old address alone never reaches the node again."""
    node = fb.nodes[1]
    found = [fb.address(1)]
    moved = f"tls://{fb.bed.node(1).address}:{PORT + 1}"
    try:
        with fb.fleet(nodes=(1,), discover=lambda: list(found), rediscover_s=0.2) as follows, \
                fb.fleet(nodes=(1,), place_timeout_s=3) as stays:
            with follows.session() as s:
                s.run("x = 41")
                ref = s.snapshot()["id"]
            assert ref.endswith("@node1"), ref
            node.daemon.handle.proc.send_signal(signal.SIGTERM)  # the old pod goes ...
            assert node.daemon.handle.proc.wait(timeout=guard(30)) == 0
            fb.start(1, node.liveness_s, port=PORT + 1, **NODE_CONFIG)  # type: ignore[arg-type]
            found[:] = [moved]  # ... and the Service's name now resolves to the new one
            ran = follows.run("6 * 7")
            assert (ran.status, ran.result, ran.node) == ("ok", 42, moved)
            with follows.restore(ref) as again:
                assert again.run("x + 1").result == 42
            with pytest.raises(DaemonUnavailable):  # the control: nobody at the old address
                stays.run("6 * 7")
    finally:
        fb.nodes[1].daemon.handle.stop()
        restart(fb, 1)  # back on its address, for the tests after this one


# ------------------------------------------------------------------ scaling


def test_three_nodes_give_close_to_three_times_one_nodes_throughput(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Sleep-bound jobs, 4 slots a node: the fleet over three nodes runs 2.7x or more the
    jobs per second of one (the jobs wait, the CPU does not: what two cores can show)."""
    directory = tmp_path_factory.mktemp("scaling")
    pki = make_pki(directory / "pki")
    daemons = start_tls_daemons([directory / f"n{i}" for i in range(3)], pki,
                                limits={"max_jobs": 4, "max_jobs_per_uid": 4})
    try:
        opts = {"cert": pki.client.cert, "key": pki.client.key, "ca": pki.ca.cert,
                "server_name": "localhost"}

        async def rate(addresses: list[str]) -> float:
            """Jobs per second of 4 workers a node, each running ROUNDS sleep-bound jobs one
            after another (so no job waits for a slot), started a little apart."""
            async with AsyncFleet(addresses, **opts) as f:  # type: ignore[arg-type]
                await asyncio.gather(*(f.run("1") for _ in range(4 * len(addresses))))
                workers = 4 * len(addresses)

                async def worker(k: int) -> None:
                    # jail starts spread over a job's length, the same way on every node
                    await asyncio.sleep(SLEEP_S * (k % 4) / 4)
                    for _ in range(ROUNDS):
                        r = await f.run(f"import time\ntime.sleep({SLEEP_S})")
                        assert r.status == "ok", r.error

                started = time.monotonic()
                await asyncio.gather(*(worker(k) for k in range(workers)))
                return workers * ROUNDS / (time.monotonic() - started)

        one = asyncio.run(rate([daemons[0].address]))
        three = asyncio.run(rate([d.address for d in daemons]))
    finally:
        for d in daemons:
            d.stop()
    print(f"jobs/s: one node {one:.2f}, three nodes {three:.2f}: {three / one:.2f}x")
    assert three >= 2.7 * one, (one, three)
