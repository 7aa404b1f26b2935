"""Security claims, each proven in a real jail and paired with a positive control.

The control runs the same probe on the host, outside any jail, and shows it
*would* succeed there -- so a failure inside the jail is the jail's doing, not
a broken probe.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from tests.conftest import REPO, DaemonHandle, guard, policy_texts, run_unjailed

pytestmark = pytest.mark.integration

INET_PROBE = "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\ns.close()\n'made'"


def test_no_inet_sockets_under_the_default_policy(daemon: DaemonHandle) -> None:
    control = run_unjailed(INET_PROBE + "\nprint('made')")
    assert control.returncode == 0 and "made" in control.stdout
    r = daemon.run(INET_PROBE)
    assert r.status == "error" and r.result is None  # refused, not made (nor a kill)
    assert r.error is not None and r.error["type"] == "PermissionError"
    assert r.network_refused == 1
    daemon.assert_serving()


@pytest.fixture
def host_listener() -> Callable[[], int]:
    servers: list[socket.socket] = []

    def make() -> int:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        servers.append(srv)
        return int(srv.getsockname()[1])

    yield make  # type: ignore[misc]
    for s in servers:
        s.close()


def test_no_route_to_host_services_even_with_loopback(daemon: DaemonHandle,
                                                     host_listener: Callable[[], int]) -> None:
    port = host_listener()
    probe = (
        "import socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "s.settimeout(2)\n"
        "try:\n"
        f"    s.connect(('127.0.0.1', {port}))\n"
        "    outcome = 'connected'\n"
        "except OSError as e:\n"
        "    outcome = type(e).__name__\n"
        "print(outcome)\n"
        "outcome"
    )
    control = run_unjailed(probe)
    assert control.stdout.strip() == "connected"
    r = daemon.run(probe, policy="netprobe")  # lo is up, AF_INET allowed, but it is the jail's own lo
    assert r.status == "ok"
    assert r.result in ("ConnectionRefusedError", "OSError")


def _interfaces(proc_net_dev: str) -> list[str]:
    return [line.split(":")[0].strip() for line in proc_net_dev.splitlines()[2:] if ":" in line]


@contextlib.contextmanager
def host_interface() -> Iterator[str]:
    """An interface of the test's own in the host's network namespace (a veth pair, down, no
    address: nothing reaches anything), so the control holds on a host with nothing but lo (a
    guest with no network device has only lo). Deleting one end deletes both."""
    name = f"jt{os.getpid() % 100000}"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"],
                   check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "link", "del", name], check=True)


def test_only_loopback_interface_in_the_jail(daemon: DaemonHandle) -> None:
    with host_interface() as ours:
        host_ifaces = _interfaces(Path("/proc/net/dev").read_text())
        assert ours in host_ifaces and "lo" in host_ifaces, "control: the host sees both"
        r = daemon.run("open('/proc/net/dev').read()", policy="netprobe")
    assert r.status == "ok"
    assert _interfaces(r.result) == ["lo"]


def test_root_and_system_paths_are_read_only(client: Client) -> None:
    probe = (
        "import os\n"
        "out = {}\n"
        "for path in ('/usr/jaild-probe', '/jaild-probe', '/opt/jaild/env/jaild-probe', '/tmp/ok'):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        out[path] = 'written'\n"
        "    except OSError as e:\n"
        "        out[path] = e.errno\n"
        "out"
    )
    r = client.run(probe)
    import errno

    assert r.result["/tmp/ok"] == "written"  # positive control: the probe can write where allowed
    for path in ("/usr/jaild-probe", "/jaild-probe", "/opt/jaild/env/jaild-probe"):
        assert r.result[path] in (errno.EROFS, errno.EACCES), path


def test_host_files_are_invisible(daemon: DaemonHandle) -> None:
    paths = ["/etc/passwd", "/root", "/var/lib/jaild", "/sys/fs/cgroup", "/run", "/home",
             daemon.socket, str(REPO), "/etc/shadow", "/proc/kcore", "/proc/sys/kernel"]
    for p in ("/etc/passwd", "/root", "/var/lib/jaild", "/sys/fs/cgroup", daemon.socket, str(REPO)):
        assert os.path.exists(p), f"control: {p} exists on the host"
    r = daemon.run(f"import os\n{{p: os.path.exists(p) for p in {paths!r}}}")
    assert r.status == "ok"
    assert r.result == {p: False for p in paths}


def test_only_the_jails_own_processes_are_visible(client: Client) -> None:
    host_pids = [p for p in os.listdir("/proc") if p.isdigit()]
    assert len(host_pids) > 10, "control: the host shows many processes"
    r = client.run("import os\nsorted(int(p) for p in os.listdir('/proc') if p.isdigit())")
    assert r.result == [1]


@pytest.mark.parametrize("policy", ["default", "spawn", "pooled"])
def test_the_jailed_process_is_hardened(client: Client, policy: str) -> None:
    def fields(status: str) -> dict[str, str]:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in status.splitlines())}

    control = fields(Path("/proc/self/status").read_text())
    assert control["NoNewPrivs"] == "0" and control["CapEff"] != "0000000000000000"
    r = client.run("open('/proc/self/status').read()", policy=policy)
    inside = fields(r.result)
    assert inside["NoNewPrivs"] == "1"
    assert inside["Seccomp"] == "2"
    assert int(inside["Seccomp_filters"]) >= 2
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert inside[cap] == "0000000000000000", cap
    uids = set(inside["Uid"].split() + inside["Gid"].split())
    # a spawned jail is 65534 inside; a zygote's jail is its own host uid (an identity map)
    assert uids == {"65534"} if policy == "spawn" else len(uids) == 1 and int(uids.pop()) > 65534


@pytest.mark.parametrize("policy", ["default", "spawn", "pooled"])
def test_the_jail_runs_as_an_unprivileged_uid_outside(daemon: DaemonHandle, client: Client,
                                                      policy: str) -> None:
    # While the job runs, a host tool looks at the jails' processes from outside: this job's
    # (alive: it waits for the tool) and any other jail's, such as the pool refilling. Those
    # may end between the listing and the read; a process that is gone has no uid to check.
    def outside_uids() -> list[int]:
        uids = []
        # os.walk, not Path.glob("job-*/**"): glob's walk raises FileNotFoundError when a
        # cgroup it listed is removed before it looks inside (a pool jail ending; seen under
        # load), os.walk passes over it
        procs = []
        for top, _, names in os.walk(daemon.job_root):
            rel = Path(top).relative_to(daemon.job_root).parts
            if rel and rel[0].startswith("job-") and "cgroup.procs" in names:
                procs.append(Path(top, "cgroup.procs"))
        for tasks in procs:
            pids: list[str] = []
            with contextlib.suppress(FileNotFoundError):  # a cgroup removed meanwhile
                pids = tasks.read_text().split()
            for pid in pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
                    continue
                uid_line = next(ln for ln in status.splitlines() if ln.startswith("Uid:"))
                uids.extend(int(u) for u in uid_line.split()[1:])
        return uids

    assert os.geteuid() == 0  # control: the daemon and this test run as root
    r = client.run("await tools.outside_uids()", tools={"outside_uids": outside_uids},
                   policy=policy)
    assert r.status == "ok" and r.result, (r.status, r.error)
    assert 0 not in r.result
    assert all(u >= daemon.config.uid_base for u in r.result)


def test_clean_environment(private_daemon: Callable[..., DaemonHandle]) -> None:
    d = private_daemon(policy_texts("default"), with_repo_policies=False,
                       extra_env={"JAILD_CANARY": "host-secret"})
    daemon_env = Path(f"/proc/{d.proc.pid}/environ").read_bytes()
    assert b"JAILD_CANARY=host-secret" in daemon_env  # control: the daemon has it
    r = d.run("import os\ndict(os.environ)")
    assert "JAILD_CANARY" not in r.result
    assert set(r.result) <= {"HOME", "TMPDIR", "PATH", "LANG", "OMP_NUM_THREADS",
                             "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE"}


def test_mount_flags(client: Client) -> None:
    r = client.run("open('/proc/self/mountinfo').read()")
    mounts = {}
    for line in r.result.splitlines():
        parts = line.split()
        mounts[parts[4]] = set(parts[5].split(","))
    assert {"ro"} <= mounts["/"]
    assert {"ro", "nosuid", "nodev"} <= mounts["/usr"]
    assert {"rw", "nosuid", "nodev", "noexec"} <= mounts["/tmp"]
    assert {"ro", "nosuid", "nodev", "noexec"} <= mounts["/proc"]
    assert {"ro", "nosuid", "nodev"} <= mounts["/opt/jaild/runtime"]
    assert "/sys" not in mounts


def test_setuid_binaries_do_not_elevate(client: Client) -> None:
    su = "/usr/bin/su"
    assert os.stat(su).st_mode & stat.S_ISUID, "control: su is setuid root on the host"
    r = client.run(
        "import subprocess\n"
        "p = subprocess.run(['/usr/bin/su', '-c', 'id -u'], capture_output=True, text=True)\n"
        "(p.returncode, p.stdout)"
    )
    assert r.status == "ok"
    assert r.result[0] != 0 and r.result[1] != "0\n"


def test_the_tool_channel_is_not_inherited_by_subprocesses(client: Client) -> None:
    r = client.run(
        "import subprocess, os\n"
        "mine = sorted(os.listdir('/proc/self/fd'))\n"
        "child = subprocess.run(['ls', '/proc/self/fd'], capture_output=True, text=True).stdout.split()\n"
        "(mine, sorted(child))"
    )
    mine, child = r.result
    assert "3" in mine  # control: the runtime itself holds the channel
    assert child == ["0", "1", "2", "3"]  # ls's own directory fd is 3: the channel is not there
    r2 = client.run("import os\nos.readlink('/proc/self/fd/0')")
    assert r2.result == "/dev/null"  # stdin is not the channel


def test_fork_bomb_is_contained(daemon: DaemonHandle) -> None:
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    result = (n, e.errno)\n"
        "result"
    )
    r = daemon.run(code, policy="tiny")  # tiny: 16 pids
    assert r.status == "ok"
    forks, errno_ = r.result
    assert 3 <= forks < 16  # positive control: forking works, up to the limit
    assert errno_ == 11  # EAGAIN from the pids cgroup
    daemon.assert_serving()


def test_thread_bomb_is_contained(daemon: DaemonHandle) -> None:
    code = (
        "import threading, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "        n += 1\n"
        "except RuntimeError:\n"
        "    pass\n"
        "n"
    )
    r = daemon.run(code, policy="tiny")
    assert r.status == "ok" and 2 <= r.result < 16
    daemon.assert_serving()


def test_hostname_is_the_jails_own(client: Client) -> None:
    assert socket.gethostname() != "jail"
    assert client.run("import socket\nsocket.gethostname()").result == "jail"


def test_jobs_cannot_see_each_other(daemon: DaemonHandle) -> None:
    release = threading.Event()

    def hold() -> bool:
        return release.wait(guard(20))

    with Client(daemon.socket) as c:
        a = c.submit("open('/tmp/a-secret', 'w').write('a')\nawait tools.hold()", tools={"hold": hold})
        b = c.run("import os\n(os.listdir('/tmp'), sorted(p for p in os.listdir('/proc') if p.isdigit()))")
        release.set()
        assert a.result(guard(20)).status == "ok"
    assert b.result == [[], ["1"]]
