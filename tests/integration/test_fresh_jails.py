"""Jails from the zygote and the warm pool are as isolated from each other as spawned ones.

Job A runs and, while it is still alive (held in a tool call), leaves traces of every kind
a job could share: files in /tmp and /dev/shm, a SysV shared-memory segment, an abstract
unix socket, a background process, a change to a module the zygote pre-imported, and
memory and processes in its cgroup. Job B, started while A is held, must see none of them
and must have its own budgets. Each probe has a positive control: the same two programs run
on the host as two plain processes, where B does see what A left.

Run for ``default`` and ``web`` (jails forked on demand from the zygote: the test first waits
until the zygote serves, since a job that finds none ready is spawned), ``pooled`` (a jail
taken from the warm pool, prepared before either job existed) and ``spawn`` (a full nsjail
per job). A and B must differ in uid *on the host* (the user namespace's map), in every path.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jaild.client import Client
from tests.conftest import HOST_UID, STATE_DIR, DaemonHandle, guard, until, wait_for_zygote

pytestmark = pytest.mark.integration

POLICIES = ["default", "pooled", "spawn", "web"]
NETWORKED = {"web"}  # AF_INET allowed (egress): A also listens on its loopback
FORKED = {"default", "web"}  # zygote policies: A and B are forked from the zygote

# [uid inside, uid on the host (from the user namespace's map), pid namespace, start of pid 1]
IDENTITY = (f"[os.getuid(), {HOST_UID}, "
            "os.readlink('/proc/self/ns/pid'), open('/proc/1/stat').read().split()[21]]")


LEAVE_NET = r'''
listener = socket.create_server(("127.0.0.1", {port}))
'''

SEE_NET = r'''
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
    seen["loopback listener"] = True
except OSError:
    seen["loopback listener"] = False
'''

# Leaves a trace of every kind; {tmp} is /tmp in a jail, a scratch directory on the host.
LEAVE = r'''
import ctypes, json, os, socket, subprocess, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
open("{tmp}/a-was-here", "w").write("A")
open("/dev/shm/a-was-here", "w").write("A")
shm = libc.shmget(0x7a11d, 4096, 0o1666)  # IPC_CREAT | 0666
abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
abstract.bind("\0jaild-fresh-probe")
abstract.listen(1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
import gc, time
gc.freeze()  # the forks below copy no more of this process than they must
for _ in range(20):  # 20 of the policy's 64 pids, held
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
json.jaild_marker = "A"
sys.modules["__main__"].jaild_main_marker = "A"  # the job's __main__ module
jaild_main_name = "A"  # ... and its namespace
hog = bytearray(100 * 1024 * 1024)  # 100 of the policy's 256 MB, touched
for i in range(0, len(hog), 4096):
    hog[i] = 1
'''

# What B sees of A. Every entry is True when B sees a trace of A.
SEE = r'''
import ctypes, errno, json, os, socket
libc = ctypes.CDLL("libc.so.6", use_errno=True)
seen = {{}}
seen["tmp file"] = os.path.exists("{tmp}/a-was-here")
seen["/dev/shm file"] = os.path.exists("/dev/shm/a-was-here")
seen["sysv shm"] = libc.shmget(0x7a11d, 0, 0) != -1
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect("\0jaild-fresh-probe")
    seen["abstract socket"] = True
except OSError:
    seen["abstract socket"] = False
seen["module state"] = getattr(json, "jaild_marker", None) == "A"
import sys
seen["__main__ state"] = (getattr(sys.modules["__main__"], "jaild_main_marker", None) == "A"
                          or "jaild_main_name" in globals())
seen["other processes"] = any(
    "time.sleep(60)" in open(f"/proc/{{p}}/cmdline").read().replace("\0", " ")
    for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
) if os.path.isdir("/proc/self") else False
'''

BUDGET = r'''
hog = bytearray(180 * 1024 * 1024)  # with A's 100 MB this would break a shared 256 MB budget
for i in range(0, len(hog), 4096):
    hog[i] = 1
del hog
import gc, os, signal, time
gc.collect()
gc.freeze()
kids = []
for _ in range(50):  # with A's 21 this would break a shared budget of 64 pids
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
seen["forks refused"] = len(kids) < 50
for pid in kids:
    os.kill(pid, signal.SIGKILL)
maps = open("/proc/self/maps").read().splitlines()
# shared *writable* mappings would be memory another process could write to
seen["shared writable mappings"] = [m for m in maps if m.split()[1][1] == "w" and m.split()[1][3] == "s"]
'''


def _hold_a(client: Client, policy: str) -> tuple[threading.Event, threading.Event, object]:
    up, release = threading.Event(), threading.Event()

    def hold() -> bool:
        up.set()
        return release.wait(guard(60))

    net = LEAVE_NET.format(port=47000) if policy in NETWORKED else ""
    job = client.submit(
        LEAVE.format(tmp="/tmp") + net + "await tools.hold()\n" + IDENTITY,
        policy=policy, tools={"hold": hold},
    )
    return up, release, job


@pytest.mark.parametrize("policy", POLICIES)
def test_job_b_sees_nothing_of_job_a(daemon: DaemonHandle, policy: str) -> None:
    with Client(daemon.socket) as a_client, Client(daemon.socket) as b_client:
        if policy in FORKED:
            wait_for_zygote(a_client, policy)
        up, release, job_a = _hold_a(a_client, policy)
        try:
            assert up.wait(guard(30)), "job A did not reach its tool call"
            net = SEE_NET.format(port=47000) if policy in NETWORKED else ""
            b = b_client.run(SEE.format(tmp="/tmp") + net + BUDGET
                             + f"seen['identity'] = {IDENTITY}\nseen", policy=policy)
        finally:
            release.set()
        a = job_a.result(guard(60))  # type: ignore[attr-defined]
    assert a.status == "ok", (a.status, a.error, a.stderr)
    assert b.status == "ok", (b.status, b.error, b.stderr)
    seen = b.result
    assert seen.pop("shared writable mappings") == []
    b_inside, b_host, *b_jail = seen.pop("identity")
    a_inside, a_host, *a_jail = a.result
    assert b_jail != a_jail, "A and B ran in the same jail"
    assert b_host != a_host, "A and B ran as the same uid"
    if policy in FORKED:  # the path under test: forked from the zygote, not spawned
        assert (a_inside, b_inside) == (a_host, b_host), (a.result, b.result)
    assert seen == dict.fromkeys(seen, False), f"B saw traces of A: {seen}"
    assert set(seen) == {"tmp file", "/dev/shm file", "sysv shm", "abstract socket",
                         "module state", "__main__ state", "other processes", "forks refused",
                         *(["loopback listener"] if policy in NETWORKED else [])}


def test_positive_control_two_host_processes_see_each_other() -> None:
    # The same probes, as two plain processes on the host: B sees everything A left.
    tmp = tempfile.mkdtemp()
    with socket.socket() as free:  # a port no one holds (the jails' 47000 is their own)
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    leave = (LEAVE.format(tmp=tmp).replace("hog = bytearray(100", "hog = bytearray(1")
             .replace("range(20)", "range(0)")) + LEAVE_NET.format(port=port)
    with subprocess.Popen(
        [sys.executable, "-c", leave + "print('up', flush=True)\nimport time\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,  # A and its child: one group
    ) as a:
        try:
            assert a.stdout is not None and a.stdout.readline().strip() == "up"
            see = (SEE.format(tmp=tmp) + SEE_NET.format(port=port)
                   + "import json as j\nprint(j.dumps(seen))")
            out = subprocess.run([sys.executable, "-c", see], capture_output=True, text=True,
                                 timeout=guard(30), check=True).stdout
            seen = json.loads(out)
        finally:
            os.killpg(a.pid, signal.SIGKILL)  # A's own processes, not every match on the host
            subprocess.run(["ipcrm", "-M", str(0x7a11d)], check=False, capture_output=True)
            Path("/dev/shm/a-was-here").unlink(missing_ok=True)
    # the module-state probes are the only ones two fresh host interpreters cannot share
    assert seen == {"tmp file": True, "/dev/shm file": True, "sysv shm": True,
                    "abstract socket": True, "module state": False, "__main__ state": False,
                    "other processes": True,
                    "loopback listener": True}


def test_a_pooled_jail_serves_one_job_only(daemon: DaemonHandle) -> None:
    # Ten jobs in a row through the pool: each starts in an empty /tmp, with its own uid,
    # and with no trace of the module change the job before it made.
    code = ("import json, os\nfresh = (os.listdir('/tmp'), hasattr(json, 'jaild_marker'))\n"
            "open('/tmp/mine', 'w').write('x')\njson.jaild_marker = 1\n"
            "[fresh, os.readlink('/proc/self/ns/pid') + open('/proc/1/stat').read().split()[21]]")
    with Client(daemon.socket) as c:
        results = [c.run(code, policy="pooled") for _ in range(10)]
        stats = {p["name"]: p for p in c.policies()}["pooled"]["pool"]
    assert all(r.status == "ok" for r in results), [r.error for r in results]
    assert all(r.result[0] == [[], False] for r in results)
    assert len({r.result[1] for r in results}) == 10, "a jail served two jobs"
    assert stats["hits"] >= 1


def test_limits_count_from_the_jobs_start_not_the_jails(private_daemon: object) -> None:
    # A pooled jail that waited longer than the wall-time limit still gives its job the
    # whole limit: the clock starts with the job.
    d = private_daemon(policies={"quick": '[limits]\nwall_time_s = 3\n[pool]\nmin = 1\nmax = 1\n'},  # type: ignore[operator]
                       with_repo_policies=False)

    def ready() -> int:
        with d.client() as c:
            return int({p["name"]: p for p in c.policies()}["quick"]["pool"]["ready"])

    deadline = time.monotonic() + guard(60)  # a liveness guard
    while ready() < 1:
        assert time.monotonic() < deadline, "the pool did not make its jail"
        time.sleep(0.05)
    time.sleep(3.5)  # the pooled jail is now older than the job's wall-time limit
    # counted from the jail's start, the deadline would be past: the job killed at once
    r = d.run("import time\ntime.sleep(0.5)\n'ran'", policy="quick")
    assert (r.status, r.result) == ("ok", "ran"), (r.status, r.error)
    with d.client() as c:
        pool = {p["name"]: p for p in c.policies()}["quick"]["pool"]
    assert pool["hits"] >= 1


@pytest.mark.parametrize(("policy", "preimported"), [("default", True), ("spawn", False)])
def test_preimported_modules_are_loaded_before_the_job(client: Client, policy: str,
                                                       preimported: bool) -> None:
    # default pre-imports statistics in its zygote; a spawned jail starts without it
    if policy == "default":
        wait_for_zygote(client, policy)
    r = client.run("import sys\n'statistics' in sys.modules", policy=policy)
    assert (r.status, r.result) == ("ok", preimported), r.error


# ------------------------------------------------------------------ random state, per jail

# The data environment with numpy and pandas pre-imported by the zygote: forked on demand
# (no pool), and from a warm pool of two (both jobs below take a pooled jail).
DATA_POLICIES = {
    "data-forked": '[python]\nenv = "data"\n[limits]\nmemory_mb = 512\n'
                   '[pool]\nmode = "zygote"\nmin = 0\nmax = 0\npreimport = ["numpy", "pandas"]\n',
    "data-pooled": '[python]\nenv = "data"\n[limits]\nmemory_mb = 512\n'
                   '[pool]\nmode = "zygote"\nmin = 2\nmax = 2\npreimport = ["numpy", "pandas"]\n',
}
# What a job draws from the process-global generators: numpy's legacy RandomState (behind
# numpy.random.rand), pandas' sample() (which uses it), and CPython's random.
DRAW = (
    "import sys\nforked = 'numpy' in sys.modules and 'pandas' in sys.modules\n"
    "import numpy, pandas, random\n"
    "frame = pandas.DataFrame({'a': range(10000)})\n"
    "[forked, numpy.random.rand(4).tolist(), frame.sample(8).index.tolist(), random.random()]\n"
)


def _pool_ready(d: DaemonHandle, policy: str) -> dict[str, int]:
    with d.client() as c:
        return {p["name"]: p for p in c.policies()}[policy]["pool"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("policy", sorted(DATA_POLICIES))
def test_two_jobs_forked_from_one_zygote_draw_different_random_numbers(
        private_daemon: Callable[..., DaemonHandle], policy: str) -> None:
    # Issue 14: the zygote imported numpy once, and every fork copied its generator, so two
    # consecutive jobs printed the same numpy.random numbers and DataFrame.sample() rows.
    d = private_daemon(DATA_POLICIES, with_repo_policies=False)
    if policy == "data-pooled":
        until(lambda: _pool_ready(d, policy)["ready"] >= 2, "the pool made two jails")
    before = _pool_ready(d, policy)
    first, second = d.run(DRAW, policy=policy), d.run(DRAW, policy=policy)
    for r in (first, second):
        assert (r.status, r.result[0]) == ("ok", True), (r.status, r.error, r.stderr)
    if policy == "data-pooled":  # both from the pool, made before either job existed
        assert _pool_ready(d, policy)["hits"] - before["hits"] == 2
    _, numbers_a, rows_a, random_a = first.result
    _, numbers_b, rows_b, random_b = second.result
    assert numbers_a != numbers_b, "numpy.random repeated itself across jobs"
    assert rows_a != rows_b, "DataFrame.sample() picked the same rows in both jobs"
    assert random_a != random_b


FORK_TWICE = r'''
import json, os, random, sys, types
import numpy, pandas
sys.path.insert(0, {repo!r})
from jaild.runtime import reseed
holder = types.ModuleType("holder")  # a pre-imported module keeping a generator of its own
holder.rng = random.Random(1234)
sys.modules["holder"] = holder
generators = reseed.survey() if {reseed!r} else []
frame = pandas.DataFrame({{"a": range(10000)}})
draws = []
for _ in range(2):
    r, w = os.pipe()
    if os.fork() == 0:
        reseed.reseed(generators)
        os.write(w, json.dumps([numpy.random.rand(4).tolist(), frame.sample(8).index.tolist(),
                                holder.rng.random()]).encode())
        os._exit(0)
    os.close(w)
    draws.append(json.loads(os.read(r, 65536)))
    os.wait()
print(json.dumps(draws))
'''


@pytest.mark.parametrize("reseeded", [False, True])
def test_positive_control_forks_of_a_host_process_repeat_its_random_numbers(
        reseeded: bool) -> None:
    # Two forks of a host process that imported numpy and pandas: without the reseed they
    # draw the same numbers (what jobs did); with jaild.runtime.reseed, as a zygote's jails
    # now do, they do not -- the module-level random.Random of a pre-imported module included.
    python = os.path.join(STATE_DIR, "envs", "data", "bin", "python3")
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([python, "-c", FORK_TWICE.format(repo=repo, reseed=reseeded)],
                         capture_output=True, text=True, timeout=guard(60), check=False)
    assert out.returncode == 0, out.stderr
    a, b = json.loads(out.stdout)
    if reseeded:
        assert all(x != y for x, y in zip(a, b, strict=True)), (a, b)
    else:
        assert a == b
