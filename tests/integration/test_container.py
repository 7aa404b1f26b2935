"""jaild as the main process of a container: the real image (``make image``) under Debian's
podman, on this host's cgroup v1 (the Debian 12 guest runs the same file on cgroup v2 in
``make test-hosts``).

What a DaemonSet needs of container mode, each proven on a real container:

* a privileged container serves jobs to clients outside it through the shared socket
  directory -- a root client on the host, and a client of another uid in another,
  unprivileged container -- with private and host cgroup namespaces;
* the jails' cgroups are inside the container's own cgroup, and the daemon's memory
  ceiling is 3/4 of the container's memory limit, not of the host's MemTotal (the control:
  before container mode, 3/4 of MemTotal);
* a job over the container's memory limit is killed inside its jail (``memory_limit``) while the
  container and its daemon live on;
* ``podman kill`` of the container leaves no jail process, cgroup or mount behind;
* an unprivileged or half-privileged container fails closed: the daemon does not start,
  and says what is missing in the doctor's words.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from tests.conftest import ImageBuild, _descendants, guard, world_tempdir

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/jaild:latest"
CONTAINERS_CONF = ROOT / "image" / "containers.conf"
POLICY = ROOT / "policies" / "default.toml"
JAIL_UID_BASE = 0x4000_0000
MIB = 1 << 20


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    done = subprocess.run(["podman", *args], capture_output=True, text=True, env=env,
                          timeout=guard(timeout), check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr}")
    return done


pytestmark = pytest.mark.container


@pytest.fixture(scope="module")
def image() -> str:
    """The image ``make image`` builds from this checkout: built beside the tests before
    these (``tests/conftest.py: ImageBuild``)."""
    assert shutil.which("podman"), "podman is missing: `make image-packages` installs it"
    ImageBuild.wait()
    there = podman("image", "exists", IMAGE, check=False)
    assert there.returncode == 0, f"no {IMAGE} after the build: {ImageBuild.log}"
    return IMAGE


class Container:
    """A jaild container: its name, its socket directory on the host, its cgroup."""

    def __init__(self, name: str, sockdir: Path) -> None:
        self.name = name
        self.sockdir = sockdir
        self.socket = str(sockdir / "jaild.sock")

    @property
    def id(self) -> str:
        return podman("inspect", "-f", "{{.Id}}", self.name).stdout.strip()

    @functools.cached_property
    def pid(self) -> int:
        """The host pid of the container's first process (tini, the daemon's parent)."""
        return int(podman("inspect", "-f", "{{.State.Pid}}", self.name).stdout)

    def host_paths(self) -> list[str]:
        """Where the host mounts what is this container's: its root file system, its own
        storage (``/dev/shm``...), its network namespace; and its socket directory."""
        fields = "{{.GraphDriver.Data.MergedDir}}\n{{.StaticDir}}\n{{.NetworkSettings.SandboxKey}}"
        found = podman("inspect", "-f", fields, self.name).stdout.split("\n")
        return [p for p in (*found, str(self.sockdir)) if p.strip()]

    def running(self) -> bool:
        state = podman("inspect", "-f", "{{.State.Running}}", self.name, check=False)
        return state.stdout.strip() == "true"

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    @property
    def cgroup_path(self) -> str:
        """The container's cgroup path (v1 here: ``/libpod_parent/libpod-<id>``; under
        systemd on v2: ``/machine.slice/libpod-<id>.scope``)."""
        return podman("inspect", "-f", "{{.State.CgroupPath}}", self.name).stdout.strip()

    def cgroup(self, controller: str = "memory") -> Path:
        """The container's cgroup directory (v1: in ``controller``'s hierarchy)."""
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            return Path("/sys/fs/cgroup" + self.cgroup_path)
        return Path(f"/sys/fs/cgroup/{controller}{self.cgroup_path}")

    def wait_serving(self) -> None:
        """Until the daemon is ready: it answers early, with ``Welcome.starting`` set until
        its zygotes and self-tests are done (as the DaemonSet's startup probe waits)."""
        deadline = time.monotonic() + guard(120)
        while time.monotonic() < deadline:
            assert self.running(), f"the jaild container stopped:\n{self.logs()}"
            if os.path.exists(self.socket):
                with contextlib.suppress(OSError), Client(self.socket) as client:
                    client.policies()
                    if client.starting is None:
                        return
            time.sleep(0.2)
        raise AssertionError(f"the jaild container did not serve in time:\n{self.logs()}")


def start(image: str, *options: str, privileged: bool = True, wait: bool = True) -> Container:
    sockdir = world_tempdir("jaild-test-ctr-")
    name = f"jaild-test-{uuid.uuid4().hex[:8]}"
    podman(
        "run", "-d", "--name", name, *(["--privileged"] if privileged else []), *options,
        "-v", f"{sockdir}:/run/jaild", "-v", f"{POLICY}:/etc/jaild/test-policies/default.toml:ro",
        image, "/opt/jaild/venv/bin/jaild", "serve", "--policies", "/etc/jaild/test-policies",
        "--log-level", "debug", "--socket-group", "users",  # gid 100 in the image and here
    )
    container = Container(name, sockdir)
    if wait:
        container.wait_serving()
    return container


def run_doctor(image: str, *options: str) -> subprocess.CompletedProcess[str]:
    """``jaild doctor`` in a container of its own, with ``options`` (its privilege)."""
    return podman(
        "run", "--rm", *options, "-v", f"{POLICY}:/etc/jaild/test-policies/default.toml:ro",
        "--entrypoint", "/opt/jaild/venv/bin/jaild", image,
        "doctor", "--policies", "/etc/jaild/test-policies", check=False, timeout=300,
    )


def remove(container: Container) -> None:
    podman("rm", "-f", "-t", "0", container.name, check=False)
    shutil.rmtree(container.sockdir, ignore_errors=True)


def jail_processes(container: Container) -> list[int]:
    """The container's processes running as a jail uid: descendants of its first process (its
    daemon is a child subreaper, so nothing it starts leaves its tree while it runs) in the
    daemon's block of host uids. Every container's daemon serves its own default socket, so
    every one has the default block: another jaild container on this host -- another
    test's, or another suite's -- runs jails as the same uids, and only the process tree
    tells them apart (so a jail outside this container's cgroup would still be found)."""
    out = []
    for pid in _descendants(container.pid):
        with contextlib.suppress(OSError):
            if JAIL_UID_BASE <= os.stat(f"/proc/{pid}").st_uid < JAIL_UID_BASE + 65536:
                out.append(pid)
    return sorted(out)


def mounts_under(paths: list[str]) -> list[str]:
    """The host's mount points at or below any of ``paths``."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [m for m in points if any(m == p or m.startswith(p.rstrip("/") + "/") for p in paths)]


def started(pid: int) -> str:
    """When ``pid`` started (``/proc/PID/stat``'s 22nd field): a pid and this name one
    process, even if the pid is used again later."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return ""


def surviving(processes: list[tuple[int, str]]) -> list[int]:
    return [pid for pid, start in processes if start and started(pid) == start]


@pytest.fixture(scope="module", params=["private", "host"])
def served(request: pytest.FixtureRequest, image: str) -> Iterator[Container]:
    """A privileged jaild container with a 1 GiB memory limit, in a private or the host's
    cgroup namespace."""
    container = start(image, f"--cgroupns={request.param}", "--memory", "1g")
    yield container
    remove(container)


def test_a_host_client_runs_a_job_whose_cgroup_is_inside_the_containers(
    served: Container,
) -> None:
    with Client(served.socket) as client:
        handle = client.submit("import time; print('up', flush=True); time.sleep(30)")
        deadline = time.monotonic() + guard(60)
        pids: list[int] = []
        while not pids and time.monotonic() < deadline:
            pids = jail_processes(served)
            time.sleep(0.05)
        assert pids, "no jailed process appeared"
        # every process of a jail uid (the job's, its policy's zygote and that zygote's
        # nsjail) inside the container's own cgroup, where the container's limit caps it;
        # the job's own in a job cgroup of the daemon's subtree there
        container = served.cgroup_path
        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        for controller in ("",) if v2 else ("memory", "pids"):
            paths = {line.split(":", 2)[2] for pid in pids
                     for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                     if line.split(":", 2)[1] == controller}
            assert paths and all(p.startswith(container + "/") or p == container
                                 for p in paths), (controller, paths)
            assert any(p.startswith(container + "/jaild/job-") for p in paths), paths
        client.kill(handle.job_id)
        assert handle.result().status == "cancelled"  # jaild kill: cancelled, with who
    with Client(served.socket) as client:
        result = client.run("print(6 * 7)")
    assert result.ok and result.stdout.strip() == "42"


def test_the_memory_ceiling_is_three_quarters_of_the_containers_limit(
    served: Container,
) -> None:
    """Control: before container mode the ceiling was 3/4 of the host's MemTotal (18 GiB
    on these 24 GiB machines), whatever the container's limit."""
    v1 = not os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    limit = "memory.limit_in_bytes" if v1 else "memory.max"
    ceiling = int((served.cgroup() / "jaild" / limit).read_text())
    assert ceiling == 1024 * MIB * 3 // 4


def test_a_job_over_the_containers_memory_limit_dies_in_its_jail(served: Container) -> None:
    with Client(served.socket) as client:
        over = client.run("x = bytearray(1536 << 20)", policy="default")
        assert over.status == "memory_limit", over
        after = client.run("print('still here')")
    assert after.ok and after.stdout.strip() == "still here"
    assert served.running()


def test_a_client_of_another_uid_in_another_container_is_served(
    served: Container, image: str,
) -> None:
    """An agent pod's view: no privilege at all, uid 1000, only the socket directory."""
    done = podman(
        "run", "--rm", "--user", "1000:1000", "--group-add", "100", "--cap-drop", "ALL",
        "--read-only",
        "--security-opt", "no-new-privileges", "-v", f"{served.sockdir}:/run/jaild",
        "--entrypoint", "/opt/jaild/venv/bin/jaild", image,
        "run", "-c", "import os; print('job for', os.environ.get('USER', 'nobody'), 6 * 7)",
        check=False, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "42" in done.stdout
    with Client(served.socket) as client:
        uids = set(client.stats().get("uids", {}))
    assert "1000" in {str(u) for u in uids}, uids


def test_podman_kill_leaves_no_jail_process_cgroup_or_mount(image: str) -> None:
    """The mounts looked at are the container's own (:meth:`Container.host_paths`): another
    container on this host -- another suite's -- mounts and unmounts its own meanwhile, and
    podman's storage mount stays while any container runs."""
    container = start(image, "--memory", "1g")
    try:
        cgroups = [container.cgroup(c) for c in ("memory", "pids", "cpuacct")]
        own = container.host_paths()
        assert mounts_under(own), own  # the control: the container's mounts are found
        with Client(container.socket) as client:
            handles = [client.submit("import time; time.sleep(60)") for _ in range(3)]
            deadline = time.monotonic() + guard(60)
            while len(jail_processes(container)) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            jailed = [(pid, started(pid)) for pid in jail_processes(container)]
            assert len(jailed) >= 4  # three jobs' and the zygote's (at least)
            podman("kill", container.name)
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.result()
        podman("rm", container.name)
        deadline = time.monotonic() + guard(30)
        while surviving(jailed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert surviving(jailed) == []
        assert [c for c in cgroups if c.exists()] == []
        assert mounts_under(own) == []
    finally:
        remove(container)


@pytest.mark.parametrize(
    ("options", "missing"),
    [
        ((), ["capabilities: missing CAP_SYS_ADMIN", "/proc unmasked: masked:",
              "cgroupfs writable: read-only", "namespaces: unshare refused"]),
        (("--cap-add", "SYS_ADMIN"), ["/proc unmasked: masked:"]),
    ],
    ids=["unprivileged", "half-privileged"],
)
def test_an_unprivileged_container_fails_closed_in_the_doctors_words(
    image: str, options: tuple[str, ...], missing: list[str],
) -> None:
    container = start(image, *options, privileged=False, wait=False)
    try:
        deadline = time.monotonic() + guard(120)
        while container.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not container.running(), "the daemon must not serve without its privilege"
        exit_code = podman("inspect", "-f", "{{.State.ExitCode}}", container.name).stdout.strip()
        log = container.logs()
        assert exit_code != "0", log
        assert "jails cannot be made here (`jaild doctor` says the same)" in log, log
        for words in missing:
            assert words in log, log
        doctor = run_doctor(image, *options)
        assert doctor.returncode != 0
        for words in missing:
            name = words.split(":")[0]
            assert any(line.lstrip().startswith("FAIL") and name in line
                       for line in doctor.stdout.splitlines()), doctor.stdout
    finally:
        remove(container)


def test_a_privileged_container_passes_the_same_checks(served: Container, image: str) -> None:
    """The positive control of the refusals: the same doctor, privileged, finds nothing
    missing in the daemon's privilege."""
    doctor = run_doctor(image, "--privileged")
    for name in ("capabilities", "/proc unmasked", "cgroupfs writable", "namespaces"):
        assert any(line.lstrip().startswith("ok") and name in line
                   for line in doctor.stdout.splitlines()), doctor.stdout + doctor.stderr


def test_snapshots_outlive_the_container_with_the_daemonsets_state_volume(
        image: str, tmp_path: Path) -> None:
    """The DaemonSet mounts a node directory at ``/var/lib/jaild/snapshots`` and
    ``/var/lib/jaild/parked`` (deploy/kubernetes/daemonset.yaml): a container replaced --
    a restart in Kubernetes is a new container, a rollout a new pod -- keeps the snapshots,
    and the new one restores them. Without the volume they are gone with the container's
    writable layer (the control). Both pairs side by side: two starts' time, not four."""
    from jaild.errors import UnknownSnapshot

    state = tmp_path / "state"
    for sub in ("snapshots", "parked"):
        (state / sub).mkdir(parents=True)
    volume = ("-v", f"{state / 'snapshots'}:/var/lib/jaild/snapshots",
              "-v", f"{state / 'parked'}:/var/lib/jaild/parked")
    first = {"kept": start(image, *volume, wait=False), "lost": start(image, wait=False)}
    second: dict[str, Container] = {}
    try:
        ids = {}
        for which, container in first.items():
            container.wait_serving()
            with Client(container.socket) as c, c.session() as s:
                s.run("x = 41")
                ids[which] = s.snapshot()["id"]
        for container in first.values():
            podman("rm", "-f", "-t", "0", container.name)
        second = {"kept": start(image, *volume, wait=False), "lost": start(image, wait=False)}
        for container in second.values():
            container.wait_serving()
        with Client(second["kept"].socket) as c, c.restore(ids["kept"]) as s:
            assert s.run("x + 1").result == 42  # the state, in a new container
        with Client(second["lost"].socket) as c, pytest.raises(UnknownSnapshot), \
                c.restore(ids["lost"]) as s:
            s.run("x")
    finally:
        for container in (*first.values(), *second.values()):
            remove(container)
