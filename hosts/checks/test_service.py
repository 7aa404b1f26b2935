"""jaild as an installed systemd service, checked for real (run by `make test-hosts` in a guest).

These need what only a real systemd host has -- PID 1 systemd, cgroup v2, ``make install``
done and ``jaild.socket`` enabled -- so they live outside ``tests/`` and run in the Debian
guests of the real-host harness, after its ``install`` and ``socket`` steps. Each one drives
the installed service through ``systemctl`` and the installed socket with jaild's client.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.client import Client, JobResult

SOCKET = "/run/jaild/jaild.sock"
UNIT = "jaild.service"
CONNECT_S = 300.0
"""How long a connection may wait for the daemon's Welcome. A service that socket activation
starts answers as soon as it serves (its jobs then wait for its self-tests, up to
limits.startup_wait_s), but getting that far -- Python's imports, the policies, the host
checks -- took over the client's default 30 s under emulation (QEMU's TCG, on a busy host).
This bounds only a daemon that hangs."""
CGROUP = Path("/sys/fs/cgroup/system.slice/jaild.service")
SECURITY_LOG = Path(os.environ.get("JAILD_HOSTS_SHARE", "/mnt/hosts")) / "security-score.txt"


def systemctl(*args: str, check: bool = True) -> str:
    out = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120,
                         check=False)
    if check and out.returncode != 0:
        raise AssertionError(f"systemctl {' '.join(args)}: {out.stderr or out.stdout}")
    return out.stdout.strip()


def prop(name: str) -> str:
    return systemctl("show", f"--property={name}", "--value", UNIT)


def journal(since: str) -> str:
    return subprocess.run(["journalctl", "--no-pager", "-o", "cat", "-u", UNIT, "--since", since],
                          capture_output=True, text=True, timeout=60, check=False).stdout


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def run(code: str, **kwargs: object) -> JobResult:
    with Client(SOCKET, connect_timeout_s=CONNECT_S) as c:
        return c.run(code, **kwargs)  # type: ignore[arg-type]


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def job_dirs(job_id: str) -> list[Path]:
    """Where a job's cgroup is: in the service's subtree (a spawned jail's), or in the home
    of the zygote that forked its jail into it (``daemon.clone_into_cgroup``, v2's default)."""
    return [d for d in (CGROUP / "jaild" / job_id, *(CGROUP / "jaild").glob(f"*/{job_id}"))
            if d.exists()]


def procs_below(directory: Path) -> list[int]:
    """Processes in ``directory``'s cgroup tree. The daemon makes and removes job cgroups
    meanwhile (its pool refills), so a directory may go between listing and reading it:
    ``os.walk`` skips what vanished (``Path.rglob`` raised FileNotFoundError here)."""
    pids = []
    for root, _dirs, files in os.walk(directory):
        if "cgroup.procs" not in files:
            continue
        try:
            pids += [int(p) for p in Path(root, "cgroup.procs").read_text().split()]
        except OSError:
            continue
    return pids


class Running:
    """A job running in a background thread: ``started`` is set once it printed."""

    def __init__(self, code: str = "import time\nprint('up', flush=True)\ntime.sleep(600)"):
        self.started = threading.Event()
        self.result: JobResult | None = None
        self.error: BaseException | None = None
        self.job_id = ""
        self._thread = threading.Thread(target=self._run, args=(code,), daemon=True)
        self._thread.start()
        assert self.started.wait(120), f"the job never started ({self.error!r})"

    def _run(self, code: str) -> None:
        try:
            with Client(SOCKET, connect_timeout_s=CONNECT_S) as c:
                job = c.submit(code, on_stdout=lambda _t: self.started.set())
                self.job_id = job.job_id
                self.result = job.result(900)
        except BaseException as exc:
            self.error = exc
            self.started.set()

    def join(self, timeout: float = 120) -> JobResult | None:
        self._thread.join(timeout)
        return self.result


@pytest.fixture(autouse=True)
def service_up() -> Iterator[None]:
    """Each check starts from the state `make install` + `enable --now jaild.socket` gave."""
    assert systemctl("is-active", "jaild.socket") == "active"
    yield
    systemctl("start", UNIT, check=False)


def test_everything_lives_inside_the_services_delegated_cgroup() -> None:
    systemctl("start", UNIT)
    assert prop("Delegate") == "yes"
    main = int(prop("MainPID"))
    assert Path(f"/proc/{main}/cgroup").read_text().strip() == \
        "0::/system.slice/jaild.service/daemon"
    # the service's own cgroup holds no process: it hands controllers to its children
    assert (CGROUP / "cgroup.procs").read_text().split() == []
    assert {"memory", "pids"} <= set((CGROUP / "cgroup.subtree_control").read_text().split())
    job = Running("import time\nx = bytearray(64 << 20)\nprint('up', flush=True)\n"
                  "time.sleep(600)")
    try:
        (where,) = job_dirs(job.job_id)
        jail_pids = procs_below(where)
        assert jail_pids, "the job's cgroup is inside the service's"
        for pid in jail_pids:
            assert Path(f"/proc/{pid}/cgroup").read_text().startswith(
                f"0::/{where.relative_to(Path('/sys/fs/cgroup'))}")
        # systemd counts and charges the jails to the service: MemoryMax= would cap them
        assert int(prop("MemoryCurrent")) >= 64 << 20
        assert int(prop("TasksCurrent")) > len(procs_below(CGROUP / "daemon"))
        # and nothing of jaild sits at the top of the hierarchy
        assert not [p for p in Path("/sys/fs/cgroup").iterdir() if p.name.startswith("jaild")]
    finally:
        with Client(SOCKET, connect_timeout_s=CONNECT_S) as c:
            c.kill(job.job_id)
        job.join()


def test_stop_with_jobs_running_cancels_them_then_start_returns_once_jobs_can_run(
) -> None:
    systemctl("start", UNIT)
    since = now()
    jobs = [Running() for _ in range(2)]
    t0 = time.monotonic()
    systemctl("stop", UNIT)
    stop_s = time.monotonic() - t0
    for job in jobs:
        r = job.join()
        assert job.error is None, job.error
        assert r is not None and r.status == "cancelled", r
    assert prop("ActiveState") == "inactive"
    assert prop("Result") == "success"
    log = journal(since)
    assert "timed out" not in log.lower(), log[-3000:]
    assert not CGROUP.exists() or procs_below(CGROUP) == []
    print(f"systemctl stop with 2 jobs running: {stop_s:.1f} s (TimeoutStopSec=30s)")
    # then Type=notify: `systemctl start` blocks until READY=1, sent once the daemon serves
    # (one start for both checks: each costs ~25 s under emulation)
    systemctl("start", UNIT)
    assert prop("ActiveState") == "active" and prop("Type") == "notify"
    r = run("'ready'")
    assert r.status == "ok" and r.result == "ready"


def test_restart_while_clients_are_connected() -> None:
    systemctl("start", UNIT)
    idle = Client(SOCKET, connect_timeout_s=CONNECT_S)
    idle.__enter__()
    job = Running()
    systemctl("restart", UNIT)
    r = job.join()
    assert r is not None and r.status == "cancelled", (r, job.error)
    with pytest.raises(Exception):  # noqa: B017 -- the old connection is gone, whatever the error
        idle.run("1")
    idle.__exit__(None, None, None)
    r2 = run("'after restart'")
    assert r2.status == "ok" and r2.result == "after restart"


def test_kill_9_restarts_and_the_sweep_removes_what_the_crash_left() -> None:
    systemctl("start", UNIT)
    job = Running()
    old = int(prop("MainPID"))
    since = now()
    os.kill(old, 9)
    wait_for(lambda: prop("MainPID") not in ("0", str(old)) and prop("ActiveState") == "active",
             120, "systemd to restart jaild")
    r = job.join()
    assert r is None or r.status != "ok"  # the client saw its daemon die
    assert run("'back'").result == "back"
    log = journal(since)
    assert "main process exited, code=killed, status=9/KILL" in log.lower() or \
        "status=9/kill" in log.lower(), log[-3000:]
    # what the crash left: the job's cgroup, gone now (swept at start if systemd had not)
    assert job_dirs(job.job_id) == []
    alive = [p for p in procs_below(CGROUP / "jaild") if p]
    assert all(Path(f"/proc/{p}/cgroup").read_text().find(job.job_id) < 0 for p in alive)


# the installed policies that let jobs call host tools (strict lists none)
TOOL_POLICIES = {"default", "data"}


def test_every_policy_works_under_the_units_hardening() -> None:
    """The unit's sandboxing (SystemCallFilter, RestrictAddressFamilies, PrivateIPC, ...)
    leaves every installed policy able to start jails, broker a host tool call, and keep a
    session's state between runs."""
    systemctl("start", UNIT)
    with Client(SOCKET, connect_timeout_s=CONNECT_S) as c:
        names = [p["name"] for p in c.policies() if p["available"]]
        assert set(names) >= {"default", "strict", "data"}, names
        for name in names:
            if name in TOOL_POLICIES:
                r = c.run("(await tools.echo(6)) * 7", name, tools={"echo": lambda v: v})
            else:
                r = c.run("6 * 7", name)
            assert (r.status, r.result) == ("ok", 42), (name, r.status, r.error)
        with c.session("default", tools={"add": lambda a, b: a + b}) as s:
            assert s.run("x = await tools.add(40, 1)").status == "ok"
            r = s.run("x + 1")
            assert (r.status, r.result) == ("ok", 42), (r.status, r.error)


def test_audit_records_reach_the_journal() -> None:
    systemctl("start", UNIT)
    since = now()
    r = run("1 + 1")
    assert r.status == "ok"
    wait_for(lambda: r.job_id in journal(since), 30, "the job's audit record in the journal")
    lines = [ln for ln in journal(since).splitlines() if r.job_id in ln and "audit" in ln]
    assert lines and "status=ok" in " ".join(lines), journal(since)[-3000:]


def test_systemd_analyze_security_score_is_recorded() -> None:
    out = subprocess.run(["systemd-analyze", "security", "--no-pager", UNIT],
                         capture_output=True, text=True, timeout=120, check=False).stdout
    m = re.search(r"Overall exposure level for jaild\.service: ([0-9.]+) (\w+)", out)
    assert m, out[-2000:]
    SECURITY_LOG.write_text(f"{m.group(1)} {m.group(2)}\n")
    print(f"systemd-analyze security jaild.service: {m.group(1)} {m.group(2)}")
    # the jobs still run under every hardening setting the unit has
    assert run("'hardened'").result == "hardened"


def test_a_daemon_started_by_hand_gets_its_scope_with_dbus_stopped(tmp_path: Path) -> None:
    """``jaild serve`` outside its unit (``make demo``, a shell) asks systemd for a delegated
    scope. A minimal Debian 12 has systemd but no D-Bus, and there it failed (busctl found no
    system bus): the scope now comes from ``systemd-run --scope``, which as root talks to
    systemd on /run/systemd/private, as systemctl does. D-Bus is stopped for the check, and
    the control shows the system bus really gone (busctl's call, the old way, fails); the
    guest's demo step made its scope the same way with D-Bus up."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "default.toml").write_text(Path("/etc/jaild/policies/default.toml").read_text())
    sock = str(tmp_path / "jaild.sock")
    systemctl("stop", "dbus.socket", "dbus.service")
    try:
        assert systemctl("is-active", "dbus.service", check=False) != "active"
        old_way = subprocess.run(["busctl", "--system", "status"], capture_output=True,
                                 text=True, check=False)
        assert old_way.returncode != 0, old_way.stdout
        proc = subprocess.Popen(
            ["/opt/jaild/venv/bin/jaild", "serve", "--socket", sock, "--policies",
             str(policies)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # the socket accepts once claimed; Welcome comes once the daemon serves
            wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 300,
                     "the daemon's socket")
            assert proc.poll() is None, proc.communicate()[0]
            with Client(sock, connect_timeout_s=CONNECT_S) as c:
                r = c.run("6 * 7")
            assert r.status == "ok" and r.result == 42, (r.status, r.error)
        finally:
            proc.terminate()
            out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out
        assert re.search(r"cgroup v2: transient scope jaild-\w+\.scope with Delegate=yes", out), out
    finally:
        systemctl("start", "dbus.socket", "dbus.service")
