"""How a job ended, decided from evidence (pure). The order of checks is the precedence."""

from __future__ import annotations

import pytest

from jaild.daemon.core.classify import Evidence, classify, parse_termination, pids_limit_note
from jaild.protocol.messages import CodeFinished, ErrorInfo

EXITED_0 = "[I][t] pid=41 ([STANDALONE MODE]) exited with status: 0, (PIDs left: 0)"
EXITED_3 = "[I][t] pid=41 ([STANDALONE MODE]) exited with status: 3, (PIDs left: 0)"
KILLED = "[I][t] pid=41 ([STANDALONE MODE]) terminated with signal: SIGKILL (9), (PIDs left: 0)"
SEGV = "[I][t] pid=41 ([STANDALONE MODE]) terminated with signal: SIGSEGV (11), (PIDs left: 0)"
SIGSYS = "[I][t] pid=41 ([STANDALONE MODE]) terminated with signal: SIGSYS (31), (PIDs left: 0)"
LAUNCH_FAILED = (
    "[W][t] mountSinglePoint():222 mount('/srv' -> '/tmp/x/data'): Permission denied\n"
    "[F][t] runChild():506 Launching child process failed\n"
    "[E][t] standaloneMode():274 Couldn't launch the child process\n" + KILLED
)
OK_CLAIM = CodeFinished(ok=True, result=b"\x01")
ERR_CLAIM = CodeFinished(ok=False, error=ErrorInfo(type="ValueError", message="m", traceback="tb", lineno=3))


def ev(**kw: object) -> Evidence:
    base = {"jail_ready": True, "cpu_limit_s": 10.0, "wall_limit_s": 5.0, "output_limit": 100}
    base.update(kw)
    return Evidence(**base)  # type: ignore[arg-type]


def test_parse_termination() -> None:
    assert parse_termination("noise\n" + EXITED_3) == ("exited", 3, "", 41)
    assert parse_termination(SEGV) == ("signaled", 11, "SIGSEGV", 41)
    assert parse_termination("[I] Mode: STANDALONE_ONCE") is None


@pytest.mark.parametrize(
    ("evidence", "status", "error_type"),
    [
        (ev(log=EXITED_0, claim=OK_CLAIM), "ok", None),
        (ev(log=EXITED_0, claim=ERR_CLAIM), "error", "ValueError"),
        (ev(log=EXITED_3), "error", "ProcessExit"),
        # the daemon's own reasons come first, whatever the process did
        (ev(log=KILLED, kill_reason="cancelled", claim=OK_CLAIM), "cancelled", "Cancelled"),
        (ev(log=KILLED, kill_reason="timeout", oom=True), "timeout", "Timeout"),
        (ev(log=KILLED, kill_reason="output_limit"), "output_limit", "OutputLimit"),
        (ev(log=KILLED, kill_reason="channel_error", kill_detail="bad"), "error", "ChannelError"),
        (ev(log="", kill_reason="start_failed", kill_detail="x"), "internal_error", "JailStartFailed"),
        # nsjail could not start the jail: its log says so, whatever the signal line says
        (ev(log=LAUNCH_FAILED, jail_ready=False), "internal_error", "JailStartFailed"),
        # cgroup evidence
        (ev(log=KILLED, oom=True), "memory_limit", "MemoryLimit"),
        (ev(log=EXITED_0, oom=True, claim=OK_CLAIM), "ok", None),  # a child was OOM-killed, main coped
        (ev(log=KILLED, cpu_s=10.0), "timeout", "Timeout"),
        # RLIMIT_CPU kills by the kernel's tick-sampled clock, which runs ahead of rusage's
        # on a loaded host: a kill at 65 % of the limit (measured so) is still the limit's
        (ev(log=KILLED, cpu_s=6.5), "timeout", "Timeout"),
        (ev(log=KILLED, cpu_s=1.0), "killed", "Killed"),
        (ev(log=SIGSYS, syscall="unshare"), "policy_violation", "PolicyViolation"),
        (ev(log=SEGV, claim=OK_CLAIM), "killed", "Killed"),  # a claim never beats a signal
        # exit code 137 with no signal line is just an exit code
        (ev(log=EXITED_0.replace("status: 0", "status: 137")), "error", "ProcessExit"),
        (ev(log=EXITED_0, jail_ready=False, stderr_tail="jaild runtime: refusing"), "internal_error",
         "RuntimeStartFailed"),
        (ev(log="", jail_ready=False), "internal_error", "JailStartFailed"),
        (ev(log="", jail_ready=True, nsjail_returncode=-9), "internal_error", "JailLost"),
    ],
)
def test_classification(evidence: Evidence, status: str, error_type: str | None) -> None:
    got_status, error = classify(evidence)
    assert got_status == status
    assert (error or {}).get("type") == error_type


def test_details() -> None:
    _, err = classify(ev(log=SIGSYS, syscall="unshare"))
    assert err is not None and err["syscall"] == "unshare" and "syscall unshare" in err["message"]
    _, err = classify(ev(log=SIGSYS))
    assert err is not None and err["syscall"] is None and "does not allow" in err["message"]
    _, err = classify(ev(log=SEGV))
    assert err is not None and err["signal"] == "SIGSEGV"
    _, err = classify(ev(log=LAUNCH_FAILED, jail_ready=False))
    assert err is not None and "mount('/srv'" in err["message"]
    _, err = classify(ev(log=EXITED_0, claim=ERR_CLAIM))
    assert err == {"type": "ValueError", "message": "m", "traceback": "tb", "lineno": 3}


@pytest.mark.parametrize("syscall", ["socket", "socketpair"])
def test_a_socket_kill_says_it_was_the_address_family(syscall: str) -> None:
    """socket() and socketpair() are killed for their family only (a network's families are
    refused, never killed): the record says so, as the kernel's audit record cannot."""
    status, err = classify(ev(log=SIGSYS, syscall=syscall))
    assert status == "policy_violation" and err is not None and err["syscall"] == syscall
    assert f"syscall {syscall}: a socket of an address family the policy does not allow" in (
        err["message"])
    assert "PermissionError" in err["message"]
    _, err = classify(ev(log=SIGSYS, syscall="unshare"))
    assert err is not None and "address family" not in err["message"]


EAGAIN = "[Errno 11] Resource temporarily unavailable"


@pytest.mark.parametrize(
    ("error_type", "message", "pids_peak", "noted"),
    [
        ("BlockingIOError", EAGAIN, 16, True),  # os.fork, subprocess at the limit
        ("RuntimeError", "can't start new thread", 16, True),  # threading at the limit
        ("BlockingIOError", EAGAIN, 15, False),  # under the limit: a non-blocking read's
        ("BlockingIOError", EAGAIN, None, False),  # no pids.peak on this kernel: no word
        ("RuntimeError", "something else", 16, False),
        ("ValueError", "m", 16, False),  # at the limit, but not how the kernel refuses
    ],
)
def test_a_process_refused_at_the_pids_limit_is_named(
    error_type: str, message: str, pids_peak: int | None, noted: bool
) -> None:
    note = pids_limit_note(error_type, message, pids_peak, 16)
    assert (note is not None) == noted
    if note is not None:
        assert "limits.pids = 16" in note and "processes and threads" in note
