"""Jobs through the installed service on a real systemd, cgroup v2 host: what CI's guest run
keeps of the jail tests (the whole suite in a guest is `make test-hosts`).

Each status a job can end with, told from what such a host gives the daemon (``memory.events``
for an OOM kill, the kernel log for a seccomp kill, its own timers); the usage v2's counters
give (``memory.peak`` and ``pids.peak`` where the kernel keeps them, null where it does not, as
on kernel 5.10); a cgroup and a host uid of its own for each job, inside the service's
delegation, for a jail forked from a zygote and for one nsjail spawned; and nothing of a job
left once it ended. ``internal_error`` (a jail nsjail could not make) is the one status not
here: it needs a policy broken after the daemon started, and is no different on v2 (the
integration suite has it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.client import Client, JobResult

SOCKET = "/run/jaild/jaild.sock"
UNIT = "jaild.service"
CGROUP = Path("/sys/fs/cgroup/system.slice/jaild.service")
JOBS = CGROUP / "jaild"
SPAWN_POLICY = Path("/etc/jaild/policies/hosts-spawn.toml")
SPAWN = "hosts-spawn"
CONNECT_S = 300.0
"""How long a connection may wait for the daemon's Welcome. A service that socket activation
starts answers as soon as it serves (its jobs then wait for its self-tests, up to
limits.startup_wait_s), but getting that far -- Python's imports, the policies, the host
checks -- took over the client's default 30 s under emulation (QEMU's TCG, on a busy host).
This bounds only a daemon that hangs."""


@pytest.fixture(scope="module", autouse=True)
def spawn_policy() -> Iterator[None]:
    """An installed policy whose jails nsjail spawns (the shipped ones fork from zygotes).
    The harness installs it before the service first starts; run alone, these checks install
    it, restart the service to read it, and remove it afterwards (the running service keeps
    it until it next starts)."""
    if SPAWN_POLICY.exists():
        yield
        return
    SPAWN_POLICY.write_bytes((Path(__file__).parent / SPAWN_POLICY.name).read_bytes())
    try:
        subprocess.run(["systemctl", "restart", UNIT], check=True, timeout=300)
        yield
    finally:
        SPAWN_POLICY.unlink()


def run(code: str, policy: str = "default", **kwargs: object) -> JobResult:
    with Client(SOCKET, connect_timeout_s=CONNECT_S) as c:
        return c.run(code, policy, **kwargs)  # type: ignore[arg-type]


def job_dir(job_id: str) -> Path:
    """A job's cgroup: in the daemon's subtree (a spawned jail's), or in the home of the
    zygote that forked its jail into it (``daemon.clone_into_cgroup``, the default on v2)."""
    homes = [JOBS / job_id, *JOBS.glob(f"zygote-*/{job_id}")]
    return next((d for d in homes if d.exists()), homes[0])


def kernel_keeps(counter: str) -> bool:
    return (CGROUP / counter).exists()


def pids_in(cgroup: Path) -> list[int]:
    """The processes in ``cgroup`` and below it (a spawned jail's nsjail makes a child)."""
    pids = []
    for top, _dirs, files in os.walk(cgroup):  # os.walk passes over what vanishes meanwhile
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids += [int(p) for p in Path(top, "cgroup.procs").read_text().split()]
    return pids


def host_uid(pid: int) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ln.startswith("Uid:"))
    return int(line.split()[1])


def wait_gone(path: Path, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout  # a liveness guard
    while path.exists():
        assert time.monotonic() < deadline, f"{what} still there after {timeout} s"
        time.sleep(0.1)


# status, code, the job's own (tighter) limits, the error's type, and its limit or signal
STATUSES = [
    ("ok", "6 * 7", {}, None, None),
    ("error", "1 / 0", {}, "ZeroDivisionError", None),
    ("timeout", "import time\ntime.sleep(600)", {"wall_time_s": 1}, "Timeout", "wall_time_s"),
    ("timeout", "while True:\n    pass", {"cpu_time_s": 1}, "Timeout", "cpu_time_s"),
    ("memory_limit", "x = []\nwhile True:\n    x.append(bytearray(1 << 20))", {"memory_mb": 64},
     "MemoryLimit", "memory_mb"),
    ("output_limit", "while True:\n    print('y' * 100)", {"output_bytes": 4096},
     "OutputLimit", "output_bytes"),
    ("killed", "import ctypes\nctypes.string_at(0)", {}, None, "SIGSEGV"),
    # unshare(CLONE_NEWUSER): not on the seccomp allow-list, the jail is killed
    ("policy_violation", "import ctypes\nctypes.CDLL(None).syscall(272, 0x10000000)", {}, None,
     "SIGSYS"),
]


@pytest.mark.parametrize("policy", ["default", SPAWN])
@pytest.mark.parametrize(("status", "code", "limits", "error_type", "detail"), STATUSES,
                         ids=["-".join([s[0], *s[2]]) for s in STATUSES])
def test_a_job_ends_with_each_status(policy: str, status: str, code: str,
                                     limits: dict[str, int], error_type: str | None,
                                     detail: str | None) -> None:
    r = run(code, policy, limits=limits)
    assert r.status == status, (r.status, r.error)
    if status == "ok":
        assert r.result == 42 and r.error is None
        return
    assert r.error is not None
    if error_type:
        assert r.error["type"] == error_type, r.error
    if detail and detail.startswith("SIG"):
        assert r.error["signal"] == detail, r.error
    elif detail:
        assert r.error["limit"] == detail, r.error
    if status == "output_limit":
        assert len(r.stdout) + len(r.stderr) == 4096
    if status == "policy_violation":
        assert r.error["syscall"] in ("unshare", None), r.error  # the kernel log is rate-limited
    if status == "memory_limit" and kernel_keeps("memory.peak"):
        assert r.usage["memory_peak_bytes"] >= 32 << 20, r.usage


def test_a_job_cancelled_by_its_client_ends_cancelled_and_its_cgroup_goes() -> None:
    seen = threading.Event()
    with Client(SOCKET, connect_timeout_s=CONNECT_S) as c:
        job = c.submit("import time\nprint('up', flush=True)\ntime.sleep(600)",
                       on_stdout=lambda _t: seen.set())
        assert seen.wait(120), "the job never started"
        assert pids_in(job_dir(job.job_id)), "the running job's processes are in its cgroup"
        where = job_dir(job.job_id)
        job.cancel()
        r = job.result(120)
    assert r.status == "cancelled" and r.error is not None, (r.status, r.error)
    assert r.stdout == "up\n"
    wait_gone(where, f"the cgroup of the cancelled job {r.job_id}")


@pytest.mark.parametrize("policy", ["default", SPAWN])
def test_usage_comes_from_the_kernels_counters(policy: str) -> None:
    r = run("import time, subprocess\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3:\n    sum(range(10_000))\n"
            "blob = bytearray(100 << 20)\nblob[::4096] = b'x' * len(blob[::4096])\n"
            "kids = [subprocess.Popen(['sleep', '5']) for _ in range(5)]\n"
            "for k in kids:\n    k.kill()\n", policy)
    assert r.status == "ok", r.error
    u = r.usage
    assert u["cpu_user_s"] + u["cpu_system_s"] >= 0.3
    # a peak the kernel does not keep is null, never a guess (memory.peak: 5.19, pids.peak: 6.1)
    if kernel_keeps("memory.peak"):
        assert u["memory_peak_bytes"] >= 100 << 20, u
    else:
        assert u["memory_peak_bytes"] is None, u
    if kernel_keeps("pids.peak"):
        assert u["pids_peak"] >= 6, u
    else:
        assert u["pids_peak"] is None, u


class Held:
    """A job holding its jail until :meth:`release`, in a thread of its own."""

    def __init__(self, policy: str) -> None:
        self.up = threading.Event()
        self.result: JobResult | None = None
        self.job_id = ""
        self.client = Client(SOCKET, connect_timeout_s=CONNECT_S)
        self.client.__enter__()
        self.job = self.client.submit("import time\nprint('up', flush=True)\ntime.sleep(600)",
                                      policy, on_stdout=lambda _t: self.up.set())
        self.job_id = self.job.job_id
        assert self.up.wait(120), f"the {policy} job never started"

    def release(self) -> JobResult:
        self.job.cancel()
        try:
            return self.job.result(120)
        finally:
            self.client.__exit__(None, None, None)


@pytest.mark.parametrize("policy", ["default", SPAWN])
def test_each_job_has_a_cgroup_and_a_host_uid_of_its_own(policy: str) -> None:
    a, b = Held(policy), Held(policy)
    try:
        seen = {}
        where = {job.job_id: job_dir(job.job_id) for job in (a, b)}
        for job in (a, b):
            pids = pids_in(where[job.job_id])
            assert pids, f"job {job.job_id} has no process in its cgroup"
            for pid in pids:
                assert Path(f"/proc/{pid}/cgroup").read_text().strip().startswith(
                    f"0::/{where[job.job_id].relative_to(Path('/sys/fs/cgroup'))}"), pid
            uids = {host_uid(pid) for pid in pids}
            assert len(uids) == 1 and 0 not in uids, (job.job_id, uids)
            seen[job.job_id] = uids.pop()
        assert seen[a.job_id] != seen[b.job_id], f"two jobs ran as one host uid: {seen}"
    finally:
        ends = [a.release(), b.release()]
    assert [r.status for r in ends] == ["cancelled", "cancelled"]
    for job in (a, b):
        wait_gone(where[job.job_id], f"the cgroup of {job.job_id}")


def test_a_forked_jail_is_born_in_its_jobs_cgroup_never_in_its_zygotes() -> None:
    """``daemon.clone_into_cgroup`` (the default on v2): the zygote forks each jail straight
    into its job's cgroup, in the zygote's home, with ``clone3(CLONE_INTO_CGROUP)`` -- so
    the zygote's own cgroup never holds more than the zygote (``pids.peak``, which counts
    every task that was ever in it: a jail forked there and moved would count), and the
    zygote's home holds it and its jobs alone."""
    held = Held("default")
    try:
        where = job_dir(held.job_id)
        home = where.parent
        assert home.name.startswith("zygote-default"), where
        (pid,) = pids_in(where / "jail")
        assert "\n0::/" + str((where / "jail").relative_to(Path("/sys/fs/cgroup"))) in (
            "\n" + Path(f"/proc/{pid}/cgroup").read_text()), pid
        for _ in range(5):
            assert run("6 * 7").result == 42
        # each jail still makes a cgroup namespace of its own, rooted at its leaf (the zygote
        # keeps the daemon's, to reach its jobs' cgroups)
        assert run("open('/proc/self/cgroup').read()").result == "0::/\n"
        zygote = home / "zygote"
        assert len(pids_in(zygote)) == 1, "the zygote's cgroup holds the zygote alone"
        assert (zygote / "pids.peak").read_text().strip() == "1", (
            "a jail was forked into the zygote's cgroup")
        # the home's cgroup.procs is the zygote's (its uid), the subtree's is root's
        zygote_uid = host_uid(pids_in(zygote)[0])
        assert (home / "cgroup.procs").stat().st_uid == zygote_uid != 0
        assert (where / "jail" / "cgroup.procs").stat().st_uid == zygote_uid
        assert (where / "cgroup.procs").stat().st_uid == 0  # the job's limits are not its
        assert (JOBS / "cgroup.procs").stat().st_uid == 0
    finally:
        r = held.release()
    assert r.status == "cancelled"
    wait_gone(where, f"the cgroup of {held.job_id}")
