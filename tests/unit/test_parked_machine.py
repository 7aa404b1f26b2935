"""The parked-run machine and its file (jaild/daemon/core/parked.py) -- without a jail."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaild.daemon.core.parked import (
    MOVES,
    AtHeld,
    Decision,
    Diverged,
    HeldCall,
    ParkedRunFile,
    Phase,
    RunLife,
    replay_step,
    upgrade,
)
from jaild.errors import LocalProtocolError
from jaild.protocol.messages import JobDescription

CALL = HeldCall(index=0, call_id=1, name="send", args=b"\x90", since=1.0)


def test_every_phase_has_its_moves_and_ends() -> None:
    assert set(MOVES) == set(Phase) and MOVES[Phase.ENDED] == frozenset()
    for phase in set(Phase) - {Phase.ENDED}:
        assert Phase.ENDED in MOVES[phase], phase


def test_a_parked_run_continues_once_and_its_call_goes_once() -> None:
    life = RunLife()
    life.hold(CALL)
    assert life.waiting and not life.on_disk
    life.park(10.0)
    assert life.parked and life.on_disk and not life.can_continue
    with pytest.raises(LocalProtocolError, match="not decided"):
        life.continue_()
    life.decide(Decision(allow=True, by="uid 0"))
    with pytest.raises(LocalProtocolError):
        life.decide(Decision(allow=False))  # decided once
    life.continue_()
    with pytest.raises(LocalProtocolError):
        life.continue_()  # continued once
    assert life.at_held() is AtHeld.DISPATCH and life.dispatched and life.on_disk
    with pytest.raises(LocalProtocolError):
        life.at_held()  # sent once
    assert life.replied() is True and life.phase is Phase.LIVE and not life.on_disk


def test_a_denied_or_crashed_call_is_answered_not_sent() -> None:
    for decision, dispatched, outcome in ((Decision(allow=False), False, AtHeld.DENY),
                                          (Decision(allow=True), True, AtHeld.UNKNOWN_OUTCOME)):
        life = RunLife(Phase.PARKED, CALL, decision, dispatched, 1.0)
        life.continue_()
        assert life.at_held() is outcome and life.phase is Phase.LIVE
        assert not life.dispatched and life.held is None


def test_a_continuation_that_does_not_start_is_parked_again() -> None:
    life = RunLife(Phase.PARKED, CALL, Decision(allow=True), False, 1.0)
    life.continue_()
    life.set_back()
    assert life.can_continue and life.resumes == 0


def test_a_run_waiting_on_its_decided_call_does_not_forget_it_for_a_later_hold() -> None:
    """Concurrent calls: while the decided call's reply is awaited, another call needs
    approval. The dispatched mark stays until that reply, and the later hold is kept."""
    life = RunLife(Phase.PARKED, CALL, Decision(allow=True), False, 1.0)
    life.continue_()
    life.at_held()
    later = HeldCall(index=3, call_id=4, name="send", args=b"\x91", since=2.0)
    life.hold(later)
    assert life.dispatched and life.phase is Phase.HELD
    assert life.replied() is True  # nothing on disk: the later call waits live
    assert life.held == later and life.waiting


def test_replay_steps_are_typed() -> None:
    assert replay_step(0, ("a", b"1"), ("a", b"1")) is None
    assert replay_step(2, ("a", b"1"), ("b", b"1")) == Diverged(
        "the replay diverged at call 3: the run called 'b' where it had called 'a'")
    other = replay_step(0, ("a", b"1"), ("a", b"2"), held=True)
    assert other is not None and other.why.endswith("with other arguments")
    assert "the call that waited for approval" in other.why


def test_the_file_checks_what_it_reads() -> None:
    saved = ParkedRunFile(job_id="job-1", owner_key=1000, owner_name="uid 1000",
                          policy="ops", job=JobDescription(code="x"), held=CALL,
                          decision=Decision(allow=True, reason="ok", by="uid 0"))
    assert ParkedRunFile.from_wire(saved.to_wire()) == saved
    for bad in ({"job_id": "../etc"}, {"owner_key": 1.5}, {"format": 2},
                {"held": {"index": 0}}, {"policy": ""}):
        with pytest.raises(LocalProtocolError):
            ParkedRunFile.from_wire({**saved.to_wire(), **bad})


def test_a_format_2_map_upgrades() -> None:
    old = {
        "format": 2, "job_id": "job-1", "owner_key": "principal:ops", "owner_name": "ops",
        "policy": "ops", "job": JobDescription(code="x").to_wire(), "requested": {},
        "journal": {"entries": 1, "bytes": 9}, "held": [0, 1, "send", b"\x90", 1.0],
        "decision": None, "dispatched": False, "parked_at": 5.0, "resumes": 0,
        "session": None,
    }
    saved = ParkedRunFile.from_wire(upgrade(old))
    assert saved.held == CALL and saved.journal_entries == 1 and saved.hold == ()


# -- invariants under generated orders

_ops = st.lists(st.sampled_from(
    ["hold", "release", "park", "decide_yes", "decide_no", "continue", "set_back", "at_held",
     "replied", "end"]), max_size=30)


@settings(max_examples=400, deadline=None)
@given(_ops)
def test_the_decided_call_is_sent_at_most_once_per_decision(ops: list[str]) -> None:
    life = RunLife()
    decisions = sends = 0
    for op in ops:
        before = life.phase
        try:
            if op == "hold":
                life.hold(CALL)
            elif op == "release":
                life.released()
            elif op == "park":
                life.park(1.0)
            elif op in ("decide_yes", "decide_no"):
                life.decide(Decision(allow=op == "decide_yes"))
                decisions += op == "decide_yes"
            elif op == "continue":
                life.continue_()
            elif op == "set_back":
                life.set_back()
            elif op == "at_held":
                sends += life.at_held() is AtHeld.DISPATCH
            elif op == "replied":
                life.replied()
            else:
                life.end()
        except (LocalProtocolError, AssertionError):
            assert life.phase is before  # refused: it stays where it was
            continue
        assert life.phase is before or life.phase in MOVES[before]
        assert sends <= decisions
        if life.phase is Phase.CONTINUING:
            assert life.decision is not None
