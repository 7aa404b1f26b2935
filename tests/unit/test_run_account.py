"""A run's measures and its record (jaild.daemon.jails.run_account), with a stand-in jail and clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import jaild.daemon.jails.run_account
from jaild.daemon.core.machine import JobSpec, Tally
from jaild.daemon.jails.run_account import RunAccount
from jaild.policy.schema import load_policy_text
from jaild.protocol.messages import CodeFinished, JobDescription


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class FakeCgroup:
    """Counts CPU as the scenario says; peaks are fixed."""

    def __init__(self) -> None:
        self.cpu = (1.0, 0.5)  # (user, system) seconds since the cgroup was made
        self.peaks_reset = 0

    def reset_peak_memory(self) -> None:
        self.peaks_reset += 1

    def start_cpu_count(self) -> tuple[float, float]:
        return self.cpu

    def cpu_times(self) -> tuple[float, float]:
        return self.cpu

    def peak_memory_bytes(self) -> int:
        return 4096

    def peak_pids(self) -> int:
        return 3


class FakeHandle:
    def __init__(self, cgroup: FakeCgroup | None) -> None:
        self.cgroup = cgroup
        self.paused = 0
        self.resumed = 0

    def pause_output(self) -> None:
        self.paused += 1

    def resume_output(self) -> None:
        self.resumed += 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(jaild.daemon.jails.run_account, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


POLICY = load_policy_text("", "p.toml")
SPEC = JobSpec("job-1", POLICY, POLICY.limits, JobDescription(code="1"))


def test_a_runs_times_cpu_and_stream_make_its_usage(clock: Clock) -> None:
    cgroup = FakeCgroup()
    handle = FakeHandle(cgroup)
    run = RunAccount(handle)  # type: ignore[arg-type]
    clock.now += 1  # the job waited a second for its jail
    run.run_started()
    assert cgroup.peaks_reset == 1
    run.code_sent()
    run.pause_output()
    run.pause_output()  # once paused, it stays paused: one pause of the pipes
    clock.now += 2
    run.resume_output()
    run.output_dropped(10)
    cgroup.cpu = (3.0, 1.0)
    assert run.cpu_used_s() == pytest.approx(2.5)
    clock.now += 1
    run.code_ended(CodeFinished(ok=True, result=b"\xc3"), POLICY)
    tally = Tally(output_bytes=7)
    clock.now += 5  # after the code: not in its wall time, in the job's duration
    record = run.record(SPEC, "ok", None, tally)
    assert (handle.paused, handle.resumed) == (1, 1)
    assert record.duration_s == pytest.approx(9.0)
    usage = record.usage
    assert usage is not None
    assert usage.wall_s == pytest.approx(3.0)
    assert (usage.cpu_user_s, usage.cpu_system_s) == (pytest.approx(2.0), pytest.approx(0.5))
    assert (usage.memory_peak_bytes, usage.pids_peak) == (4096, 3)
    assert usage.stream_paused_s == pytest.approx(2.0) and usage.stream_dropped_bytes == 10
    assert usage.output_bytes == 7
    assert run.result == b"\xc3"


def test_output_still_paused_at_the_record_is_resumed_and_counted(clock: Clock) -> None:
    handle = FakeHandle(None)
    run = RunAccount(handle)  # type: ignore[arg-type]
    run.code_sent()
    run.pause_output()
    clock.now += 4
    record = run.record(SPEC, "timeout", {"type": "Timeout", "message": "m"}, Tally())
    assert handle.resumed == 1
    assert record.usage is not None and record.usage.stream_paused_s == pytest.approx(4.0)
    assert record.usage.cpu_user_s is None and record.usage.memory_peak_bytes is None


def test_only_an_ok_run_keeps_its_result_and_a_reset_forgets_the_run(clock: Clock) -> None:
    run = RunAccount(FakeHandle(FakeCgroup()))  # type: ignore[arg-type]
    run.run_started()
    run.code_sent()
    run.code_ended(CodeFinished(ok=True, result=b"\x01"), POLICY)
    run.output_dropped(5)
    record = run.record(SPEC, "memory_limit", {"type": "MemoryError", "message": "m"}, Tally())
    assert run.result is None and run.downloads == {}
    assert record.status == "memory_limit"
    run.reset()
    clock.now += 1
    record = run.record(SPEC, "ok", None, Tally())
    assert record.usage is not None
    assert record.usage.wall_s == 0.0 and record.usage.stream_dropped_bytes == 0
    assert record.usage.cpu_user_s is None  # no run started since the reset


def test_the_runtimes_count_of_refused_network_attempts_is_in_the_record(clock: Clock) -> None:
    """The count comes with the runtime's report (the jail's own word); a run that never
    reported has none (nil, not 0), and a reset forgets it."""
    run = RunAccount(FakeHandle(None))  # type: ignore[arg-type]
    run.code_sent()
    run.code_ended(CodeFinished(ok=True, result=b"\x01", network_refused=3), POLICY)
    record = run.record(SPEC, "ok", None, Tally())
    assert record.network_refused == 3 and record.to_dict()["network_refused"] == 3
    run.reset()
    run.code_sent()
    record = run.record(SPEC, "timeout", {"type": "Timeout", "message": "m"}, Tally())
    assert record.network_refused is None and "network_refused" not in record.to_dict()
    run.reset()
    run.code_ended(CodeFinished(ok=True, result=b"\x01"), POLICY)
    record = run.record(SPEC, "ok", None, Tally())
    assert record.network_refused == 0 and "network_refused" not in record.to_dict()
