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
from jaild.daemon.core.admission import Catalog
from jaild.daemon.core.peer import Peer
from jaild.daemon.journal import ApprovalQuota, Journal
from jaild.daemon.registry import Registry
from jaild.policy.schema import load_policy_text
from jaild.protocol.messages import JobDescription, ToolSpec


def policy(approvers: str = "") -> Any:
    return load_policy_text(
        f'[access]\napprove = ["send"]\n[approvals]\npark_after_s = 5\n{approvers}', "/p/ops.toml")


def service(tmp_path: Path, pol: Any, quota: ApprovalQuota | None = None) -> Approvals:
    return Approvals(str(tmp_path / "parked"), Registry(), SimpleNamespace(env=None),  # type: ignore[arg-type]
                     SimpleNamespace(), lambda: Catalog({pol.name: pol}), lambda *_: None,
                     quota=quota or ApprovalQuota(32, 256 << 20))


def run(svc: Approvals, pol: Any, owner: int | str = 1000, job_id: str = "job-1") -> DurableRun:
    r = DurableRun(job_id, owner, f"uid {owner}", pol,
                   JobDescription(code="x", tools=(ToolSpec(name="send"),)), {"wall_time_s": 5},
                   journal=Journal(f"{svc.directory}/{job_id}.journal"))
    r.service = svc
    svc.runs[r.job_id] = r
    return r


def journal(svc: Approvals, r: DurableRun, *entries: Journaled) -> None:
    for entry in entries:
        svc.journal_append(r, entry)


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
    from jaild.daemon.approvals import Held
    from jaild.errors import PermissionDenied, UnknownJob

    pol = policy('approvers = ["1001"]\n')
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    r.held = Held(0, 7, "send", b"\x92\x90\x80", 0.0)
    assert svc.pending(peer(1002)) == [] and len(svc.pending(peer(1001))) == 1
    with pytest.raises(UnknownJob):
        svc.decide(peer(1002), "job-1", 7, True, "")
    with pytest.raises(PermissionDenied):
        svc.decide(peer(1000), "job-1", 7, True, "")  # its owner, not an approver here
    with pytest.raises(UnknownJob):
        svc.decide(peer(1001), "job-1", 8, True, "")  # no such call waits


def test_a_parked_run_is_read_back_as_it_was_written(tmp_path: Path) -> None:
    from jaild.daemon.approvals import Held

    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    journal(svc, r, Journaled("search", b"\x01", True, b"\x02"),
            Journaled("other", b"\x03", False, ["KeyError", "no"]))
    r.held = Held(2, 9, "send", b"\x04", 12.5)
    r.parked, r.parked_at = True, 10**10  # far in the future: not past max_wait_s
    r.decision = (True, "fine", "uid 0")
    r.hold = ("untrusted", "user:alice")  # the caller's labels: its continuation holds them
    svc.save(r)
    again = service(tmp_path, pol)
    assert again.load() == 1
    back = again.runs["job-1"]
    assert [(j.name, j.args, j.ok, j.value) for j in back.journal] == \
        [("search", b"\x01", True, b"\x02"), ("other", b"\x03", False, ["KeyError", "no"])]
    assert back.held is not None and (back.held.index, back.held.call_id, back.held.name) == \
        (2, 9, "send")
    assert back.decision == (True, "fine", "uid 0") and back.parked and back.host is None
    assert back.job.tools[0].name == "send" and back.requested == {"wall_time_s": 5}
    assert back.session_id is None and again.states() == set()
    assert back.hold == ("untrusted", "user:alice")


def test_a_parked_session_run_keeps_what_re_opens_its_session(tmp_path: Path) -> None:
    """A session's run: its session's id, the terms it was opened with and its state's
    snapshot id come back from disk (the state itself is in the snapshot store), and the
    start's sweep is told to keep that state."""
    from jaild.daemon.approvals import Held

    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    r.session_id, r.state_id = "ses-0123456789abcdef", "snap-" + "b" * 32
    r.session_terms = {"tools": [{"name": "send"}], "requested": {"memory_mb": 64.0},
                       "idle_s": 30.0, "max_lifetime_s": 600.0, "pause_after_s": 0.0, "run": 3}
    r.before = b"never on disk"
    r.held = Held(0, 1, "send", b"\x04", 12.5)
    r.parked, r.parked_at = True, 10**10
    svc.save(r)
    assert b"never on disk" not in (tmp_path / "parked" / "job-1.run").read_bytes()
    again = service(tmp_path, pol)
    assert again.load() == 1
    back = again.runs["job-1"]
    assert (back.session_id, back.state_id, back.before) == (r.session_id, r.state_id, None)
    assert back.session_terms == r.session_terms and back.can_park
    assert again.states() == {r.state_id}
    assert again.session_run(r.session_id) is back


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
    assert svc.load() == 0 and list(directory.iterdir()) == []


def test_the_replay_answers_from_the_journal_and_stops_at_a_new_path(tmp_path: Path) -> None:
    asyncio.run(_replay(tmp_path))


async def _replay(tmp_path: Path) -> None:
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    journal(svc, r, Journaled("search", b"a", True, b"hit"),
            Journaled("search", b"b", False, ["ValueError", "bad"]))
    cancelled: list[str] = []
    r.jail = SimpleNamespace(cancel=cancelled.append)  # type: ignore[assignment]
    r.restart_jail()
    got: list[Any] = []
    r.route("job-1", 1, "search", b"a", False).listen(got.append)
    r.route("job-1", 2, "search", b"b", False).listen(got.append)
    await asyncio.sleep(0)
    assert got == [(True, b"hit"), (False, ("ValueError", "bad"))] and cancelled == []
    r.restart_jail()
    r.route("job-1", 1, "search", b"CHANGED", False).listen(got.append)
    await asyncio.sleep(0)
    assert got[-1][0] is False and got[-1][1][0] == "replay_diverged"
    assert cancelled and "diverged at call 1" in cancelled[0]


def test_a_call_in_flight_at_a_crash_is_never_made_again(tmp_path: Path) -> None:
    """Saved as dispatched (the daemon died while the approved call ran): after the restart
    the replay answers it ``unknown_outcome`` instead of making it a second time."""
    asyncio.run(_in_flight(tmp_path))


async def _in_flight(tmp_path: Path) -> None:
    from jaild.daemon.approvals import Held

    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    journal(svc, r, Journaled("search", b"a", True, b"hit"))
    r.held = Held(1, 2, "send", b"s", 0.0)
    r.decision, r.dispatched, r.parked, r.parked_at = (True, "", "uid 0"), True, True, 10**10
    svc.save(r)
    again = service(tmp_path, pol)
    assert again.load() == 1
    back = again.runs["job-1"]
    made: list[str] = []
    back.host = SimpleNamespace(call_tool=lambda *a: made.append(a[2]))  # type: ignore[assignment]
    back.restart_jail()
    got: list[Any] = []
    back.route("job-1", 1, "search", b"a", False).listen(got.append)
    back.route("job-1", 2, "send", b"s", False).listen(got.append)
    await asyncio.sleep(0)
    assert got[0] == (True, b"hit") and got[1][0] is False
    assert got[1][1][0] == "unknown_outcome" and made == []
    # live from here: no run file, only its journal (what a later park would replay)
    assert [p.name for p in (tmp_path / "parked").iterdir()] == ["job-1.journal"]
    assert [(j.name, j.ok) for j in back.journal] == [("search", True), ("send", False)]


def test_a_run_live_at_a_crash_is_not_loaded(tmp_path: Path) -> None:
    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    r.parked, r.parked_at = True, 10**10  # on disk, but with no call waiting
    svc.save(r)
    assert service(tmp_path, pol).load() == 0
    assert list((tmp_path / "parked").iterdir()) == []


def test_a_decision_while_the_parked_jail_still_ends_goes_on_once_it_is_gone(
        tmp_path: Path) -> None:
    """A slow machine: the call is decided while the parked run's jail is still ending (its
    live job registered). The continuation waits for the jail to be gone instead of
    registering the job twice; then it goes on by itself."""
    from jaild.daemon.approvals import Held
    from jaild.daemon.registry import LiveJob

    pol = policy()
    svc = service(tmp_path, pol)
    r = run(svc, pol)
    r.held = Held(0, 1, "send", b"\x90", time.time())
    r.parked, r.parked_at, r.jail = True, time.time(), SimpleNamespace()  # type: ignore[assignment]
    r.host = SimpleNamespace(peer=peer(1000))  # type: ignore[assignment]
    seen: list[bool] = []
    original = svc._continue

    def spy(run: DurableRun, host: Any, ref: int | None) -> None:
        seen.append(svc.registry.job(run.job_id) is None)
        if not seen[-1]:
            original(run, host, ref)  # returns at once: the jail is still ending

    svc._continue = spy  # type: ignore[method-assign]
    svc.registry.add_job(LiveJob("job-1", SimpleNamespace(pid=None), r.host))  # type: ignore[arg-type]
    svc.decide(peer(1000), "job-1", 1, True, "fine")
    assert seen == [False] and r.decision is not None
    svc.registry.remove_job("job-1")
    svc.jail_released(r)
    assert seen == [False, True]
