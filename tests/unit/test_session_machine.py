"""The session machine (jaild/daemon/core/session.py): its table, its refusals, and its
invariants under generated event orders -- without a jail."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaild.daemon.core import session as m
from jaild.daemon.core.session import MOVES, Op, Phase, SessionMachine, Start
from jaild.errors import Busy, JaildError, LocalProtocolError, SessionClosed, SessionPaused

EVENTS = typing.get_args(m.Event)


def idle(labels: frozenset[str] = frozenset()) -> SessionMachine:
    s = SessionMachine("ses-1", labels=labels)
    assert s.handle(m.JailReady()) == [m.ArmLifetime(), m.Timers(idle=True)]
    assert s.phase is Phase.IDLE
    return s


def test_every_event_has_a_handler_and_every_phase_its_moves() -> None:
    assert set(m._HANDLERS) == set(EVENTS)
    assert set(MOVES) == set(Phase)
    assert MOVES[Phase.CLOSED] == frozenset()
    for phase in set(Phase) - {Phase.CLOSED}:
        assert Phase.CLOSED in MOVES[phase], f"{phase} cannot be closed"


def test_every_open_phase_is_shown_in_the_wires_words() -> None:
    """``jaild ps`` sends a session's phase as ``JobEntry.state``, whose words are fixed by
    the protocol: a new phase must not send a word an older client refuses."""
    from jaild.protocol.records import JobEntry

    allowed = {"starting", "running", "idle", "paused", "parked"}
    for phase in set(Phase) - {Phase.CLOSED}:
        assert m.shown(phase) in allowed, phase
    assert "state" in JobEntry.__dataclass_fields__
    assert m.shown(Phase.SNAPSHOTTING) == "running"


def test_a_run_goes_and_comes_back_idle() -> None:
    s = idle()
    assert s.handle(m.RunAsked("job-1")) == [m.Timers(idle=False)]
    assert s.phase is Phase.RUNNING and s.runs == 1 and s.busy
    assert s.handle(m.RunEnded("job-1", jail_alive=True)) == [m.Timers(idle=True)]
    assert s.phase is Phase.IDLE and not s.busy


def test_a_run_that_ends_the_jail_closes_the_session_with_its_status() -> None:
    s = idle()
    s.handle(m.RunAsked("job-1"))
    actions = s.handle(m.RunEnded("job-1", jail_alive=False, status="memory_limit",
                                  message="oom"))
    assert s.phase is Phase.CLOSED and s.closed == "memory_limit"
    assert actions[-1] == m.SendClosed("memory_limit", "run job-1 ended the session: oom")
    assert m.Forget() in actions and m.Discard("session memory_limit") in actions


def test_no_run_while_a_snapshot_is_taken_and_the_refusal_says_so() -> None:
    """The refusal names the snapshot (it used to say "running job snapshot")."""
    s = idle()
    s.handle(m.OpAsked(Op.SNAPSHOT))
    with pytest.raises(Busy, match="taking a snapshot") as caught:
        s.handle(m.RunAsked("job-1"))
    assert "job snapshot" not in caught.value.message
    with pytest.raises(Busy):
        s.handle(m.OpAsked(Op.PAUSE))
    assert s.phase is Phase.SNAPSHOTTING and s.runs == 0  # refused: nothing changed
    s.handle(m.OpEnded(None, jail_alive=True))
    s.handle(m.RunAsked("job-1"))  # control: idle again, a run starts
    assert s.phase is Phase.RUNNING


def test_a_pause_leaves_the_session_on_disk_and_a_resume_brings_it_back() -> None:
    s = idle(frozenset({"a"}))
    s.handle(m.OpAsked(Op.PAUSE))
    actions = s.handle(m.OpEnded("snap-1", jail_alive=True))
    assert s.phase is Phase.PAUSED and not s.holds_jail
    assert actions == [m.RetireJail("session paused"), m.Timers(idle=True)]
    with pytest.raises(SessionPaused):
        s.handle(m.RunAsked("job-1"))
    s.handle(m.ResumeAsked(frozenset({"b"})))
    assert s.phase is Phase.STARTING and s.start is Start.RESUME and s.holds_jail
    assert s.labels == {"a", "b"} and s.jails == 2
    with pytest.raises(Busy, match="being resumed already"):
        s.handle(m.ResumeAsked())
    assert s.handle(m.JailReady()) == [m.DeleteState("snap-1"), m.Timers(idle=True)]
    assert s.phase is Phase.IDLE and s.state_id is None


def test_a_resume_that_fails_closes_the_session_and_deletes_its_state() -> None:
    s = idle()
    s.handle(m.OpAsked(Op.PAUSE))
    s.handle(m.OpEnded("snap-1", jail_alive=True))
    s.handle(m.ResumeAsked())
    actions = s.handle(m.JailFailed("no such snapshot"))
    assert s.phase is Phase.CLOSED and s.closed == "restore_failed"
    assert m.DeleteState("snap-1") in actions and m.CancelJail in map(type, actions)


def test_a_closed_paused_session_deletes_its_state() -> None:
    s = idle()
    s.handle(m.OpAsked(Op.PAUSE))
    s.handle(m.OpEnded("snap-1", jail_alive=True))
    actions = s.handle(m.Close("idle", "no run"))
    assert m.DeleteState("snap-1") in actions and m.CancelJail not in map(type, actions)


def test_a_parked_run_detaches_on_disconnect_and_is_dropped_on_close() -> None:
    for reason, expect in (("disconnected", m.Detach("job-1")),
                           ("kill", m.DropParkedRun("job-1", "its session was closed (kill)"))):
        s = idle()
        s.handle(m.RunAsked("job-1"))
        assert s.handle(m.RunParked("job-1", "snap-9")) == [
            m.StopTimers(), m.RetireJail("session run parked")]
        assert s.phase is Phase.PARKED and not s.holds_jail
        with pytest.raises(Busy, match="parked for approval"):
            s.handle(m.RunAsked("job-2"))
        actions = s.handle(m.Close(reason, "bye"))
        assert expect in actions, actions
        assert (m.SendClosed in map(type, actions)) is (reason == "kill")  # detached: silent


def test_a_continuation_comes_back_running_or_stays_parked() -> None:
    s = idle(frozenset({"a"}))
    s.handle(m.RunAsked("job-1"))
    s.handle(m.RunParked("job-1", "snap-9"))
    with pytest.raises(LocalProtocolError):
        s.handle(m.ContinueAsked("job-other"))
    s.handle(m.ContinueAsked("job-1", frozenset({"b"})))
    assert s.phase is Phase.STARTING and s.labels == {"a", "b"}
    assert s.handle(m.JailFailed("no room")) == [m.RetireJail("the parked run did not go on")]
    assert s.phase is Phase.PARKED and s.parked_run == "job-1"  # ResumeRun again
    s.handle(m.ContinueAsked("job-1"))
    assert s.handle(m.JailReady()) == [m.ArmLifetime()]
    assert s.phase is Phase.RUNNING and s.run == "job-1" and s.parked_run is None
    s.handle(m.RunEnded("job-1", jail_alive=True))
    assert s.phase is Phase.IDLE and s.runs == 1  # the continued run is the same run


def test_a_session_closed_while_its_run_continues() -> None:
    """Its client leaves while the fresh jail restores the state: the jail is cancelled and
    the session detached (the run stays parked); closed otherwise, the run is dropped."""
    for reason, expect in (("disconnected", m.Detach("job-1")),
                           ("kill", m.DropParkedRun("job-1", "its session was closed (kill)"))):
        s = idle()
        s.handle(m.RunAsked("job-1"))
        s.handle(m.RunParked("job-1", "snap-9"))
        s.handle(m.ContinueAsked("job-1"))
        actions = s.handle(m.Close(reason, "bye"))
        assert expect in actions and m.CancelJail in map(type, actions), actions
        assert s.phase is Phase.CLOSED and s.run is None
        assert s.handle(m.JailReady()) == [] and s.handle(m.JailFailed("x")) == []


def test_a_jail_that_dies_between_runs_closes_only_an_idle_session() -> None:
    s = idle()
    s.handle(m.RunAsked("job-1"))
    assert s.handle(m.JailDied("memory_limit", "oom")) == []  # the run's end reports it
    s.handle(m.RunEnded("job-1", jail_alive=True))
    actions = s.handle(m.JailDied("memory_limit", "oom"))
    assert s.closed == "memory_limit" and m.SendClosed in map(type, actions)


def test_a_failed_open_is_forgotten_without_a_close() -> None:
    s = SessionMachine("ses-1")
    with pytest.raises(Busy, match="still starting"):
        s.check_runnable()
    assert s.handle(m.JailFailed("no jail")) == [m.Forget()]
    with pytest.raises(SessionClosed):
        s.check_runnable()


def test_an_illegal_move_is_a_jaild_bug() -> None:
    s = idle()
    with pytest.raises(LocalProtocolError, match="from IDLE to PAUSED"):
        s._go(Phase.PAUSED)
    assert s.phase is Phase.IDLE


# -- invariants under generated event orders

_event = st.one_of(
    st.just(m.JailReady()),
    st.builds(m.JailFailed, st.just("x")),
    st.builds(m.RunAsked, st.sampled_from(["job-1", "job-2"])),
    st.builds(m.RunEnded, st.sampled_from(["job-1", "job-2"]), st.booleans()),
    st.builds(m.OpAsked, st.sampled_from(list(Op))),
    st.builds(m.OpEnded, st.sampled_from([None, "snap-1"]), st.booleans()),
    st.builds(m.ResumeAsked, st.frozensets(st.sampled_from("ab"))),
    st.builds(m.RunParked, st.sampled_from(["job-1", "job-2"]), st.just("snap-2")),
    st.builds(m.ContinueAsked, st.sampled_from(["job-1", "job-2"]),
              st.frozensets(st.sampled_from("bc"))),
    st.builds(m.ParkedRunDropped, st.sampled_from(["job-1", "job-2"])),
    st.builds(m.JailDied, st.just("killed"), st.just("")),
    st.builds(m.Close, st.sampled_from(["idle", "disconnected", "kill"]), st.just("")),
    st.builds(m.Labeled, st.frozensets(st.sampled_from("xyz"))),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_event, max_size=40))
def test_invariants_hold_whatever_the_order(events: list[m.Event]) -> None:
    s = SessionMachine("ses-1", labels=frozenset({"start"}))
    closes = 0
    for event in events:
        before_phase, before_labels = s.phase, s.labels
        try:
            actions = s.handle(event)
        except JaildError:
            assert (s.phase, s.labels) == (before_phase, before_labels)  # refused: unchanged
            continue
        # every phase change is a legal move
        assert s.phase is before_phase or s.phase in MOVES[before_phase]
        # the labels never shrink
        assert before_labels <= s.labels
        # no run or second op while a snapshot is taken
        if before_phase is Phase.SNAPSHOTTING:
            assert s.phase is not Phase.RUNNING
        # a session says it closed at most once; a closed one stays closed, silent
        closes += sum(isinstance(a, (m.SendClosed, m.Detach)) for a in actions)
        assert closes <= 1
        if before_phase is Phase.CLOSED:
            assert actions == [] and s.phase is Phase.CLOSED
        # one run at a time: a run only starts from idle
        if isinstance(event, m.RunAsked):
            assert before_phase is Phase.IDLE
        assert (s.run is not None) == (s.phase is Phase.RUNNING or (
            s.phase is Phase.STARTING and s.start is Start.CONTINUE))
    assert "start" in s.labels
