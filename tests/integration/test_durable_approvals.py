"""Durable approvals on the real daemon: calls held for the policy's approvers, runs parked
to disk, a daemon restart between the wait and the decision, the call made exactly once."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaild import Client
from jaild.daemon.state.journal import Journal
from jaild.errors import Busy, UnknownJob
from tests.conftest import (
    STATE_DIR,
    DaemonHandle,
    ForeignClient,
    guard,
    start_daemon,
    sweep_cgroups,
)

pytestmark = pytest.mark.integration

DURABLE = ('[pool]\nmax = 0\n[limits]\nwall_time_s = 900\n[access]\napprove = ["send"]\n'
           '[approvals]\npark_after_s = {park}\n')
"""Runs may wait up to 15 minutes live: ``park_after_s`` must be below ``wall_time_s``."""
OPS = DURABLE + 'approvers = ["65534"]\n'

CODE = """\
print("before")
found = tools.search("x")
print("between")
sent = tools.send(found)
print("after")
(found, sent)
"""


class Host:
    """The run's tools, counting every call the host really makes."""

    def __init__(self) -> None:
        self.calls = {"search": 0, "send": 0}
        self.lock = threading.Lock()

    def search(self, q: str) -> list[str]:
        with self.lock:
            self.calls["search"] += 1
        return [q, "hit"]

    def send(self, found: list[str]) -> str:
        with self.lock:
            self.calls["send"] += 1
        return f"sent {found}"

    @property
    def tools(self) -> list[Callable[..., object]]:
        return [self.search, self.send]


@pytest.fixture
def daemons(world_dir: Path, tmp_path: Path) -> Iterator[Callable[..., DaemonHandle]]:
    """``start(park=..., restart=False, limits="")``: a daemon uid 65534 may reach, serving
    the ``durable`` (owner approves) and ``ops`` (uid 65534 approves) policies; ``restart``
    stops the last one and starts another on its socket (the same instance: its parked
    runs); ``limits``: lines of its config's ``[limits]``."""
    handles: list[DaemonHandle] = []
    config = tmp_path / "jaild.toml"

    def start(park: float = 1.0, restart: bool = False, limits: str = "") -> DaemonHandle:
        config.write_text(f'[daemon]\nsocket_group = "nogroup"\n[limits]\n{limits}\n')
        socket = None
        if restart:
            socket = handles[-1].socket
            assert handles[-1].stop() == 0, handles[-1].log()[-3000:]
            sweep_cgroups(handles[-1])
        where = world_dir / "d"
        handle = start_daemon(where, {"durable": DURABLE.format(park=park),
                                      "ops": OPS.format(park=park)},
                              with_repo_policies=False, args=("--config", str(config)),
                              socket=socket)
        os.chmod(where, 0o755)
        handles.append(handle)
        return handle

    yield start
    handles[-1].stop()
    sweep_cgroups(handles[-1])


def wait_for(what: Callable[[], object], timeout: float = 10) -> object:
    deadline = time.monotonic() + guard(timeout)
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


APPROVE_AS_NOBODY = (
    "import sys, json\nfrom jaild.client import Client\nfrom jaild.errors import JaildError\n"
    "c = Client(sys.argv[1])\nseen = c.approvals()\n"
    "try:\n    c.approve(sys.argv[2], int(sys.argv[3]), True, 'by nobody')\n    out = 'approved'\n"
    "except JaildError as e:\n    out = e.code\n"
    "print(json.dumps([len(seen), out]))\n"
)


def test_a_parked_run_survives_a_restart_and_calls_the_tool_once(
        daemons: Callable[..., DaemonHandle], foreign_client: ForeignClient) -> None:
    handle = daemons(park=0.5)
    host = Host()
    with Client(handle.socket) as c:
        job = c.submit(CODE, "durable", tools=host.tools)  # no approve callback: it waits
        pending = wait_for(c.approvals)
        assert isinstance(pending, list) and len(pending) == 1
        entry = pending[0]
        assert (entry["tool"], entry["job_id"]) == ("send", job.job_id)
        wait_for(lambda: c.approvals()[0]["parked"])  # past park_after_s: its jail ends
        wait_for(lambda: not handle.cgroup_dir(job.job_id).exists())  # and its cgroup goes
        assert [j for j in c.jobs() if j["id"] == job.job_id] == []
    assert host.calls == {"search": 1, "send": 0}

    handle = daemons(park=0.5, restart=True)
    # another tenant may neither see nor decide it
    out = foreign_client.run(APPROVE_AS_NOBODY, handle.socket, entry["job_id"],
                             str(entry["call_id"]), uid=65534, gid=65534)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [0, UnknownJob.code]
    with Client(handle.socket) as c2:  # a new connection, after the restart
        [again] = c2.approvals()
        assert again["parked"] and not again["attached"] and again["call_id"] == entry["call_id"]
        c2.approve(entry["job_id"], entry["call_id"], True, "looks right")
        printed: list[str] = []
        resumed = c2.resume_run(entry["job_id"], host.tools, on_stdout=printed.append)
        r = resumed.result(timeout=guard(60))
        assert r.status == "ok", (r.status, r.error)
        assert r.result == [["x", "hit"], "sent ['x', 'hit']"]
        assert "".join(printed) == "after\n"  # what it printed before the call is not repeated
        assert c2.approvals() == []
    assert host.calls == {"search": 1, "send": 1}  # each tool exactly once, over two daemons


def test_an_approver_decides_from_another_connection(
        daemons: Callable[..., DaemonHandle], foreign_client: ForeignClient) -> None:
    """Policy ``ops``: uid 65534 approves root's run while it waits live (before parking);
    the run goes on at once. Under ``durable`` the same uid is refused (positive control of
    the approvers list)."""
    handle = daemons(park=60)
    for policy, expected in (("ops", "approved"), ("durable", UnknownJob.code)):
        host = Host()
        with Client(handle.socket) as c:
            job = c.submit(CODE, policy, tools=host.tools)
            entry = wait_for(c.approvals)[0]  # type: ignore[index]
            out = foreign_client.run(APPROVE_AS_NOBODY, handle.socket, job.job_id,
                                     str(entry["call_id"]), uid=65534, gid=65534)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout) == [1 if policy == "ops" else 0, expected]
            if policy == "durable":
                c.approve(job.job_id, entry["call_id"], False, "not today")
            r = job.result(timeout=guard(60))
            if policy == "ops":
                assert r.status == "ok" and host.calls == {"search": 1, "send": 1}
            else:
                assert r.status == "error" and "not today" in (r.error or {})["message"]
                assert host.calls == {"search": 1, "send": 0}


def test_the_clients_approve_callback_answers_a_held_call(
        daemons: Callable[..., DaemonHandle]) -> None:
    handle = daemons(park=60)
    host = Host()
    asked: list[str] = []

    def approve(name: str, args: list[object], kwargs: dict[str, object]) -> bool:
        asked.append(name)
        return True

    with Client(handle.socket, approve=approve) as c:
        r = c.run(CODE, "durable", tools=host.tools)
    assert r.status == "ok" and asked == ["send"] and host.calls == {"search": 1, "send": 1}


def test_a_client_that_leaves_parks_its_waiting_run(
        daemons: Callable[..., DaemonHandle]) -> None:
    handle = daemons(park=600)  # it would wait live for ten minutes; its client leaves first
    host = Host()
    with Client(handle.socket) as c:
        job = c.submit(CODE, "durable", tools=host.tools)
        entry = wait_for(c.approvals)[0]  # type: ignore[index]
    with Client(handle.socket) as c2:
        [parked] = wait_for(lambda: [a for a in c2.approvals() if a["parked"]])  # type: ignore[misc]
        assert parked["job_id"] == job.job_id and not parked["attached"]
        resumed = c2.resume_run(job.job_id, host.tools)  # hosts it, then decides it
        c2.approve(job.job_id, entry["call_id"], True)
        r = resumed.result(timeout=guard(60))
        assert r.status == "ok" and host.calls == {"search": 1, "send": 1}


def test_a_replay_that_takes_another_path_is_stopped(
        daemons: Callable[..., DaemonHandle]) -> None:
    """The run's first call depends on the clock: replayed in the fresh jail it is another
    call, so the run is stopped rather than given a reply meant for a different call."""
    handle = daemons(park=0.3)
    host = Host()
    code = CODE.replace('tools.search("x")', "tools.search(str(__import__('time').time_ns()))")
    with Client(handle.socket) as c:
        job = c.submit(code, "durable", tools=host.tools)
        entry = wait_for(lambda: [a for a in c.approvals() if a["parked"]])[0]  # type: ignore[index]
        c.approve(job.job_id, entry["call_id"], True)
        r = job.result(timeout=guard(60))
    assert r.status == "cancelled" and "replay_diverged" in (r.error or {})["message"]
    assert host.calls == {"search": 1, "send": 0}  # the approved call was never made


def test_the_cli_lists_and_decides_calls(daemons: Callable[..., DaemonHandle]) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "jaild", *args, "--socket", handle.socket],
                              capture_output=True, text=True, timeout=guard(60), check=False)

    handle = daemons(park=60)
    host = Host()
    with Client(handle.socket) as c:
        job = c.submit(CODE, "durable", tools=host.tools)
        entry = wait_for(c.approvals)[0]  # type: ignore[index]
        listed = cli("approvals")
        assert listed.returncode == 0 and job.job_id in listed.stdout and "send" in listed.stdout
        assert '[["x", "hit"]]' in listed.stdout  # the call's arguments, for the approver
        assert cli("approve", job.job_id, "999").returncode == 1  # no such call waits
        out = cli("approve", job.job_id, str(entry["call_id"]), "--deny", "--reason", "no")
        assert out.returncode == 0 and "denied" in out.stdout
        r = job.result(timeout=guard(60))
    assert r.status == "error" and host.calls == {"search": 1, "send": 0}


# -- session runs: the session is parked with its run, and goes on after it

SESSION_RUN = """\
x += 1
print("before")
found = tools.search("x")
sent = tools.send(found)
(x, sent)
"""


RESUME_AS_NOBODY = (
    "import sys, json\nfrom jaild.client import Client\nfrom jaild.errors import JaildError\n"
    "c = Client(sys.argv[1])\n"
    "def search(q): return []\ndef send(x): return 'stolen'\n"
    "try:\n    c.resume_run(sys.argv[2], [search, send])\n    out = 'resumed'\n"
    "except JaildError as e:\n    out = e.code\n"
    "print(json.dumps(out))\n"
)


def session_cgroups(handle: DaemonHandle, session_id: str) -> list[str]:
    """The cgroups of the session's jails that still exist."""
    parent = handle.cgroup_dir(session_id).parent
    return sorted(p.name for p in parent.glob(f"{session_id}*")) if parent.exists() else []


def test_a_session_run_parks_with_its_session_and_goes_on_after_the_decision(
        daemons: Callable[..., DaemonHandle]) -> None:
    """On one connection: the run waits past ``park_after_s``, the session's jail and cgroup
    go (``ps`` shows it parked, further runs are refused as busy); approved, the session
    comes back in a fresh jail with its state from *before* the run (``x`` incremented
    once, not twice: the run was replayed on that state), and goes on."""
    handle = daemons(park=0.5)
    host = Host()
    with Client(handle.socket) as c, c.session("durable", tools=host.tools) as s:
        assert s.run("x = 1\nopen('kept.txt', 'w').write('on disk')").status == "ok"
        job = s.submit(SESSION_RUN)
        entry = wait_for(lambda: [a for a in c.approvals() if a["parked"]])[0]  # type: ignore[index]
        assert entry["session"] == s.id and entry["attached"]
        wait_for(lambda: session_cgroups(handle, s.id or "") == [])
        [row] = [j for j in c.jobs() if j["id"] == s.id]
        assert row["state"] == "parked"
        with pytest.raises(Busy, match="parked for approval"):
            s.run("x")
        c.approve(job.job_id, entry["call_id"], True, "fine")
        r = job.result(timeout=guard(60))
        assert r.status == "ok", (r.status, r.error)
        assert r.result == [2, "sent ['x', 'hit']"]
        assert (r.session["id"], r.session["run"], r.session["closed"]) == (s.id, 2, None)
        after = s.run("(x, open('kept.txt').read())")
        assert after.result == [2, "on disk"] and after.session["run"] == 3
        assert [e for e in c.snapshots() if e["kind"] == "parked"] == []  # its state went
    assert host.calls == {"search": 1, "send": 1}


def test_a_parked_session_survives_its_client_and_a_restart(
        daemons: Callable[..., DaemonHandle], foreign_client: ForeignClient) -> None:
    """The client leaves and the daemon restarts while the session's run waits: uid 65534
    neither sees nor decides it; root, on a new connection, approves and resumes it, and
    gets the session back (its state, its files) on that connection, the tool called once."""
    handle = daemons(park=600)  # parks because its client leaves
    host = Host()
    with Client(handle.socket) as c:
        s = c.session("durable", tools=host.tools).open()
        s.run("x = 41\nimport json\njson.jaild_mark = 'kept'\nopen('f.txt', 'w').write('f')")
        job = s.submit(SESSION_RUN)
        entry = wait_for(c.approvals)[0]  # type: ignore[index]
    handle = daemons(park=600, restart=True)
    out = foreign_client.run(APPROVE_AS_NOBODY, handle.socket, job.job_id,
                             str(entry["call_id"]), uid=65534, gid=65534)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [0, UnknownJob.code]
    out = foreign_client.run(RESUME_AS_NOBODY, handle.socket, job.job_id, uid=65534, gid=65534)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == UnknownJob.code  # nor take its session over
    with Client(handle.socket) as c2:
        [again] = c2.approvals()
        assert again["parked"] and not again["attached"] and again["session"] == s.id
        assert [j for j in c2.jobs() if j["id"] == s.id] == []  # detached: no jail, no row
        [state] = [e for e in c2.snapshots() if e["kind"] == "parked"]
        assert state["session"] == s.id
        c2.approve(job.job_id, entry["call_id"], True)
        printed: list[str] = []
        resumed = c2.resume_run(job.job_id, host.tools, on_stdout=printed.append)
        r = resumed.result(timeout=guard(60))
        assert r.status == "ok", (r.status, r.error)
        assert r.result == [42, "sent ['x', 'hit']"] and "".join(printed) == ""
        back = resumed.session
        assert back is not None and back.id == s.id
        after = back.run("(x, json.jaild_mark, open('f.txt').read())")
        assert after.status == "ok" and after.result == [42, "kept", "f"]
        [row] = [j for j in c2.jobs() if j["id"] == s.id]
        assert row["state"] == "idle" and session_cgroups(handle, s.id or "") != []
        back.close()
        assert c2.snapshots() == []
    assert host.calls == {"search": 1, "send": 1}


def test_closing_a_parked_session_drops_its_run(daemons: Callable[..., DaemonHandle]) -> None:
    handle = daemons(park=0.3)
    host = Host()
    with Client(handle.socket) as c:
        s = c.session("durable", tools=host.tools).open()
        s.run("x = 1")
        job = s.submit(SESSION_RUN)
        entry = wait_for(lambda: [a for a in c.approvals() if a["parked"]])[0]  # type: ignore[index]
        s.close()
        assert c.approvals() == [] and c.snapshots() == []
        with pytest.raises(UnknownJob):
            c.approve(job.job_id, entry["call_id"], True)
    assert host.calls == {"search": 1, "send": 0}


def test_a_session_whose_state_cannot_be_taken_waits_live(
        daemons: Callable[..., DaemonHandle]) -> None:
    """An open file in the session: its state cannot be taken before the run, so the run
    cannot park; its call waits live (the daemon says why) and is decided live."""
    handle = daemons(park=0.3)
    host = Host()
    with Client(handle.socket) as c, c.session("durable", tools=host.tools) as s:
        s.run("x = 1\nf = open('/tmp/open.txt', 'w')")
        job = s.submit(SESSION_RUN)
        entry = wait_for(c.approvals)[0]  # type: ignore[index]
        wait_for(lambda: f"run {job.job_id} cannot park" in handle.log())
        assert not c.approvals()[0]["parked"]
        c.approve(job.job_id, entry["call_id"], True)
        r = job.result(timeout=guard(60))
        assert r.status == "ok" and r.result == [2, "sent ['x', 'hit']"]
    assert host.calls == {"search": 1, "send": 1}


# -- journals on disk, and the quotas per principal (limits.approvals_*)

JOURNALED = """\
a = tools.search("a")
tools.send(a)
b = tools.search("b" * 1000)
tools.send(b)
"done"
"""


def journal_of(handle: DaemonHandle, job_id: str) -> Path:
    return Path(STATE_DIR) / "parked" / handle.config.instance / f"{job_id}.journal"


def test_a_runs_journal_is_on_disk_and_grows_with_its_calls(
        daemons: Callable[..., DaemonHandle]) -> None:
    """Every reply of a durable run is appended to its journal file as it comes (0600 in
    the daemon's 0700 directory), not kept in the daemon's memory; the file goes with the
    run."""
    handle = daemons(park=60)  # decided live: the journal is on disk without any park
    host = Host()
    with Client(handle.socket) as c:
        job = c.submit(JOURNALED, "durable", tools=host.tools)
        first = wait_for(c.approvals)[0]  # type: ignore[index]
        path = journal_of(handle, job.job_id)
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
        size = path.stat().st_size
        entries = list(Journal(str(path), 0, size))
        assert [(e.name, e.ok) for e in entries] == [("search", True)]
        c.approve(job.job_id, first["call_id"], True)
        second = wait_for(lambda: [a for a in c.approvals()
                                   if a["call_id"] != first["call_id"]])[0]  # type: ignore[index]
        grown = path.stat().st_size
        assert grown > size + 1000  # the second search's arguments and reply are in it
        assert [(e.name, e.ok) for e in Journal(str(path), 0, grown)] == \
            [("search", True), ("send", True), ("search", True)]
        c.approve(job.job_id, second["call_id"], True)
        r = job.result(timeout=guard(60))
        assert r.status == "ok" and r.result == "done"
    assert host.calls == {"search": 2, "send": 2}
    assert not path.exists()  # the run ended: its journal went with it


PARK_AS_NOBODY = (
    "import sys, json, time\nfrom jaild.client import Client\n"
    "def search(q): return [q]\ndef send(x): return 'sent'\n"
    "c = Client(sys.argv[1])\njob = c.submit(sys.argv[2], 'durable', tools=[search, send])\n"
    "deadline = time.monotonic() + 60\n"
    "while not [a for a in c.approvals() if a['parked']] and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\n"
    "print(json.dumps([[a['parked'] for a in c.approvals()], c.stats()['approvals']]))\n"
)


def test_a_principal_at_its_parked_quota_is_refused_parking(
        daemons: Callable[..., DaemonHandle], foreign_client: ForeignClient) -> None:
    """``approvals_parked_max_count = 1``: root's first run parks (under the quota); its
    second, past ``park_after_s``, is refused parking -- its call fails ``quota_exceeded``
    in the jail, naming the key, the count and the limit, and the tool is never called --
    while uid 65534 (another principal, its own count) parks one. ``jaild stats`` counts
    them: every principal's for root, its own for uid 65534."""
    import subprocess
    import sys

    handle = daemons(park=0.5, limits="approvals_parked_max_count = 1")
    first, second = Host(), Host()
    with Client(handle.socket) as c:
        parked = c.submit(CODE, "durable", tools=first.tools)
        wait_for(lambda: [a for a in c.approvals() if a["parked"]])
        refused = c.submit(CODE, "durable", tools=second.tools)
        r = refused.result(timeout=guard(60))
        assert r.status == "error", (r.status, r.error)
        message = (r.error or {})["message"]
        assert (r.error or {})["type"] == "ToolError"
        assert message.startswith("send: quota_exceeded: runs of uid 0 parked for approval: 1;")
        assert "at most 1 per principal" in message
        assert "limits.approvals_parked_max_count" in message
        assert second.calls == {"search": 1, "send": 0}
        [still] = c.approvals()  # only the first waits, parked
        assert still["job_id"] == parked.job_id and still["parked"]

        out = foreign_client.run(PARK_AS_NOBODY, handle.socket, CODE, uid=65534, gid=65534)
        assert out.returncode == 0, out.stderr
        flags, own = json.loads(out.stdout)
        assert flags == [True]  # control: another principal parks
        assert (own["parked_runs"], own["durable_runs"], own["max_parked_runs"]) == (1, 1, 1)
        assert own["journal_bytes"] > 0

        stats = c.stats()["approvals"]  # root: every principal's
        assert (stats["parked_runs"], stats["durable_runs"]) == (2, 2)
        assert stats["journal_quota_bytes"] == 256 << 20
        cli = subprocess.run([sys.executable, "-m", "jaild", "stats", "--socket", handle.socket],
                             capture_output=True, text=True, timeout=guard(60), check=False)
        assert cli.returncode == 0, cli.stderr
        assert "approvals: 2 durable runs, 2 parked (quota 1 per principal)" in cli.stdout
    assert first.calls == {"search": 1, "send": 0}


def test_a_reply_past_the_journal_quota_stops_its_run(
        daemons: Callable[..., DaemonHandle]) -> None:
    """``approvals_journal_quota_mb = 1``: replies of ~400 KB each; the third would take the
    principal's journals past 1 MiB, so the run is stopped (``cancelled``,
    ``quota_exceeded``) instead of its journal growing; a run within the quota ends ``ok``
    (control)."""
    handle = daemons(park=60, limits="approvals_journal_quota_mb = 1")
    big = "x" * 400_000
    calls = []

    def search(q: str) -> str:
        calls.append(q)
        return big

    with Client(handle.socket) as c:
        fits = c.run("len(tools.search('1')) + len(tools.search('2'))", "durable",
                     tools=[search])
        assert fits.status == "ok" and fits.result == 800_000
        r = c.run("[len(tools.search(str(i))) for i in range(5)]", "durable", tools=[search])
    assert r.status == "cancelled", (r.status, r.error)
    message = (r.error or {})["message"]
    assert (r.error or {})["type"] == "Cancelled" and message.startswith("quota_exceeded: ")
    assert "limits.approvals_journal_quota_mb" in message and "quota is 1048576 bytes" in message
    assert len(calls) == 2 + 3  # the third call was made; its reply was neither kept nor given
