"""Sessions: one jail kept for many runs -- state, limits, expiry, ps/kill, through the real daemon."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jaild.client import AsyncClient, Client
from jaild.errors import BadRequest, Busy, PermissionDenied, SessionClosed, UnknownJob
from tests.conftest import REPO, DaemonHandle, ForeignClient, guard, until

pytestmark = pytest.mark.integration

SESSIONS = {
    # a run's CPU limit must come before its wall-clock limit even on a busy host, where a
    # CPU-bound run gets a small share of a CPU: the wall limit is far away
    "short": "[session]\nidle_s = 30\nmax_lifetime_s = 900\nmax_per_user = 3\n"
             "[limits]\nwall_time_s = 600\ncpu_time_s = 1\nmemory_mb = 128\npids = 16\n",
    "nosession": "[session]\nenabled = false\n",
}


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> DaemonHandle:
    from tests.conftest import policy_texts, start_daemon, sweep_cgroups

    handle = start_daemon(tmp_path_factory.mktemp("sessions"),
                          {**policy_texts("default", "spawn"), **SESSIONS}, with_repo_policies=False)
    yield handle  # type: ignore[misc]
    assert handle.stop() == 0, handle.log()[-3000:]
    sweep_cgroups(handle)


def _cgroup(d: DaemonHandle, ident: str) -> Path:
    return d.cgroup_dir(ident)


def _gone(d: DaemonHandle, ident: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + guard(timeout)
    while _cgroup(d, ident).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _cgroup(d, ident).exists()


def test_state_survives_between_runs(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session(tools={"add": lambda a, b: a + b}) as s:
        assert s.id is not None and s.id.startswith("ses-")
        r1 = s.run("import math\nx = 10\ndef f(y):\n    return y * x\nclass K:\n    n = 3")
        assert r1.status == "ok" and r1.session == {"id": s.id, "run": 1, "closed": None}
        r2 = s.run("import asyncio\nawait asyncio.sleep(0)\nawait tools.add(f(2), math.floor(K.n))")
        assert (r2.status, r2.result, r2.error) == ("ok", 23, None)
        r3 = s.run("x += 1\nx")
        assert r3.result == 11 and r3.session["run"] == 3
        # each run is its own job, with its own output and record
        r4 = s.run("print('only mine')")
        assert r4.stdout == "only mine\n" and len({r1.job_id, r2.job_id, r3.job_id, r4.job_id}) == 4
        # a main() defined in run 1 is not called again by later runs
        s.run("def main():\n    return 'main'")
        assert s.run("'last expression'").result == "last expression"


def test_one_event_loop_serves_every_run(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session() as s:
        s.run("import asyncio\nq = asyncio.Queue()\nawait q.put(1)\nlock = asyncio.Lock()")
        r = s.run("async with lock:\n    v = await q.get()\nv")
        assert (r.status, r.result) == ("ok", 1), r.error


def test_a_session_survives_100_runs(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session() as s:
        s.run("import os\nn = 0\npid = os.getpid()")
        for i in range(1, 101):
            r = s.run("n += 1\n(n, os.getpid() == pid)")
            assert (r.status, r.result) == ("ok", [i, True]), (i, r.error)
        assert r.session["run"] == 101
        rows = {row["id"]: row for row in c.jobs()}
        assert rows[s.id]["runs"] == 101 and rows[s.id]["state"] == "idle"


def test_sessions_work_in_spawn_mode(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session(policy="spawn") as s:
        s.run("data = [1, 2, 3]")
        assert s.run("sum(data)").result == 6


def test_async_sessions(sd: DaemonHandle) -> None:
    async def main() -> list[object]:
        async with AsyncClient(sd.socket) as c, c.session(tools={"echo": lambda v: v}) as s:
            await s.run("acc = []")
            for i in range(3):
                await s.run(f"acc.append(await tools.echo({i}))")
            return (await s.run("acc")).result  # type: ignore[no-any-return]

    assert asyncio.run(main()) == [0, 1, 2]


def test_runs_take_turns(sd: DaemonHandle) -> None:
    gate = threading.Event()
    with Client(sd.socket) as c, c.session(tools={"hold": lambda: gate.wait(guard(60))}) as s:
        slow = c._call(s._session.submit("await tools.hold()"))  # runs until the gate opens
        with pytest.raises(Busy, match="one run at a time"):
            s.run("1")
        gate.set()
        r = c._call(slow.result())
        assert (r.status, r.result) == ("ok", True), r.error
        assert s.run("2").result == 2


def test_idle_sessions_expire(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c:
        s = c.session(idle_s=0.5).open()
        assert s.run("x = 1").status == "ok"
        until(lambda: s.closed is not None, "the session's end")  # the daemon tells the client
        assert s.closed == "idle" and "idle" in s.close_message
        with pytest.raises(SessionClosed, match="idle") as caught:
            s.run("x")
        assert caught.value.reason == "idle"
        assert s.id not in {row["id"] for row in c.jobs()}
        assert _gone(sd, s.id or "")


def test_sessions_end_at_their_maximum_lifetime_even_mid_run(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c:
        s = c.session(max_lifetime_s=1).open()
        # the record says why the run ended (no stopwatch): its session's lifetime, not the
        # end of its sleep (that would be "ok") nor the 30 s deadline ("timeout")
        r = s.run("import time\ntime.sleep(60)")
        assert r.status == "cancelled" and "maximum lifetime" in r.error["message"], r.error
        assert s.closed == "lifetime"
        with pytest.raises(SessionClosed) as caught:
            s.run("1")
        assert caught.value.reason == "lifetime"


def test_session_settings_may_only_tighten_the_policy(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c:
        with pytest.raises(BadRequest, match="idle_s=3600 is looser than policy 'short' allows"):
            c.session("short", idle_s=3600).open()
        with pytest.raises(PermissionDenied, match="does not allow sessions"):
            c.session("nosession").open()
        with c.session("short") as s:
            with pytest.raises(BadRequest, match="memory_mb apply to the whole session"):
                s.run("1", limits={"memory_mb": 64})
            assert s.run("1", limits={"wall_time_s": 2}).result == 1  # per-run limits: fine


def test_sessions_per_user_are_capped(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c:
        opened = [c.session("short").open() for _ in range(3)]
        with pytest.raises(Busy, match="allows 3 per user"):
            c.session("short").open()
        opened[0].close()
        c.session("short").open().close()
        for s in opened[1:]:
            s.close()


def test_closing_kills_the_jail(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c:
        s = c.session().open()
        s.run("import subprocess\np = subprocess.Popen(['sleep', '300'])")
        ident = s.id or ""
        assert _cgroup(sd, ident).exists()
        s.close()
        assert s.closed == "closed"
        assert _gone(sd, ident), "the session's jail outlived its close"
        with pytest.raises(SessionClosed) as caught:
            s.run("1")
        assert caught.value.reason == "closed"


def test_a_disconnected_client_loses_its_sessions(sd: DaemonHandle) -> None:
    code = (
        "import sys\nsys.path.insert(0, sys.argv[2])\nfrom jaild.client import Client\n"
        "c = Client(sys.argv[1])\ns = c.session().open()\ns.run('x = 1')\n"
        "print(s.id, flush=True)\nimport os\nos._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, sd.socket, str(REPO)], capture_output=True,
                         text=True, timeout=guard(60), check=True)
    ident = out.stdout.strip()
    assert ident.startswith("ses-")
    assert _gone(sd, ident)
    with Client(sd.socket) as c:
        assert ident not in {row["id"] for row in c.jobs()}


def test_a_run_that_times_out_ends_the_session(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c:
        s = c.session().open()
        r = s.run("while True:\n    pass", timeout=0.5)
        assert r.status == "timeout" and r.session == {"id": s.id, "run": 1, "closed": "timeout"}
        assert s.closed == "timeout" and "ended the session" in s.close_message
        with pytest.raises(SessionClosed, match="timeout") as caught:
            s.run("1")
        assert caught.value.reason == "timeout"


def test_each_run_gets_its_own_cpu_time(sd: DaemonHandle) -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass"
    with Client(sd.socket) as c, c.session("short") as s:  # cpu_time_s = 1 per run
        for _ in range(3):  # 1.8 s of CPU in all: more than one run's budget
            r = s.run(burn)
            assert r.status == "ok", r.error
            assert 0.5 < r.usage["cpu_user_s"] + r.usage["cpu_system_s"] < 1.0
        r = s.run("while True:\n    pass")
        assert r.status == "timeout" and r.error["limit"] == "cpu_time_s", r.error
        assert r.usage["cpu_user_s"] + r.usage["cpu_system_s"] >= 1.0
        assert s.closed == "timeout"


def test_each_run_gets_its_own_memory_peak_where_the_kernel_can_restart_it(
    sd: DaemonHandle,
) -> None:
    # v1 restarts the peak for each run (a write to the counter the daemon keeps open); v2's
    # memory.peak cannot be restarted, so a later run reports the jail's peak so far
    with Client(sd.socket) as c, c.session("short") as s:
        big = s.run("x = bytearray(80 << 20)\ndel x")
        small = s.run("1")
    assert big.status == small.status == "ok"
    if not sd.measures("memory.peak"):
        assert big.usage["memory_peak_bytes"] is None
        return
    assert big.usage["memory_peak_bytes"] >= 80 << 20
    if sd.layout.version == 1:
        assert small.usage["memory_peak_bytes"] < 40 << 20
    else:
        assert small.usage["memory_peak_bytes"] >= 80 << 20


def test_memory_limit_covers_the_whole_session(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c:
        s = c.session("short").open()  # 128 MB for the session
        assert s.run("keep = bytearray(80 << 20)\nlen(keep)").result == 80 << 20
        r = s.run("more = bytearray(80 << 20)")
        assert r.status == "memory_limit", r.error
        assert r.session["closed"] == "memory_limit" and s.closed == "memory_limit"
        # positive control: the same 80 MB in a fresh session is fine
        with c.session("short") as fresh:
            assert fresh.run("more = bytearray(80 << 20)\nlen(more)").status == "ok"


def test_pids_limit_covers_the_whole_session(sd: DaemonHandle) -> None:
    with Client(sd.socket) as c, c.session("short") as s:  # 16 pids for the session
        r = s.run("import subprocess\nkids = [subprocess.Popen(['sleep', '60']) for _ in range(10)]")
        assert r.status == "ok", r.error
        r = s.run(
            "import subprocess\ntry:\n    more = [subprocess.Popen(['sleep', '60']) for _ in range(10)]\n"
            "except OSError as e:\n    refused = str(e)\nrefused"
        )
        assert r.status == "ok" and "Resource temporarily unavailable" in r.result, r
        assert r.usage["pids_peak"] == (16 if sd.measures("pids.peak") else None)


def test_ps_lists_and_kill_ends_jobs_and_sessions(sd: DaemonHandle) -> None:
    with Client(sd.socket) as owner, Client(sd.socket) as other:
        s = owner.session().open()
        s.run("x = 1")
        job = owner.submit("import time\ntime.sleep(30)")
        deadline = time.monotonic() + guard(10)
        while time.monotonic() < deadline:
            rows = {row["id"]: row for row in other.jobs()}
            if job.job_id in rows and rows[job.job_id]["state"] == "running":
                break
            time.sleep(0.05)
        assert rows[s.id]["kind"] == "session" and rows[s.id]["runs"] == 1
        assert rows[job.job_id]["kind"] == "job" and rows[job.job_id]["policy"] == "default"
        assert rows[job.job_id]["uid"] == os.getuid() and rows[s.id]["memory_bytes"] > 0
        # another connection of the same uid may kill them
        assert other.kill(job.job_id) == "job"
        r = job.result(guard(20))
        assert r.status == "cancelled" and "jaild kill" in r.error["message"]
        assert other.kill(s.id or "") == "session"
        until(lambda: s.closed is not None, "the session's end")
        assert s.closed == "killed"
        with pytest.raises(UnknownJob):
            other.kill("job-0000000000000000")


def test_the_cli_session_repl(sd: DaemonHandle, tmp_path: Path) -> None:
    script = "x = 6\ndef f(y):\n    return x * y\n\nprint(f(7))\nimport os\nos.getpid() == 1\n"
    out = subprocess.run([sys.executable, "-m", "jaild", "session", "--socket", sd.socket],
                         input=script, capture_output=True, text=True, timeout=guard(60), check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["42", "True"], out


def test_cli_ps_kill_and_stats(sd: DaemonHandle) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "jaild", *args, "--socket", sd.socket],
                              capture_output=True, text=True, timeout=guard(60), check=False)

    with Client(sd.socket) as c:
        s = c.session().open()
        out = cli("ps")
        assert out.returncode == 0 and s.id in out.stdout and "session" in out.stdout
        out = cli("kill", s.id or "")
        assert out.returncode == 0 and f"killed session {s.id}" in out.stdout
        assert cli("kill", "ses-nope").returncode == 1
        stats = cli("stats")
        assert stats.returncode == 0 and "default" in stats.stdout and "POLICY" in stats.stdout


def test_other_users_cannot_see_or_kill(world_daemon: Callable[[], DaemonHandle],
                                        foreign_client: ForeignClient) -> None:
    # uid 65534 runs the real client library -- a world-readable copy of it, since the
    # checkout itself may be out of its reach (a clone under a 0700 home directory)
    d = world_daemon()
    with Client(d.socket) as root:
        s = root.session().open()
        code = (
            "import sys, json\nfrom jaild.client import Client\n"
            "from jaild.errors import UnknownJob\nc = Client(sys.argv[1])\nrows = c.jobs()\n"
            "try:\n    c.kill(sys.argv[2])\n    killed = True\nexcept UnknownJob:\n    killed = False\n"
            "r = c.run('1 + 1')\nprint(json.dumps([rows, killed, r.result, sorted(c.stats()['uids'])]))\n"
        )
        out = foreign_client.run(code, d.socket, s.id or "", uid=65534, gid=65534)
        assert out.returncode == 0, out.stderr
        rows, killed, two, uids = json.loads(out.stdout)
        assert rows == [] and killed is False and two == 2 and uids == ["65534"]
        assert s.run("'still here'").result == "still here"  # positive control: root's works
        assert {row["id"] for row in root.jobs()} >= {s.id}


@pytest.fixture
def world_daemon(world_dir: Path, tmp_path: Path) -> Callable[[], DaemonHandle]:
    """A daemon whose socket uid 65534 (group nogroup) may reach."""
    from tests.conftest import policy_texts, start_daemon, sweep_cgroups
    from tests.integration.test_faults import write_config

    started: list[DaemonHandle] = []

    def make() -> DaemonHandle:
        os.chmod(world_dir, 0o755)
        config = write_config(tmp_path, '[daemon]\nsocket_group = "nogroup"\n')
        handle = start_daemon(world_dir / "d", policy_texts("default"), with_repo_policies=False,
                              args=("--config", config))
        os.chmod(world_dir / "d", 0o755)
        started.append(handle)
        return handle

    yield make  # type: ignore[misc]
    for handle in started:
        handle.stop()
        sweep_cgroups(handle)
