"""Per-job usage in every record, totals per policy and uid, and bounded output streaming."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.protocol.messages import JobAccepted, JobDescription, JobFinished, JobOutput, RunJob
from jaild.protocol.records import JobRecord
from tests.conftest import (
    DaemonHandle,
    RawClient,
    guard,
    policy_texts,
    proc_stat,
    start_daemon,
    sweep_cgroups,
    until,
)
from tests.integration.test_faults import write_config

pytestmark = pytest.mark.integration

POLICIES = {
    # the wall-clock limits are far away: on a busy host a CPU-bound job or handler gets a
    # small share of a CPU, and must still meet the CPU limit first
    "cpu1": "[limits]\ncpu_time_s = 1\nwall_time_s = 600\ntool_call_timeout_s = 600\n",
    "flood-pause": "[limits]\noutput_bytes = 8_388_608\nwall_time_s = 30\nslow_client = \"pause\"\n",
    "flood-truncate": "[limits]\noutput_bytes = 8_388_608\nwall_time_s = 30\n"
                      "slow_client = \"truncate\"\n",
}
FLOOD = "import sys\nfor _ in range(64):\n    sys.stdout.write('x' * 65535 + '\\n')\n"
FLOOD_BYTES = 64 * 65536


@pytest.fixture(scope="module")
def ud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    directory = tmp_path_factory.mktemp("usage")
    config = write_config(directory, "[limits]\nstream_buffer_bytes = 65536\n")
    handle = start_daemon(directory, {**policy_texts("default", "spawn"), **POLICIES},
                          with_repo_policies=False, args=("--config", config))
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
    sweep_cgroups(handle)


def cpu(r: object) -> float:
    usage = r.usage  # type: ignore[attr-defined]
    return float(usage["cpu_user_s"] + usage["cpu_system_s"])


@pytest.mark.parametrize("policy", ["default", "spawn"])
def test_every_record_carries_usage(ud: DaemonHandle, policy: str) -> None:
    with Client(ud.socket) as c:
        r = c.run(
            "import time, subprocess\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3:\n    sum(range(10_000))\n"
            "blob = bytearray(100 << 20)\nblob[::4096] = b'x' * len(blob[::4096])\n"
            "kids = [subprocess.Popen(['sleep', '5']) for _ in range(5)]\n"
            "print('y' * 999)\n"
            "for k in kids:\n    k.kill()\n"
            "[await tools.slow() for _ in range(3)]",
            policy=policy,
            tools={"slow": lambda: time.sleep(0.1)},
        )
    assert r.status == "ok", r.error
    u = r.usage
    assert set(u) >= {"wall_s", "cpu_user_s", "cpu_system_s", "memory_peak_bytes", "pids_peak",
                      "output_bytes", "tool_calls", "tool_time_s", "stream_paused_s",
                      "stream_dropped_bytes"}
    assert 0.3 <= cpu(r) < u["wall_s"] + 0.1
    # the loop (user time: reading the process's CPU clock is a system call, so the loop
    # does enough work between two readings to be user time); the page faults
    assert u["cpu_user_s"] > 0.1 and u["cpu_system_s"] > 0
    # a peak the kernel does not keep is null, never a guess (memory.peak: v2 since 5.19)
    if ud.measures("memory.peak"):
        assert u["memory_peak_bytes"] >= 100 << 20
    else:
        assert u["memory_peak_bytes"] is None
    if ud.measures("pids.peak"):
        assert u["pids_peak"] >= 6
    else:
        assert u["pids_peak"] is None
    assert u["output_bytes"] == 1000
    assert u["tool_calls"] == 3 and u["tool_time_s"] >= 0.3
    assert u["stream_paused_s"] == 0 and u["stream_dropped_bytes"] == 0


def test_a_small_job_uses_little(ud: DaemonHandle) -> None:
    with Client(ud.socket) as c:
        r = c.run("1 + 1")
    if ud.measures("memory.peak"):
        assert r.usage["memory_peak_bytes"] < 64 << 20
    if ud.measures("pids.peak"):
        assert r.usage["pids_peak"] <= 2
    assert cpu(r) < 0.2 and r.usage["output_bytes"] == 0 and r.usage["tool_calls"] == 0


def test_host_tool_time_does_not_count_against_the_jails_cpu(ud: DaemonHandle) -> None:
    def spin() -> str:  # 1.5 s of host CPU, more than the job's whole cpu_time_s
        t = time.process_time()
        while time.process_time() - t < 1.5:
            pass
        return "spun"

    with Client(ud.socket) as c:
        r = c.run("await tools.spin()", policy="cpu1", tools={"spin": spin})
        assert (r.status, r.result) == ("ok", "spun"), r.error
        assert cpu(r) < 0.5 and r.usage["tool_time_s"] >= 1.5
        # positive control: the same spin inside the jail hits the 1 s limit
        r = c.run("import time\nt = time.process_time()\n"
                  "while time.process_time() - t < 1.5:\n    pass", policy="cpu1")
        assert r.status == "timeout" and r.error["limit"] == "cpu_time_s", r.error


def test_totals_per_policy_and_uid(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, policy_texts("default", "spawn"), with_repo_policies=False)
    try:
        with Client(d.socket) as c:
            c.run("print('ab')\n1", tools={"t": lambda: 1})
            c.run("await tools.t()\n1/0", tools={"t": lambda: 1})
            c.run("1", policy="spawn")
            with c.session() as s:
                # 0.1 s of its own CPU: trivial jobs alone can stay under the 10 ms tick
                s.run("import time\nt = time.process_time()\n"
                      "while time.process_time() - t < 0.1:\n    pass")
            stats = c.stats()
        default, spawn = stats["policies"]["default"], stats["policies"]["spawn"]
        assert default["jobs"] == 3 and default["statuses"] == {"ok": 2, "error": 1}
        assert default["sessions"] == 1 and default["tool_calls"] == 1
        assert default["output_bytes"] == 3
        # totals: the largest peak any one job had (0 when the kernel keeps none)
        assert (default["memory_peak_bytes"] > 0) == d.measures("memory.peak")
        assert spawn["jobs"] == 1 and spawn["statuses"] == {"ok": 1}
        mine = stats["uids"]["0"]
        assert mine["jobs"] == 4 and mine["sessions"] == 1
        assert mine["cpu_user_s"] + mine["cpu_system_s"] > 0
        assert stats["running"] == {"jobs": 0, "sessions": 0, "connections": 1}
        out = subprocess.run([sys.executable, "-m", "jaild", "stats", "--json", "--socket",
                              d.socket], capture_output=True, text=True, timeout=guard(30),
                             check=True)
        assert json.loads(out.stdout)["policies"]["default"]["jobs"] == 3
    finally:
        d.stop()
        sweep_cgroups(d)


# --------------------------------------------------------------------------- slow clients


def stalled_job(socket_path: str, policy: str,
                stall: Callable[[str], object]) -> tuple[int, JobRecord]:
    """Run FLOOD; read nothing but its JobAccepted until ``stall(job_id)`` returns, then
    read it all: (bytes streamed, record)."""
    streamed = 0
    with RawClient(socket_path) as raw:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.send(RunJob(ref=1, job=JobDescription(code=FLOOD), policy=policy))
        accepted = raw.next()
        assert isinstance(accepted, JobAccepted), accepted
        stall(accepted.job_id)  # a client that does not read
        while True:
            event = raw.next()
            assert event is not None, "the daemon went quiet"
            if isinstance(event, JobOutput):
                streamed += len(event.data)
            elif isinstance(event, JobFinished):
                return streamed, event.record


def listed(d: DaemonHandle, job_id: str) -> bool:
    """The job is running (or starting): ``jaild ps`` lists it."""
    with Client(d.socket) as c:
        return job_id in {row["id"] for row in c.jobs()}


# write(2) and writev(2): what a job printing to its output pipe sleeps in
WRITE_SYSCALLS = {"x86_64": {1, 20}, "aarch64": {64, 66}}[platform.machine()]


def writes_blocked(d: DaemonHandle, job_id: str) -> bool:
    """The job's processes are all asleep writing to a pipe: the daemon stopped reading their
    output. The kernel's own word: /proc/PID/syscall names the call and its fd, /proc/PID/stat
    says asleep, /proc/PID/fd/N says a pipe. (/proc/PID/wchan would say ``pipe_write``, but
    reads ``0`` on kernels with the 2021 wchan disable backported: Debian 11's 5.10.)"""
    pids = d.job_pids(job_id)
    return bool(pids) and all(_asleep_writing_a_pipe(pid) for pid in pids)


def _asleep_writing_a_pipe(pid: int) -> bool:
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()  # "running" while it runs
        if proc_stat(pid)[0] != "S" or int(call[0]) not in WRITE_SYSCALLS:
            return False
        return os.readlink(f"/proc/{pid}/fd/{int(call[1], 16)}").startswith("pipe:")
    except (OSError, IndexError, ValueError):  # gone, running, or not ours to read
        return False


def test_a_slow_client_pauses_the_jobs_output(ud: DaemonHandle) -> None:
    seen: dict[str, bool] = {}

    def stall(job_id: str) -> None:  # until the job waits for the client, and a while more
        until(lambda: writes_blocked(ud, job_id), "the job's pause")
        time.sleep(1.0)
        seen["still running"] = listed(ud, job_id)
        seen["still blocked"] = writes_blocked(ud, job_id)

    streamed, record = stalled_job(ud.socket, "flood-pause", stall)
    usage = record.usage
    assert record.status == "ok" and usage is not None, record.error
    assert seen == {"still running": True, "still blocked": True}  # the job waited ...
    assert usage.stream_paused_s > 0
    assert streamed == FLOOD_BYTES == usage.output_bytes  # ... and lost nothing
    assert len(record.stdout) == FLOOD_BYTES and usage.stream_dropped_bytes == 0


def test_a_slow_client_gets_a_truncated_stream_by_policy(ud: DaemonHandle) -> None:
    def stall(job_id: str) -> None:  # until the job has ended, its client reading nothing
        until(lambda: not listed(ud, job_id), "the job's end")

    streamed, record = stalled_job(ud.socket, "flood-truncate", stall)
    usage = record.usage
    assert record.status == "ok" and usage is not None, record.error
    # the job did not wait for the client: it ended while the client read nothing
    assert usage.stream_dropped_bytes > 0 and usage.stream_paused_s == 0
    assert streamed + usage.stream_dropped_bytes == FLOOD_BYTES  # said, not lost silently
    assert len(record.stdout) == FLOOD_BYTES  # the record has all of it


def test_other_clients_are_served_while_one_stalls(ud: DaemonHandle) -> None:
    import threading

    stalled: list[str] = []
    release = threading.Event()
    box: list[tuple[int, JobRecord]] = []

    def stall(job_id: str) -> None:
        stalled.append(job_id)
        release.wait(guard(120))

    thread = threading.Thread(target=lambda: box.append(
        stalled_job(ud.socket, "flood-pause", stall)))
    thread.start()
    try:
        # the stall in full force: the stalled job is blocked on its output
        until(lambda: stalled and writes_blocked(ud, stalled[0]), "the stalled job's pause")
        with Client(ud.socket) as c:
            assert c.run("'served'").result == "served"
        # served while the other client still stalls: its job still waits for it
        assert listed(ud, stalled[0]) and writes_blocked(ud, stalled[0]) and not box
    finally:
        release.set()
        thread.join(guard(120))
    assert box and box[0][1].status == "ok"
    assert box[0][1].usage is not None and box[0][1].usage.stream_paused_s > 0
