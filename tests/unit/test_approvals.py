"""Durable approvals' rules (jaild.daemon.approvals): who may decide, what a parked run keeps
on disk, and the replay's answers -- without a jail."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jaild.daemon.approvals import Approvals, DurableRun, Journaled
from jaild.daemon.core.admission import SessionAsked
from jaild.daemon.core.parked import Decision, HeldCall, Phase, RunLife
from jaild.daemon.core.peer import Peer
from jaild.daemon.state.journal import ApprovalQuota, Journal
from jaild.daemon.state.parkedruns import ParkedRuns
from jaild.policy.schema import load_policy_text
from jaild.protocol.messages import JobDescription, ToolSpec


def policy(approvers: str = "") -> Any:
    return load_policy_text(
        f'[access]\napprove = ["send"]\n[approvals]\npark_after_s = 5\n{approvers}', "/p/ops.toml")


class NoSessions:
    def parked(self, run: DurableRun) -> None:
        pass

    def dropped(self, run: DurableRun) -> None:
        pass


def service(tmp_path: Path, pol: Any, quota: ApprovalQuota | None = None) -> Approvals:
    runs = ParkedRuns(str(tmp_path / "parked"), quota or ApprovalQuota(32, 256 << 20),
                      lambda: None)  # type: ignore[arg-type,return-value]
    return Approvals(runs, NoSessions())


def load(svc: Approvals, pol: Any) -> int:
    return svc.load({pol.name: pol})


def run(svc: Approvals, pol: Any, owner: int | str = 1000, job_id: str = "job-1") -> DurableRun:
    r = DurableRun(job_id, owner, f"uid {owner}", pol,
                   JobDescription(code="x", tools=(ToolSpec(name="send"),)), {"wall_time_s": 5},
                   svc, Journal(svc.runs.path(job_id, "journal")))
    svc.runs.add(r)
    return r


def parked(r: DurableRun, held: HeldCall, decision: Decision | None = None,
           dispatched: bool = False, at: float = 10**10) -> None:
    """``r`` as read back parked (``at`` far in the future: not past max_wait_s)."""
    r.life = RunLife(Phase.PARKED, held, decision, dispatched, at)


def journal(svc: Approvals, r: DurableRun, *entries: Journaled) -> None:
    for entry in entries:
        svc.runs.journal_append(r, entry)


def peer(uid: int) -> Peer:
    return Peer(pid=1, uid=uid, gid=uid)


def test_without_approvers_only_the_owner_and_root_decide(tmp_path: Path) -> None:
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    assert svc.may_approve(peer(1000), r) and svc.may_approve(peer(0), r)
    assert not svc.may_approve(peer(1001), r)
    assert not svc.may_approve(Peer.of_certificate("ops", "10.0.0.1:5"), r)


def test_approvers_replace_the_owner_unless_they_name_it(tmp_path: Path) -> None:
    pol = policy('approvers = ["1001", "principal:ops"]\n')
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    assert not svc.may_approve(peer(1000), r)  # the owner is not listed
    assert svc.may_approve(peer(1001), r)
    assert svc.may_approve(Peer.of_certificate("ops", "10.0.0.1:5"), r)
    assert not svc.may_approve(Peer.of_certificate("dev", "10.0.0.1:5"), r)
    pol = policy('approvers = ["owner"]\n')
    svc = service(tmp_path, pol)
    assert svc.may_approve(peer(1000), run(svc, pol))


def test_another_tenant_cannot_even_see_a_call(tmp_path: Path) -> None:
    from jaild.errors import PermissionDenied, UnknownJob

    pol = policy('approvers = ["1001"]\n')
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    parked(r, HeldCall(0, 7, "send", b"\x92\x90\x80", 0.0))
    assert svc.pending(peer(1002)) == [] and len(svc.pending(peer(1001))) == 1
    with pytest.raises(UnknownJob):
        svc.decide(peer(1002), "job-1", 7, True, "")
    with pytest.raises(PermissionDenied):
        svc.decide(peer(1000), "job-1", 7, True, "")  # its owner, not an approver here
    with pytest.raises(UnknownJob):
        svc.decide(peer(1001), "job-1", 8, True, "")  # no such call waits


def test_a_parked_run_is_read_back_as_it_was_written(tmp_path: Path) -> None:
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    journal(svc, r, Journaled("search", b"\x01", True, b"\x02"),
            Journaled("other", b"\x03", False, ["KeyError", "no"]))
    parked(r, HeldCall(2, 9, "send", b"\x04", 12.5), Decision(True, "fine", "uid 0"))
    r.hold = ("untrusted", "user:alice")  # the caller's labels: its continuation holds them
    svc.runs.save(r)
    again = service(tmp_path, pol)
    assert load(again, pol) == 1
    back = again.runs["job-1"]
    assert [(j.name, j.args, j.ok, j.value) for j in back.journal] == \
        [("search", b"\x01", True, b"\x02"), ("other", b"\x03", False, ["KeyError", "no"])]
    assert back.held is not None and (back.held.index, back.held.call_id, back.held.name) == \
        (2, 9, "send")
    assert back.life.decision == Decision(True, "fine", "uid 0")
    assert back.parked and back.host is None and back.life.can_continue
    assert back.job.tools[0].name == "send" and back.requested == {"wall_time_s": 5}
    assert back.session_id is None and again.runs.states() == set()
    assert back.hold == ("untrusted", "user:alice")


def test_a_parked_session_run_keeps_what_re_opens_its_session(tmp_path: Path) -> None:
    """A session's run: its session's id, the terms it was opened with and its state's
    snapshot id come back from disk (the state itself is in the snapshot store), and the
    start's sweep is told to keep that state."""
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    r.session_id, r.state_id = "ses-0123456789abcdef", "snap-" + "b" * 32
    r.session_asked = SessionAsked(idle_s=30.0, max_lifetime_s=600.0,
                                   tools=(ToolSpec(name="send"),),
                                   requested={"memory_mb": 64.0})
    r.session_run = 3
    r.before = b"never on disk"
    parked(r, HeldCall(0, 1, "send", b"\x04", 12.5))
    svc.runs.save(r)
    assert b"never on disk" not in (tmp_path / "parked" / "job-1.run").read_bytes()
    again = service(tmp_path, pol)
    assert load(again, pol) == 1
    back = again.runs["job-1"]
    assert (back.session_id, back.state_id, back.before) == (r.session_id, r.state_id, None)
    assert back.session_asked == r.session_asked and back.session_run == 3 and back.can_park
    assert again.runs.states() == {r.state_id}


def test_a_parked_run_file_of_format_2_is_read_and_rewritten(tmp_path: Path) -> None:
    """The previous daemon's file (terms as a loose map, the held call and decision as
    lists) is read into the declared record and written back in format 3."""
    import msgpack

    pol = policy()
    directory = tmp_path / "parked"
    directory.mkdir()
    (directory / "job-1.journal").write_bytes(b"")
    old = {
        "format": 2, "job_id": "job-1", "owner_key": 1000, "owner_name": "uid 1000",
        "policy": "ops", "job": JobDescription(code="x").to_wire(), "requested": {},
        "journal": {"entries": 0, "bytes": 0}, "held": [0, 9, "send", b"\x04", 1.0],
        "decision": [True, "ok", "uid 0"], "dispatched": False, "parked_at": 10**10,
        "resumes": 1, "hold": [],
        "session": {"id": "ses-0123456789abcdef", "state": "snap-" + "c" * 32,
                    "terms": {"tools": [], "requested": {}, "idle_s": 30.0,
                              "max_lifetime_s": 600.0, "pause_after_s": 0.0, "run": 4}},
    }
    (directory / "job-1.run").write_bytes(msgpack.packb(old, use_bin_type=True))
    svc = service(tmp_path, pol)
    assert load(svc, pol) == 1
    back = svc.runs["job-1"]
    assert back.life.decision == Decision(True, "ok", "uid 0") and back.life.resumes == 1
    assert back.session_run == 4 and back.session_asked is not None
    assert back.session_asked.max_lifetime_s == 600.0
    data = msgpack.unpackb((directory / "job-1.run").read_bytes(), raw=False)
    assert data["format"] == 3 and data["session"]["run"] == 4


def test_a_parked_run_file_that_does_not_check_is_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each field of the file is checked when read back: a held call's name that is not a
    string, a job id that is not the file's, an unknown field -- each dropped, logged."""
    import logging

    import msgpack

    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    parked(r, HeldCall(0, 1, "send", b"\x04", 12.5))
    svc.runs.save(r)
    good = msgpack.unpackb((tmp_path / "parked" / "job-1.run").read_bytes(), raw=False)
    assert load(service(tmp_path, pol), pol) == 1  # control: the file as written loads
    for bad in ({**good, "held": {**good["held"], "name": 7}},
                {**good, "job_id": "job-2"},
                {**good, "extra": 1},
                {**good, "owner_key": -1}):
        (tmp_path / "parked" / "job-1.run").write_bytes(msgpack.packb(bad, use_bin_type=True))
        with caplog.at_level(logging.WARNING, logger="jaild"):
            assert load(service(tmp_path, pol), pol) == 0, bad
        assert not (tmp_path / "parked" / "job-1.run").exists()


def test_a_session_run_without_its_state_cannot_park(tmp_path: Path) -> None:
    pol = policy()
    r = run(service(tmp_path, pol), pol)
    assert r.can_park  # a one-shot run
    r.session_id = "ses-0123456789abcdef"
    assert not r.can_park  # its state before the run was not taken: it waits live
    r.before = b"state"
    assert r.can_park


def test_junk_on_disk_is_dropped(tmp_path: Path) -> None:
    pol = policy()
    directory = tmp_path / "parked"
    directory.mkdir()
    (directory / "job-x.run").write_bytes(b"\xc1 not msgpack")
    (directory / "job-y.run.tmp1234").write_bytes(b"")
    svc = service(tmp_path, pol)
    assert load(svc, pol) == 0 and list(directory.iterdir()) == []


def test_the_replay_answers_from_the_journal_and_stops_at_a_new_path(tmp_path: Path) -> None:
    asyncio.run(_replay(tmp_path))


async def _replay(tmp_path: Path) -> None:
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    journal(svc, r, Journaled("search", b"a", True, b"hit"),
            Journaled("search", b"b", False, ["ValueError", "bad"]))
    cancelled: list[str] = []
    jail: Any = SimpleNamespace(cancel=cancelled.append)
    r.restart_jail(jail)
    got: list[Any] = []
    r.route("job-1", 1, "search", b"a", False).listen(got.append)
    r.route("job-1", 2, "search", b"b", False).listen(got.append)
    await asyncio.sleep(0)
    assert got == [(True, b"hit"), (False, ("ValueError", "bad"))] and cancelled == []
    r.restart_jail(jail)
    r.route("job-1", 1, "search", b"CHANGED", False).listen(got.append)
    await asyncio.sleep(0)
    assert got[-1][0] is False and got[-1][1][0] == "replay_diverged"
    assert cancelled and "diverged at call 1" in cancelled[0]


def test_a_call_in_flight_at_a_crash_is_never_made_again(tmp_path: Path) -> None:
    """Saved as dispatched (the daemon died while the approved call ran): after the restart
    the replay answers it ``unknown_outcome`` instead of making it a second time."""
    asyncio.run(_in_flight(tmp_path))


async def _in_flight(tmp_path: Path) -> None:
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    journal(svc, r, Journaled("search", b"a", True, b"hit"))
    parked(r, HeldCall(1, 2, "send", b"s", 0.0), Decision(True, "", "uid 0"), dispatched=True)
    svc.runs.save(r)
    again = service(tmp_path, pol)
    assert load(again, pol) == 1
    back = again.runs["job-1"]
    made: list[str] = []
    back.host = SimpleNamespace(call_tool=lambda *a: made.append(a[2]))  # type: ignore[assignment]
    back.life.continue_()
    back.restart_jail(SimpleNamespace())  # type: ignore[arg-type]
    got: list[Any] = []
    back.route("job-1", 1, "search", b"a", False).listen(got.append)
    back.route("job-1", 2, "send", b"s", False).listen(got.append)
    await asyncio.sleep(0)
    assert got[0] == (True, b"hit") and got[1][0] is False
    assert got[1][1][0] == "unknown_outcome" and made == []
    assert back.life.phase is Phase.LIVE
    # live from here: no run file, only its journal (what a later park would replay)
    assert [p.name for p in (tmp_path / "parked").iterdir()] == ["job-1.journal"]
    assert [(j.name, j.ok) for j in back.journal] == [("search", True), ("send", False)]


def test_an_approved_call_is_sent_once_and_on_disk_until_its_reply(tmp_path: Path) -> None:
    """The continuation reaches the approved call: it is saved as dispatched before it goes,
    goes once, and once its reply is journaled the run is live, its file gone."""
    asyncio.run(_dispatched(tmp_path))


async def _dispatched(tmp_path: Path) -> None:
    from jaild.daemon.jails.job import CallReply

    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    parked(r, HeldCall(0, 2, "send", b"s", 0.0), Decision(True, "", "uid 0"))
    made: list[CallReply] = []

    def call_tool(*_: Any) -> CallReply:
        made.append(CallReply())
        return made[-1]

    r.host = SimpleNamespace(call_tool=call_tool)  # type: ignore[assignment]
    r.life.continue_()
    with pytest.raises(Exception, match="cannot be continued"):
        r.life.continue_()  # a continuation is begun once
    r.restart_jail(SimpleNamespace())  # type: ignore[arg-type]
    got: list[Any] = []
    r.route("job-1", 1, "send", b"s", False).listen(got.append)
    assert len(made) == 1 and r.life.phase is Phase.DISPATCHED
    import msgpack
    on_disk = msgpack.unpackb((tmp_path / "parked" / "job-1.run").read_bytes(), raw=False)
    assert on_disk["dispatched"] is True and on_disk["held"]["name"] == "send"
    made[0].resolve(True, b"\xa2ok")
    await asyncio.sleep(0)
    assert got == [(True, b"\xa2ok")] and r.life.phase is Phase.LIVE
    assert not (tmp_path / "parked" / "job-1.run").exists()


def test_a_run_live_at_a_crash_is_not_loaded(tmp_path: Path) -> None:
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    r.life = RunLife(Phase.PARKED, None, parked_at=10**10)  # on disk, no call waiting
    svc.runs.save(r)
    assert load(service(tmp_path, pol), pol) == 0
    assert list((tmp_path / "parked").iterdir()) == []


def test_a_decision_while_the_parked_jail_still_ends_goes_on_once_it_is_gone(
        tmp_path: Path) -> None:
    """A slow machine: the call is decided while the parked run's jail is still ending (its
    live job registered). The continuation waits for the jail to be gone instead of
    registering the job twice; then it goes on by itself."""
    from jaild.daemon.pipeline import Pipeline
    from jaild.daemon.registry import LiveJob, Registry

    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    parked(r, HeldCall(0, 1, "send", b"\x90", time.time()), at=time.time())
    r.host = SimpleNamespace(peer=peer(1000))  # type: ignore[assignment]
    registry = Registry()
    pipeline = Pipeline(None, registry, None, None, None, None)  # type: ignore[arg-type]
    registry.add_job(LiveJob("job-1", SimpleNamespace(pid=None), r.host))  # type: ignore[arg-type]
    due = svc.decide(peer(1000), "job-1", 1, True, "fine")
    assert due is r and r.life.decision is not None
    pipeline.continue_run(r, r.host, None)  # returns at once: the jail is still ending
    assert r.life.phase is Phase.PARKED
    registry.remove_job("job-1")
    assert svc.jail_released(r)  # now it goes on (run_to_record's end starts it)
    assert not svc.jail_released(run(svc, pol, job_id="job-2"))  # control: not parked
