"""A starting daemon's readiness (jaild/daemon/core/readiness.py): its phases as data, what it
tells a client, which requests wait; and the ``starting`` error as the client rebuilds it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaild.daemon.config import DaemonConfig, load_config_file
from jaild.daemon.core.readiness import (
    TRANSITIONS,
    WAITING,
    Phase,
    Readiness,
    check_waiting,
    must_wait,
)
from jaild.errors import (
    ERROR_CLASSES,
    EXIT_UNAVAILABLE,
    Busy,
    PolicyError,
    Starting,
    error_from_wire,
    exit_code_for,
)
from jaild.protocol.messages import (
    ApproveCall,
    CancelJob,
    DeleteSnapshot,
    GetStats,
    JobDescription,
    Kill,
    ListApprovals,
    ListJobs,
    ListPolicies,
    ListSnapshots,
    OpenSession,
    Ping,
    ResumeRun,
    ResumeSession,
    RunJob,
)
from jaild.protocol.messages import Starting as StartingInfo

TERMINAL = {Phase.READY, Phase.FAILED}
RUN = RunJob(ref=1, job=JobDescription(code="6*7"), policy="default")


def test_the_transition_table_covers_every_phase_and_moves_only_forward() -> None:
    assert set(TRANSITIONS) == set(Phase)
    order = list(Phase)
    for phase, nexts in TRANSITIONS.items():
        if phase in TERMINAL:
            assert nexts == frozenset(), phase
            continue
        assert Phase.FAILED in nexts, f"{phase} cannot fail"
        assert all(order.index(n) > order.index(phase) for n in nexts), phase


def test_every_phase_reaches_ready() -> None:
    for start in set(Phase) - TERMINAL:
        seen, todo = set(), [start]
        while todo:
            phase = todo.pop()
            seen.add(phase)
            todo.extend(TRANSITIONS[phase] - seen)
        assert Phase.READY in seen, start


def test_an_illegal_move_is_refused_and_a_legal_one_made() -> None:
    readiness = Readiness(wait_s=30)
    with pytest.raises(ValueError, match="from STAGING to READY"):
        readiness.advance(Phase.READY)
    assert readiness.phase is Phase.STAGING
    readiness.advance(Phase.ZYGOTES, ["web", "default"])  # control: a legal move is made
    assert readiness.phase is Phase.ZYGOTES
    ready = Readiness(wait_s=30, phase=Phase.READY)
    with pytest.raises(ValueError):
        ready.advance(Phase.FAILED)  # a daemon ready has nothing left to fail


def test_a_starting_daemon_says_what_is_pending_and_the_bound() -> None:
    readiness = Readiness(wait_s=12.5)
    readiness.advance(Phase.ZYGOTES, ["web", "default"])
    readiness.advance(Phase.SELF_TESTS, ["web", "default"])
    assert readiness.starting and not readiness.ready
    assert readiness.pending() == "running the self-tests of policies default, web"
    assert readiness.welcome() == StartingInfo(
        pending="running the self-tests of policies default, web", wait_s=12.5)
    error = readiness.timed_out()
    assert isinstance(error, Starting) and error.code == "starting"
    assert "running the self-tests of policies default, web" in error.message
    assert "12.5 s" in error.message and "limits.startup_wait_s" in error.message
    readiness.advance(Phase.STATE)
    assert readiness.pending() == Phase.STATE.value  # no policies: the phase alone
    readiness.advance(Phase.READY)
    assert readiness.ready and not readiness.starting
    assert readiness.welcome() is None  # control: nil once ready


def test_a_failed_start_is_not_starting() -> None:
    readiness = Readiness(wait_s=1)
    readiness.advance(Phase.FAILED)
    assert not readiness.starting and not readiness.ready and readiness.welcome() is None


def test_requests_that_need_a_jail_wait_the_others_do_not() -> None:
    waits = [
        RUN,
        OpenSession(ref=1, policy="default"),
        ResumeSession(ref=1, session_id="ses-0123456789abcdef"),
        ResumeRun(ref=1, job_id="job-1"),
        ApproveCall(ref=1, job_id="job-1", call_id=1, allow=True),
        ListApprovals(ref=1),
        ListSnapshots(ref=1),
        DeleteSnapshot(ref=1, snapshot_id="snap-" + "0" * 32),
    ]
    assert {type(m) for m in waits} == set(WAITING)
    assert all(must_wait(m) for m in waits)
    answered_at_once = [
        RunJob(ref=1, job=JobDescription(code="1"), policy="default",
               session_id="ses-0123456789abcdef"),  # no session exists before ready
        ListPolicies(ref=1), GetStats(ref=1), ListJobs(ref=1), Kill(ref=1, id="job-1"),
        Ping(seq=1), CancelJob(job_id="job-1"),
    ]
    assert not any(must_wait(m) for m in answered_at_once)


def test_the_starting_error_crosses_the_wire_as_itself() -> None:
    assert ERROR_CLASSES["starting"] is Starting
    rebuilt = error_from_wire("starting", "the daemon is still starting (x)")
    assert type(rebuilt) is Starting and rebuilt.message == "the daemon is still starting (x)"
    assert exit_code_for(rebuilt) == EXIT_UNAVAILABLE


@given(st.lists(st.tuples(st.sampled_from(list(Phase)),
                          st.lists(st.sampled_from(["default", "web", "data"]), max_size=3)),
                max_size=12))
def test_any_sequence_of_moves_keeps_the_table_and_what_is_told(
        moves: list[tuple[Phase, list[str]]]) -> None:
    """Whatever a start tries: only the table's moves are made, a terminal phase stays, and
    Welcome says starting exactly while the daemon is starting, naming its phase."""
    readiness = Readiness(wait_s=7)
    for phase, policies in moves:
        before = readiness.phase
        if phase in TRANSITIONS[before]:
            readiness.advance(phase, policies)
            assert readiness.phase is phase and readiness.policies == tuple(sorted(policies))
        else:
            with pytest.raises(ValueError):
                readiness.advance(phase, policies)
            assert readiness.phase is before
        told = readiness.welcome()
        assert (told is not None) == readiness.starting == (readiness.phase not in TERMINAL)
        if told is not None:
            assert told.pending.startswith(readiness.phase.value) and told.wait_s == 7


def test_the_wait_bound_is_a_setting_read_from_the_config_file(tmp_path: Path) -> None:
    assert DaemonConfig().startup_wait_s == 300.0
    good = tmp_path / "good.toml"
    good.write_text("[limits]\nstartup_wait_s = 5\n")
    assert load_config_file(str(good))["limits"].startup_wait_s == 5
    bad = tmp_path / "bad.toml"
    bad.write_text("[limits]\nstartup_wait_s = 7200\n")  # over an hour: refused, named
    with pytest.raises(PolicyError, match=r"limits\.startup_wait_s"):
        load_config_file(str(bad))
    assert Readiness(DaemonConfig(startup_wait_s=0).startup_wait_s).timed_out().message


def test_as_many_requests_may_wait_as_may_run() -> None:
    check_waiting(on_connection=255, in_all=511, per_connection=256, total=512)  # control
    with pytest.raises(Busy, match=r"limits\.max_jobs_per_connection 256"):
        check_waiting(on_connection=256, in_all=256, per_connection=256, total=512)
    with pytest.raises(Busy, match=r"limits\.max_jobs 512"):
        check_waiting(on_connection=0, in_all=512, per_connection=256, total=512)
