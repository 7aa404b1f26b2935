"""Durable runs' journals on disk and the quotas per principal (jaild.daemon.state.journal, and
their use in jaild.daemon.approvals) -- without a jail."""

from __future__ import annotations

import asyncio
import logging
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from jaild.daemon.approvals import Approvals, DurableRun
from jaild.daemon.core.parked import HeldCall, Phase, RunLife
from jaild.daemon.jails.job import CallReply
from jaild.daemon.state.journal import ApprovalQuota, Journal, Journaled
from jaild.daemon.state.parkedruns import ParkedRuns
from jaild.errors import JournalDamaged, QuotaExceeded
from jaild.policy.schema import load_policy_text
from jaild.protocol.messages import JobDescription, ToolSpec

ENTRIES = [Journaled("search", b"\x91\xa1x", True, b"\x92\xa1x\xa3hit", ("private",)),
           Journaled("send", b"\x90", False, ["denied", "not today"])]


def policy() -> Any:
    return load_policy_text('[access]\napprove = ["send"]\n[approvals]\npark_after_s = 5\n',
                            "/p/ops.toml")


class NoSessions:
    def parked(self, run: DurableRun) -> None:
        pass

    def dropped(self, run: DurableRun) -> None:
        pass


def service(tmp_path: Path, quota: ApprovalQuota | None = None) -> Approvals:
    runs = ParkedRuns(str(tmp_path / "parked"), quota or ApprovalQuota(32, 1 << 20),
                      lambda: None)  # type: ignore[arg-type,return-value]
    return Approvals(runs, NoSessions())


def load(svc: Approvals) -> int:
    pol = policy()
    return svc.load({pol.name: pol})


def tracked(svc: Approvals, job_id: str, owner: int | str = 1000) -> DurableRun:
    r = DurableRun(job_id, owner, f"uid {owner}", policy(),
                   JobDescription(code="x", tools=(ToolSpec(name="send"),)), {}, svc,
                   Journal(svc.runs.path(job_id, "journal")))
    svc.runs.add(r)
    return r


# -- the journal's file


def test_entries_are_appended_to_a_private_file_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    journal = Journal(str(path))
    sizes = [journal.append(e) for e in ENTRIES]
    assert (journal.entries, journal.bytes) == (2, sum(sizes)) == (2, path.stat().st_size)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(journal) == ENTRIES
    second, end = journal.read(sizes[0])
    assert second == ENTRIES[1] and end == journal.bytes
    # what the daemon holds of it is three fields, whatever the number of calls
    assert set(vars(journal)) == {"path", "entries", "bytes"}
    for _ in range(100):
        journal.append(ENTRIES[0])
    assert set(vars(journal)) == {"path", "entries", "bytes"} and len(journal) == 102


def test_a_journal_cut_short_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    journal = Journal(str(path))
    for e in ENTRIES:
        journal.append(e)
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # the last entry cut
    again = Journal(str(path), journal.entries, journal.bytes)
    with pytest.raises(JournalDamaged, match=rf"cut short: {len(whole) - 3} bytes of the "
                                             rf"{len(whole)} its run recorded"):
        again.check()
    cut = Journal(str(path), 2, len(whole) - 3)  # a record that agrees with the cut file
    with pytest.raises(JournalDamaged, match="ends inside the entry at byte"):
        cut.check()
    with pytest.raises(JournalDamaged, match="ends inside the entry at byte"):
        list(cut)
    with pytest.raises(JournalDamaged, match="cannot be read"):
        Journal(str(tmp_path / "missing"), 1, 10).check()


def test_a_corrupt_journal_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    path.write_bytes(b"\xc1\xc1\xc1")  # never valid msgpack
    with pytest.raises(JournalDamaged, match="byte 0 does not decode"):
        Journal(str(path), 1, 3).check()
    shape = msgpack.packb({"not": "an entry"})
    path.write_bytes(shape)
    with pytest.raises(JournalDamaged, match="at byte 0 is not an entry"):
        Journal(str(path), 1, len(shape)).read(0)
    wrong = msgpack.packb(["send", b"", True, "a str, not packed bytes", []])
    path.write_bytes(wrong)
    with pytest.raises(JournalDamaged, match="not an entry"):
        Journal(str(path), 1, len(wrong)).check()
    journal = Journal(str(tmp_path / "other.journal"))
    journal.append(ENTRIES[0])
    with pytest.raises(JournalDamaged, match="holds 1 entries; its run recorded 2"):
        Journal(journal.path, 2, journal.bytes).check()


def test_a_journal_longer_than_recorded_is_cut_back(tmp_path: Path) -> None:
    """A reply appended after the run's file was written (the decided call's, when the
    daemon died before the run went live): the file is cut back to what the run records."""
    path = tmp_path / "j.journal"
    journal = Journal(str(path))
    journal.append(ENTRIES[0])
    recorded = journal.bytes
    journal.append(ENTRIES[1])
    again = Journal(str(path), 1, recorded)
    again.check()
    assert path.stat().st_size == recorded and list(again) == [ENTRIES[0]]


def test_a_journal_never_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / "j.journal").symlink_to(target)
    with pytest.raises(OSError):
        Journal(str(tmp_path / "j.journal")).append(ENTRIES[0])
    assert target.read_bytes() == b""


# -- the quota arithmetic


def test_the_parked_count_quota() -> None:
    quota = ApprovalQuota(max_parked=2, journal_bytes=100)
    quota.may_park(1000, "uid 1000", 0)
    quota.may_park(1000, "uid 1000", 1)
    with pytest.raises(QuotaExceeded) as caught:
        quota.may_park(1000, "uid 1000", 2)
    message = caught.value.message
    assert "runs of uid 1000 parked for approval: 2;" in message and "at most 2" in message
    assert "limits.approvals_parked_max_count" in message and caught.value.code == "quota_exceeded"


def test_the_journal_bytes_quota_is_per_principal() -> None:
    quota = ApprovalQuota(max_parked=2, journal_bytes=100)
    quota.add(1000, 60)
    quota.may_journal(1000, "uid 1000", 40)  # exactly at the quota: fits
    with pytest.raises(QuotaExceeded) as caught:
        quota.may_journal(1000, "uid 1000", 41)
    assert ("41 bytes" in caught.value.message and "hold 60" in caught.value.message
            and "quota is 100 bytes" in caught.value.message
            and "limits.approvals_journal_quota_mb" in caught.value.message)
    quota.may_journal(65534, "uid 65534", 100)  # another principal's journals: its own
    quota.add(65534, 100)
    assert quota.total() == 160
    quota.remove(1000, 60)
    assert quota.held[1000] == 0 and 1000 not in quota.held and quota.total() == 100
    quota.remove(65534, 500)  # never below zero
    assert quota.total() == 0


# -- in the approvals service


def test_replies_go_to_disk_and_count_against_their_principal(tmp_path: Path) -> None:
    svc = service(tmp_path)
    r = tracked(svc, "job-1")
    other = tracked(svc, "job-2", owner=65534)
    assert not (tmp_path / "parked").exists()  # nothing until the first reply
    svc.runs.journal_append(r, ENTRIES[0])
    size = (tmp_path / "parked" / "job-1.journal").stat().st_size
    assert stat.S_IMODE((tmp_path / "parked").stat().st_mode) == 0o700
    svc.runs.journal_append(r, ENTRIES[1])
    assert (tmp_path / "parked" / "job-1.journal").stat().st_size > size
    svc.runs.journal_append(other, ENTRIES[0])
    assert svc.runs.usage(1000) == (1, 0, r.journal.bytes)
    assert svc.runs.usage(None) == (2, 0, r.journal.bytes + other.journal.bytes)
    svc.ended(r)  # its file goes, and its bytes from its principal's
    assert not (tmp_path / "parked" / "job-1.journal").exists()
    assert svc.runs.usage(1000) == (0, 0, 0) and svc.runs.usage(None)[2] == other.journal.bytes


def test_a_reply_past_the_journal_quota_stops_its_run(tmp_path: Path) -> None:
    asyncio.run(_past_journal_quota(tmp_path))


async def _past_journal_quota(tmp_path: Path) -> None:
    svc = service(tmp_path, ApprovalQuota(32, 200))
    r = tracked(svc, "job-1")
    cancelled: list[str] = []
    r.jail = SimpleNamespace(cancel=cancelled.append)  # type: ignore[assignment]
    inner: list[CallReply] = []

    def call_tool(*_: Any) -> CallReply:
        inner.append(CallReply())
        return inner[-1]

    r.host = SimpleNamespace(call_tool=call_tool)  # type: ignore[assignment]
    got: list[Any] = []
    r.route("job-1", 1, "search", b"\x90", False).listen(got.append)
    inner[-1].resolve(True, b"\xa2ok")
    r.route("job-1", 2, "search", b"\x90", False).listen(got.append)
    inner[-1].resolve(True, b"\xc4" + bytes([190]) + b"x" * 190)  # past the 200 bytes
    await asyncio.sleep(0)
    assert got[0] == (True, b"\xa2ok")
    assert got[1][0] is False and got[1][1][0] == "quota_exceeded"
    assert "limits.approvals_journal_quota_mb" in got[1][1][1]
    assert cancelled and cancelled[0].startswith("quota_exceeded: ")
    assert r.journal.entries == 1  # the reply that did not fit was not written
    # control: another principal's run journals that same reply
    other = tracked(svc, "job-2", owner=65534)
    svc.runs.journal_append(other, Journaled("search", b"\x90", True, b"x" * 150))


def test_a_run_past_the_parked_count_is_refused_parking(tmp_path: Path) -> None:
    asyncio.run(_past_parked_count(tmp_path))


async def _past_parked_count(tmp_path: Path) -> None:
    svc = service(tmp_path, ApprovalQuota(1, 1 << 20))
    runs = {job: tracked(svc, job, owner) for job, owner in
            (("job-1", 1000), ("job-2", 1000), ("job-3", 65534))}
    cancelled: dict[str, list[str]] = {job: [] for job in runs}
    got: dict[str, list[Any]] = {job: [] for job in runs}
    for job, r in runs.items():
        r.jail = SimpleNamespace(cancel=cancelled[job].append)  # type: ignore[assignment]
        r.route(job, 1, "send", b"\x90", True).listen(got[job].append)
        assert r.held is not None
        r.park_now()
    await asyncio.sleep(0)
    one, two, three = runs.values()
    assert one.parked and cancelled["job-1"] and got["job-1"] == []  # under the quota: parks
    assert (tmp_path / "parked" / "job-1.run").exists()
    # its principal's second: refused parking, the call answered, the run goes on live
    assert not two.parked and two.held is None and cancelled["job-2"] == []
    [(ok, (code, message))] = got["job-2"]
    assert (ok, code) == (False, "quota_exceeded")
    assert "runs of uid 1000 parked for approval: 1;" in message and "at most 1" in message
    assert not (tmp_path / "parked" / "job-2.run").exists()
    assert [(j.name, j.ok) for j in two.journal] == [("send", False)]  # a replay answers it so
    assert three.parked  # control: another principal's run parks
    assert svc.runs.usage(1000)[:2] == (2, 1) and svc.runs.usage(None)[:2] == (3, 2)


def test_a_parked_run_with_a_damaged_journal_is_dropped_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc = service(tmp_path)
    r = tracked(svc, "job-1")
    for e in ENTRIES:
        svc.runs.journal_append(r, e)
    r.life = RunLife(Phase.PARKED, HeldCall(2, 9, "send", b"\x90", 1.0), parked_at=10**10)
    svc.runs.save(r)
    good = service(tmp_path)
    assert load(good) == 1 and list(good.runs["job-1"].journal) == ENTRIES
    assert good.runs.usage(1000) == (1, 1, r.journal.bytes)
    path = tmp_path / "parked" / "job-1.journal"
    path.write_bytes(path.read_bytes()[:5])
    with caplog.at_level(logging.WARNING, logger="jaild"):
        assert load(service(tmp_path)) == 0
    assert "parked run job-1.run unreadable" in caplog.text and "cut short" in caplog.text
    assert list((tmp_path / "parked").iterdir()) == []


def test_a_replay_from_a_journal_damaged_since_stops_the_run(tmp_path: Path) -> None:
    asyncio.run(_damaged_replay(tmp_path))


async def _damaged_replay(tmp_path: Path) -> None:
    svc = service(tmp_path)
    r = tracked(svc, "job-1")
    for e in ENTRIES:
        svc.runs.journal_append(r, e)
    Path(r.journal.path).write_bytes(b"\xc1" * r.journal.bytes)
    cancelled: list[str] = []
    r.restart_jail(SimpleNamespace(cancel=cancelled.append))  # type: ignore[arg-type]
    got: list[Any] = []
    r.route("job-1", 1, "search", b"\x91\xa1x", False).listen(got.append)
    await asyncio.sleep(0)
    assert got[0][0] is False and got[0][1][0] == "journal_damaged"
    assert str(tmp_path) not in got[0][1][1]  # the jail is not told the daemon's paths
    assert cancelled and cancelled[0].startswith("journal_damaged: ")


def test_a_run_file_of_format_1_has_its_journal_moved_to_disk(tmp_path: Path) -> None:
    """A daemon of the previous format kept the journal inside the run's file: read, it goes
    to its own file and the run's file is rewritten in this format."""
    directory = tmp_path / "parked"
    directory.mkdir()
    old = {
        "format": 1, "job_id": "job-1", "owner_key": 1000, "owner_name": "uid 1000",
        "policy": "ops", "job": JobDescription(code="x").to_wire(), "requested": {},
        "journal": [["search", b"\x01", True, b"\x02"], ["send", b"\x03", False, ["E", "m"], []]],
        "held": [2, 9, "send", b"\x04", 1.0], "decision": None, "dispatched": False,
        "parked_at": 10**10, "resumes": 0, "session": None,
    }
    (directory / "job-1.run").write_bytes(msgpack.packb(old, use_bin_type=True))
    svc = service(tmp_path)
    assert load(svc) == 1
    back = svc.runs["job-1"]
    assert [(j.name, j.value) for j in back.journal] == [("search", b"\x02"),
                                                          ("send", ["E", "m"])]
    data = msgpack.unpackb((directory / "job-1.run").read_bytes(), raw=False)
    assert data["format"] == 3
    assert (data["journal_entries"], data["journal_bytes"]) == (2, back.journal.bytes)
    assert load(service(tmp_path)) == 1  # and read again in this format


def test_journals_of_runs_live_at_a_crash_go_at_start(tmp_path: Path) -> None:
    directory = tmp_path / "parked"
    directory.mkdir()
    (directory / "job-9.journal").write_bytes(Journaled("a", b"", True, b"").pack())
    assert load(service(tmp_path)) == 0
    assert list(directory.iterdir()) == []


def test_durable_runs_are_read_into_the_metrics_when_collected() -> None:
    from prometheus_client import generate_latest

    from jaild.daemon.observe.metrics import Metrics

    usage = [(3, 2, 1234)]
    metrics = Metrics(None)
    metrics.approvals(lambda: usage[0])
    summary = metrics.summary()
    assert (summary["durable_runs"], summary["parked_runs"],
            summary["approval_journal_bytes"]) == (3, 2, 1234)
    usage[0] = (1, 0, 10)  # read when collected, not pushed
    text = generate_latest(metrics.registry).decode()
    assert "jaild_durable_runs 1.0" in text and "jaild_parked_runs 0.0" in text
    assert "jaild_approval_journal_bytes 10.0" in text
