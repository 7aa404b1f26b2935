"""Pods as tenants on a real container runtime (issue 43, items 5 and 8): the image under
podman with the DaemonSet's settings, "pods" that are real containers in cgroups named as the
kubelet names them, and the Kubernetes API answered by the fake (``tests/k8s_fake.py``; no
API server or kubelet can run here). On this host's cgroup v1; the Debian 12 guest runs the
same file on cgroup v2 (``make test-hosts``, its "containers" suite).

The daemon's container is made from ``deploy/kubernetes/daemonset.yaml`` as read here
(:func:`daemonset_run_options`): privileged, the host's pid namespace (``hostPID``), the host's
cgroup namespace (which pods as tenants needs), its env (``JAILD_CONFIG``, the
node's name for ``JAILD_NODE_NAME``), its memory and CPU limits, its volume mounts -- the socket
directory, the policies and ``jaild.toml`` as its ConfigMaps hold them (the base's own files),
the state directory's two subPaths -- and what the kubelet adds to every pod: the service
account's token and CA, ``KUBERNETES_SERVICE_HOST``/``PORT`` (the fake, over HTTPS, on the
container bridge's address), a network namespace of its own. Its probes are run as the kubelet
would: the exec ones with ``podman exec``, the HTTP one at the container's address.

An agent "pod" (:class:`AgentPod`) is a container of the same image run as the example agent
runs (uid 10001, group 100, no capabilities, read-only, the socket directory read-only, a
network namespace of its own). The kubelet's runtime puts a container in ``<pod>/<id>``
(cgroupfs driver: ``/kubepods/burstable/pod<uid>/<id>``) or ``<pod slice>/cri-containerd-
<id>.scope`` (systemd driver: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-
pod<uid_>.slice/...``). podman does neither: under ``--cgroup-parent`` it names the leaf
``libpod-<id>``, and it refuses a systemd slice as a parent with its cgroupfs manager. So
the cgroupfs pod's cgroup is podman's (``--cgroup-parent``), and the test makes the kubelet's
leaf -- and the systemd driver's whole path -- in every hierarchy and moves the container's
first process there before it connects (:func:`place`). The container id is podman's, and
the fake API reports it in the pod's status, as the kubelet would.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from jaild.client import Client
from jaild.errors import Busy, ConnectionLost, PermissionDenied
from tests.conftest import ImageBuild, guard, world_tempdir
from tests.integration.test_container import (
    Container,
    jail_processes,
    mounts_under,
    podman,
    started,
    surviving,
)
from tests.k8s_fake import NODE, FakeKubeAPI, make_pod
from tests.tls import CertAuthority

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
IMAGE = "localhost/jaild:latest"
TOKEN = "pods-container-test-token"
AGENT_UID = 10001  # the example agent's runAsUser (deploy/kubernetes/examples)
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
CGROUPS = Path("/sys/fs/cgroup")
KUBEPODS_LOCK = "/run/lock/jaild-test-kubepods.lock"
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "image" / "containers.conf")}

pytestmark = pytest.mark.container


@pytest.fixture(scope="module")
def image() -> str:
    """The image ``make image`` builds from this checkout (``tests/conftest.py: ImageBuild``)."""
    assert shutil.which("podman"), "podman is missing: `make image-packages` installs it"
    ImageBuild.wait()
    there = podman("image", "exists", IMAGE, check=False)
    assert there.returncode == 0, f"no {IMAGE} after the build: {ImageBuild.log}"
    return IMAGE


# --- the DaemonSet, as podman runs it ----------------------------------------------------


def daemonset() -> dict[str, Any]:
    """The DaemonSet's pod template's spec (deploy/kubernetes/daemonset.yaml)."""
    spec: dict[str, Any] = yaml.safe_load((BASE / "daemonset.yaml").read_text())
    return spec["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def jaild_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == "jaild"]
    return container  # type: ignore[no-any-return]


def bridge_gateway() -> str:
    """The host's address on podman's default network, where a container reaches it."""
    done = podman("network", "inspect", "podman", "-f",
                  "{{range .Subnets}}{{.Gateway}} {{end}}")
    return done.stdout.split()[0]


@dataclass
class Cluster:
    """What the kubelet and the API server give a DaemonSet's pod here: the fake API's
    address and the service account's files (token, CA, namespace) in one directory."""

    api: FakeKubeAPI
    service_account: Path


def daemonset_run_options(cluster: Cluster, sockdir: Path, state: Path,
                          config_dir: Path) -> list[str]:
    """``podman run`` options for the DaemonSet's jaild container, read from its manifest.
    ``config_dir`` holds the ConfigMap ``jaild-config``'s ``jaild.toml``."""
    pod = daemonset()
    container = jaild_container(pod)
    assert container["securityContext"]["privileged"] is True
    assert pod["hostPID"] is True
    options = ["--privileged", "--pid=host",
               # what pods as tenants need (kubernetes.md, "The host's cgroup namespace");
               # whether a runtime gives a privileged pod one of its own is not tried here
               "--cgroupns=host",
               "--stop-timeout", str(pod["terminationGracePeriodSeconds"])]
    limits = container["resources"]["limits"]
    assert limits["memory"].endswith("Gi")
    options += ["--memory", f"{int(limits['memory'][:-2])}g", "--cpus", str(limits["cpu"])]
    for var in container["env"]:
        if "value" in var:
            options += ["-e", f"{var['name']}={var['value']}"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", var
            options += ["-e", f"{var['name']}={NODE}"]
    host, port = cluster.api.host, cluster.api.port
    options += ["-e", f"KUBERNETES_SERVICE_HOST={host}", "-e", f"KUBERNETES_SERVICE_PORT={port}",
                "-v", f"{cluster.service_account}:{SERVICE_ACCOUNT}:ro"]
    volumes = {}
    for volume in pod["volumes"]:
        if "hostPath" in volume:
            sources = {"/run/jaild": sockdir, "/var/lib/jaild-state": state}
            volumes[volume["name"]] = sources[volume["hostPath"]["path"]]
        elif volume["configMap"]["name"] == "jaild-config":
            volumes[volume["name"]] = config_dir
        else:
            assert volume["configMap"]["name"] == "jaild-policies", volume
            volumes[volume["name"]] = BASE / "policies"
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]] / mount.get("subPath", "")
        options += ["-v", f"{source}:{mount['mountPath']}"
                          + (":ro" if mount.get("readOnly") else "")]
    return [*options, container["image"]]


class DaemonPod(Container):
    """The DaemonSet's jaild container: its probes as the kubelet runs them."""

    def __init__(self, name: str, sockdir: Path, state: Path) -> None:
        super().__init__(name, sockdir)
        self.state = state

    def probe(self, which: str, command: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        """An exec probe of the manifest's (``startupProbe``, ``readinessProbe``), or
        ``command``, run in the container as the kubelet runs it."""
        argv = command or jaild_container(daemonset())[which]["exec"]["command"]
        return podman("exec", self.name, *argv, check=False, timeout=60)

    def liveness(self) -> tuple[int, str]:
        """The manifest's HTTP liveness probe, at the container's address, as the kubelet
        sends it: the status and the body."""
        container = jaild_container(daemonset())
        get = container["livenessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = ports.get(get["port"], get["port"])
        address = podman("inspect", "-f", "{{.NetworkSettings.IPAddress}}",
                         self.name).stdout.strip()
        with urllib.request.urlopen(f"http://{address}:{port}{get['path']}",
                                    timeout=guard(30)) as answer:
            return answer.status, answer.read().decode()

    def exit_code(self) -> int:
        return int(podman("inspect", "-f", "{{.State.ExitCode}}", self.name).stdout)


def start_daemon_pod(image: str, cluster: Cluster, *, outside_pods: str = "uid") -> DaemonPod:
    """The DaemonSet's container, its config the base's ``jaild.toml`` (with
    ``access.outside_pods`` set to ``outside_pods``: the base's is "uid")."""
    sockdir = world_tempdir("jaild-test-podsd-")
    state = sockdir.with_name(sockdir.name + "-state")
    for sub in ("snapshots", "parked", "config"):
        (state / sub).mkdir(parents=True)
    base = (BASE / "jaild.toml").read_text()
    assert 'outside_pods = "uid"' in base
    (state / "config" / "jaild.toml").write_text(
        base.replace('outside_pods = "uid"', f'outside_pods = "{outside_pods}"'))
    name = f"jaild-test-pods-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name,
           *daemonset_run_options(cluster, sockdir, state, state / "config"))
    return DaemonPod(name, sockdir, state)


def remove_daemon_pod(container: DaemonPod) -> None:
    podman("rm", "-f", "-t", "0", container.name, check=False)
    shutil.rmtree(container.sockdir, ignore_errors=True)
    shutil.rmtree(container.state, ignore_errors=True)


# --- agent pods: containers in the cgroups the kubelet names -----------------------------


def kubepods_parent(pod_uid: str, driver: str) -> str:
    """The pod's cgroup (burstable QoS: the example agent's requests are below its limits)."""
    if driver == "cgroupfs":
        return f"/kubepods/burstable/pod{pod_uid}"
    return ("/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice")


def kubelet_path(pod_uid: str, container_id: str, driver: str) -> str:
    """The container's cgroup, as containerd names it below its pod's for each driver."""
    leaf = container_id if driver == "cgroupfs" else f"cri-containerd-{container_id}.scope"
    return f"{kubepods_parent(pod_uid, driver)}/{leaf}"


def hierarchy_mounts() -> dict[frozenset[str], Path]:
    """Each cgroup hierarchy's mount below /sys/fs/cgroup, by its controllers as
    ``/proc/PID/cgroup`` names them (cgroup v2's: the empty set)."""
    found: dict[frozenset[str], Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, after = line.split(" - ", 1)
        point = before.split()[4]
        fstype, _source, options = after.split()[:3]
        if not point.startswith(str(CGROUPS)):
            continue
        if fstype == "cgroup2":
            found.setdefault(frozenset(), Path(point))
        elif fstype == "cgroup":
            found.setdefault(frozenset(options.split(",")), Path(point))
    return found


def hierarchy_of(controllers: str, mounts: dict[frozenset[str], Path]) -> Path:
    wanted = frozenset(controllers.split(",")) if controllers else frozenset()
    if not wanted:
        return mounts[frozenset()]
    (point,) = [p for opts, p in mounts.items() if wanted <= opts]
    return point


def place(pid: int, path: str) -> None:
    """Move ``pid`` (a container's first process) to the cgroup ``path`` in every hierarchy
    it is in, making what is missing of ``path``: where the kubelet's runtime would have put
    it."""
    mounts = hierarchy_mounts()
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _n, controllers, _path = line.split(":", 2)
        base = hierarchy_of(controllers, mounts)
        directory = base
        for part in path.strip("/").split("/"):
            parent, directory = directory, directory / part
            if directory.exists():
                continue
            directory.mkdir()
            if "cpuset" in controllers.split(","):  # v1: an empty cpuset takes no process
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (directory / knob).write_text((parent / knob).read_text())
        (directory / "cgroup.procs").write_text(str(pid))


AGENT = """
import json, sys, threading
from jaild.client import Client
from jaild.errors import JaildError

gate, entered, jobs = threading.Event(), threading.Event(), {}

def say(**fields):
    print(json.dumps(fields), flush=True)

def wait_gate():
    entered.set()
    gate.wait()
    return "released"

with Client("/run/jaild/jaild.sock") as c:
    say(connected=True)
    for line in sys.stdin:
        command, *args = line.split()
        try:
            if command == "run":
                r = c.run("print(6 * 7)")
                say(job=r.job_id, status=r.status, stdout=r.stdout.strip())
            elif command == "hold":
                j = c.submit("import time; time.sleep(120)")
                jobs[j.job_id] = j
                say(job=j.job_id)
            elif command == "gated":
                j = c.submit("print(await tools.gate())", tools={"gate": wait_gate})
                jobs[j.job_id] = j
                entered.wait()
                say(job=j.job_id)
            elif command == "release":
                gate.set()
                say(released=True)
            elif command == "result":
                r = jobs[args[0]].result()
                say(job=r.job_id, status=r.status, stdout=r.stdout.strip())
            elif command == "ps":
                say(ps=sorted([j["id"], j["pod"]] for j in c.jobs()))
            elif command == "snapshot":
                with c.session() as s:
                    s.run("x = 41")
                    say(snapshot=s.snapshot()["id"])
            elif command == "snapshots":
                say(snapshots=sorted(e["id"] for e in c.snapshots()))
            elif command == "kill":
                for job in jobs:
                    c.kill(job)
                say(killed=len(jobs))
        except JaildError as exc:
            say(error=exc.code, message=str(exc))
"""


class AgentPod:
    """An agent pod's container, placed as the kubelet places it, running :data:`AGENT`:
    one command a line on its stdin, one JSON answer a line on its stdout."""

    def __init__(self, image: str, daemon: DaemonPod, api: FakeKubeAPI, name: str,
                 driver: str) -> None:
        self.uid = str(uuid.uuid4())
        self.name = name
        self.driver = driver
        self.pod = f"agents/{name}"
        self.container = f"jaild-test-agent-{uuid.uuid4().hex[:8]}"
        self.lines: queue.Queue[str] = queue.Queue()
        # cgroupfs: podman makes the pod's cgroup and a leaf of its own in it, libpod-<id>
        # (and conmon's, "conmon"); the systemd driver's slices it refuses as a parent with
        # its cgroupfs manager (with its systemd manager it would make them units of its
        # own), so those the test makes, as it makes each driver's leaf (:func:`place`)
        parent = (["--cgroup-parent", kubepods_parent(self.uid, driver)]
                  if driver == "cgroupfs" else [])
        # the example agent's securityContext; a network namespace of its own, as a pod has
        self.proc = subprocess.Popen(
            ["podman", "--cgroup-manager", "cgroupfs", "run", "-i", "--name", self.container,
             *parent, "--network", "none",
             "--user", f"{AGENT_UID}:{AGENT_UID}", "--group-add", "100", "--cap-drop", "ALL",
             "--read-only", "--security-opt", "no-new-privileges", "--memory", "256m",
             "-v", f"{daemon.sockdir}:/run/jaild:ro", "--entrypoint", "/bin/sh", image,
             "-c", 'echo ready; read go; exec /opt/jaild/venv/bin/python -c "$0"', AGENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=PODMAN_ENV,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self._line() == "ready", self.stderr()
        self.id = podman("inspect", "-f", "{{.Id}}", self.container).stdout.strip()
        self.pid = int(podman("inspect", "-f", "{{.State.Pid}}", self.container).stdout)
        place(self.pid, kubelet_path(self.uid, self.id, driver))
        api.add_pod(make_pod(self.uid, name, "agents", service_account="agent",
                             containers=(self.id,)))
        self._send("go")
        assert self.ask_line() == {"connected": True}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("")

    def _line(self) -> str:
        try:
            return self.lines.get(timeout=guard(120))
        except queue.Empty:
            raise AssertionError(f"agent {self.name} said nothing: {self.stderr()}") from None

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ask_line(self) -> dict[str, Any]:
        line = self._line()
        assert line, f"agent {self.name} ended: {self.stderr()}"
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, *command: str) -> dict[str, Any]:
        self._send(" ".join(command))
        return self.ask_line()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stderr.read() if self.proc.stderr else ""

    def cgroup_paths(self) -> set[str]:
        return {line.split(":", 2)[2]
                for line in Path(f"/proc/{self.pid}/cgroup").read_text().splitlines()}

    def remove(self) -> None:
        """The container, then its pod's cgroups (podman's, conmon's and the test's)."""
        # removed while it runs: an agent let go first (its stdin closed) exits at once, and
        # podman's own clean-up of it raced this removal and left it behind
        podman("rm", "-f", "-t", "0", self.container)
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        self.proc.wait(timeout=guard(60))
        self.reader.join(guard(60))
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
        for base in hierarchy_mounts().values():
            pod = base / kubepods_parent(self.uid, self.driver).lstrip("/")
            if pod.exists():
                for directory, _dirs, _files in sorted(os.walk(pod), key=lambda w: -len(w[0])):
                    os.rmdir(directory)


@contextlib.contextmanager
def kubepods() -> Iterator[None]:
    """The kubelet's hierarchy tops (``/kubepods``, ``/kubepods.slice`` and their QoS
    levels), made by podman for the agent pods, are shared with any other run of this
    module on the host: held shared while in use, removed by the last one out."""
    with open(KUBEPODS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield
        finally:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another run uses them; it removes them
            for base in hierarchy_mounts().values():
                for top in ("kubepods/burstable", "kubepods",
                            "kubepods.slice/kubepods-burstable.slice", "kubepods.slice"):
                    with contextlib.suppress(OSError):  # gone, or a crashed run's left
                        (base / top).rmdir()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The fake API server over HTTPS on the container bridge's address, with a bearer
    token; the service account's files for the daemon's pod."""
    directory = tmp_path_factory.mktemp("cluster")
    gateway = bridge_gateway()
    ca = CertAuthority(directory / "pki")
    server = ca.server(names=("kubernetes.default.svc",), ips=(gateway,))
    account = world_tempdir("jaild-test-sa-")
    shutil.copy(ca.cert, account / "ca.crt")
    (account / "token").write_text(TOKEN)
    (account / "namespace").write_text("jaild-system")
    try:
        with kubepods(), FakeKubeAPI(token=TOKEN, tls=(server.cert, server.key),
                                     host=gateway) as api:
            yield Cluster(api, account)
    finally:
        shutil.rmtree(account, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon_pod(image: str, cluster: Cluster) -> Iterator[DaemonPod]:
    """The DaemonSet's container with the base's config as it is. Its last test stops it."""
    container = start_daemon_pod(image, cluster)
    try:
        container.wait_serving()
        yield container
    finally:
        remove_daemon_pod(container)


@pytest.fixture(scope="module")
def agents(image: str, daemon_pod: DaemonPod,
           cluster: Cluster) -> Iterator[dict[str, AgentPod]]:
    """Two agent pods of one uid (10001): one under the cgroupfs driver's names, one under
    the systemd driver's."""
    pods: dict[str, AgentPod] = {}
    try:
        for name, driver in (("agent-a", "cgroupfs"), ("agent-b", "systemd")):
            pods[name] = AgentPod(image, daemon_pod, cluster.api, name, driver)
        yield pods
    finally:
        for pod in pods.values():
            pod.remove()


def audit_line(container: Container, job_id: str) -> str:
    """The job's audit record in the container's log, once conmon has written it there (it
    copies the daemon's output to the log file on its own time)."""
    deadline = time.monotonic() + guard(60)
    while True:
        lines = [line for line in container.logs().splitlines()
                 if "audit: event=job " in line and f" job={job_id} " in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) == 1, (job_id, lines)
    return lines[0]


def wait_refusing(container: DaemonPod) -> str:
    """Wait until ``container``'s daemon answers, and return its refusal of this process
    (root on the host, in no pod); fail if it serves it."""
    deadline = time.monotonic() + guard(180)
    while time.monotonic() < deadline:
        assert container.running(), f"the jaild container stopped:\n{container.logs()}"
        if os.path.exists(container.socket):
            try:
                with Client(container.socket) as client:
                    client.policies()
            except PermissionDenied as exc:
                return str(exc)
            except OSError:
                pass
            else:
                raise AssertionError('a process in no pod was served: outside_pods = "refuse"')
        time.sleep(0.2)
    raise AssertionError(f"the jaild container did not serve in time:\n{container.logs()}")


def stopping(container: Container) -> subprocess.Popen[str]:
    """``podman stop`` with the container's own stop timeout, in the background."""
    return subprocess.Popen(
        ["podman", "stop", container.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=PODMAN_ENV)


class KubeletStop(threading.Thread):
    """A pod's container ended as the kubelet asks its runtime to (CRI ``StopContainer``):
    the stop signal to the container's first process (tini, which passes it on), then,
    after the grace period, SIGKILL. Not ``podman stop``: for a container in the host's pid
    namespace (``hostPID``) podman sends the stop signal to *every* process of the
    container, the jails' included, which ends the running jobs at once instead of draining
    them (tried: the job ended ``internal_error``, "the zygote of policy 'default' died").
    Which processes a CRI runtime signals in a hostPID container is not tried here.
    ``killed``: the grace period ran out."""

    def __init__(self, container: Container, grace_s: float) -> None:
        super().__init__(name="kubelet-stop", daemon=True)
        self.container, self.grace_s = container, grace_s
        self.killed = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            podman("kill", "--signal", "SIGTERM", self.container.name)
            try:  # the grace period itself, as the kubelet times it (not a liveness guard)
                subprocess.run(["podman", "wait", self.container.name], env=PODMAN_ENV,
                               capture_output=True, timeout=self.grace_s, check=True)
            except subprocess.TimeoutExpired:
                self.killed = True
                podman("kill", "--signal", "SIGKILL", self.container.name)
        except BaseException as exc:  # the test thread raises it (wait)
            self.error = exc

    def wait(self) -> None:
        self.join(guard(300))
        assert not self.is_alive(), "the stop did not end"
        if self.error is not None:
            raise self.error


def wait_draining(container: Container) -> None:
    """Until the daemon has had its SIGTERM: it refuses new work ``busy``, "draining"."""
    deadline = time.monotonic() + guard(60)
    with Client(container.socket) as client:
        while True:
            try:
                client.kill(client.submit("import time; time.sleep(60)").job_id)
            except Busy as exc:
                assert "draining" in str(exc), exc
                return
            assert time.monotonic() < deadline, "the daemon did not start draining"
            time.sleep(0.1)


def gone(jailed: list[tuple[int, str]]) -> list[int]:
    """The processes of ``jailed`` still alive, once they have had time to go."""
    deadline = time.monotonic() + guard(30)
    while surviving(jailed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return surviving(jailed)


# --- the tests ------------------------------------------------------------------------------


def test_the_probes_pass_as_the_kubelet_runs_them(daemon_pod: DaemonPod) -> None:
    for which in ("startupProbe", "readinessProbe"):
        done = daemon_pod.probe(which)
        assert done.returncode == 0, (which, done.stdout, done.stderr)
        assert "default" in done.stdout, done.stdout  # the policies it lists
    # the control: the same command where no daemon serves fails, so a pass means one does
    command = [*jaild_container(daemonset())["readinessProbe"]["exec"]["command"][:-1],
               "/run/jaild/nothing-here.sock"]
    assert daemon_pod.probe("", command).returncode != 0
    status, body = daemon_pod.liveness()
    assert status == 200 and "jaild_" in body, body[:400]


def test_agent_pods_are_in_the_cgroups_the_kubelet_names(agents: dict[str, AgentPod]) -> None:
    """Where the agents' processes are, as the daemon reads it: every hierarchy's line is
    the kubelet's name of the pod's container (the control of the tests below: what they
    prove is about clients in these cgroups)."""
    a, b = agents["agent-a"], agents["agent-b"]
    assert a.cgroup_paths() == {f"/kubepods/burstable/pod{a.uid}/{a.id}"}
    uid_ = b.uid.replace("-", "_")
    assert b.cgroup_paths() == {
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{uid_}.slice/cri-containerd-{b.id}.scope"}
    assert {os.stat(f"/proc/{p.pid}").st_uid for p in (a, b)} == {AGENT_UID}


def test_two_pods_of_one_uid_are_two_tenants(
    daemon_pod: DaemonPod, agents: dict[str, AgentPod],
) -> None:
    a, b = agents["agent-a"], agents["agent-b"]
    held = {pod.pod: pod.ask("hold")["job"] for pod in (a, b)}
    try:
        # each pod sees its own job, named by its pod, and not the other's
        assert a.ask("ps") == {"ps": [[held[a.pod], a.pod]]}
        assert b.ask("ps") == {"ps": [[held[b.pod], b.pod]]}
        # the control: root on the node, in no pod, is served as its uid (the base's
        # outside_pods = "uid") and sees both, each named by its pod
        with Client(daemon_pod.socket) as host:
            rows = {(j["id"], j["pod"]) for j in host.jobs()}
            assert {(job, pod) for pod, job in held.items()} <= rows
            mine = host.run("print(6 * 7)")
            assert mine.stdout.strip() == "42"
        line = audit_line(daemon_pod, mine.job_id)
        assert " uid=0 pid=" in line and " pod=" not in line, line  # as its uid, no pod
    finally:
        for pod in (a, b):
            pod.ask("kill")
    # snapshots are the pod's: B does not see A's
    snapshot = a.ask("snapshot")["snapshot"]
    assert snapshot in a.ask("snapshots")["snapshots"]
    assert snapshot not in b.ask("snapshots")["snapshots"]
    # each job's audit record names its own pod (and the one uid both run as)
    for pod in (a, b):
        ran = pod.ask("run")
        assert ran["status"] == "ok" and ran["stdout"] == "42", ran
        line = audit_line(daemon_pod, ran["job"])
        assert f" uid={AGENT_UID} pod={pod.pod} pod_uid={pod.uid} " in line, line


def test_sigterm_drains_a_running_job_to_its_result(
    daemon_pod: DaemonPod, agents: dict[str, AgentPod],
) -> None:
    """The kubelet's stop (:class:`KubeletStop`, the pod's terminationGracePeriodSeconds): a
    pod's job that runs when the SIGTERM comes returns its result, new work is refused
    ``busy`` meanwhile and the readiness probe still passes; the daemon exits on its own
    (exit code 0: the grace period did not run out), leaving no jail process, cgroup or
    mount. It stops the module's daemon: the last test that uses it."""
    a = agents["agent-a"]
    cgroups = [daemon_pod.cgroup(c) for c in ("memory", "pids", "cpuacct")]
    own = daemon_pod.host_paths()
    assert mounts_under(own), own  # the control: the container's mounts are found
    gated = a.ask("gated")["job"]  # in its tool call, which waits for "release"
    jailed = [(pid, started(pid)) for pid in jail_processes(daemon_pod)]
    assert jailed
    stop = KubeletStop(daemon_pod, daemonset()["terminationGracePeriodSeconds"])
    stop.start()
    wait_draining(daemon_pod)
    ready = daemon_pod.probe("readinessProbe")
    assert ready.returncode == 0, ready.stderr
    assert a.ask("release") == {"released": True}
    assert a.ask("result", gated) == {"job": gated, "status": "ok", "stdout": "released"}
    stop.wait()
    assert not stop.killed
    assert daemon_pod.exit_code() == 0, daemon_pod.logs()[-3000:]
    assert "drained: every running job finished" in daemon_pod.logs()
    podman("rm", daemon_pod.name)
    assert gone(jailed) == []
    assert [c for c in cgroups if c.exists()] == []
    assert mounts_under(own) == []


def test_podman_stop_of_a_hostpid_container_signals_its_jails_too(
    image: str, cluster: Cluster,
) -> None:
    """Why the drain test stops the container as the kubelet asks its runtime to, and what
    docs/running/kubernetes.md warns of: ``podman stop`` of a container in the host's pid
    namespace sends SIGTERM to every process in it, so a job waiting in a tool call ends at
    once -- its record comes while its tool has not answered -- instead of draining. The
    control is the drain test: SIGTERM to the first process alone, the same job returns
    ``ok`` once its tool answers."""
    container = start_daemon_pod(image, cluster)
    gate, entered = threading.Event(), threading.Event()

    def tool() -> str:
        entered.set()
        gate.wait()
        return "released"

    try:
        container.wait_serving()
        with Client(container.socket) as client:
            job = client.submit("print(await tools.gate())", tools={"gate": tool})
            assert entered.wait(guard(60))
            stop = stopping(container)
            ended = job.result(timeout=guard(120))
            assert not gate.is_set()
        assert ended.status != "ok", ended
        _out, err = stop.communicate(timeout=guard(120))
        assert stop.returncode == 0, err
        # nor did the drain run its course: SIGTERM to the first process alone would have
        # let it wait the 60 s for the tool, then cancel the job saying so
        assert "drained for 60 s" not in container.logs()
    finally:
        gate.set()
        remove_daemon_pod(container)


def test_sigkill_of_the_daemonsets_container_leaves_no_jail_cgroup_or_mount(
    image: str, cluster: Cluster,
) -> None:
    """SIGKILL (the kubelet's, past the grace period; here ``podman kill``) of the
    DaemonSet's container, which shares the host's pid namespace -- so its jails do not die
    with a pid namespace of its own: a pod's job in a tool call gets ``connection_lost``, and
    once the runtime removes the container no jail process, cgroup or mount is left. This
    daemon refuses a process in no pod (``outside_pods = "refuse"``, the other choice than
    the base's) while it serves a pod's (the control)."""
    container = start_daemon_pod(image, cluster, outside_pods="refuse")
    agent: AgentPod | None = None
    try:
        refusal = wait_refusing(container)
        assert "is in no pod's cgroup" in refusal, refusal
        agent = AgentPod(image, container, cluster.api, "agent-c", "systemd")
        ran = agent.ask("run")
        assert ran["status"] == "ok" and ran["stdout"] == "42", ran
        gated = agent.ask("gated")["job"]
        cgroups = [container.cgroup(c) for c in ("memory", "pids", "cpuacct")]
        own = container.host_paths()
        assert mounts_under(own), own
        jailed = [(pid, started(pid)) for pid in jail_processes(container)]
        assert len(jailed) >= 2  # the job's and its policy's zygote (at least)
        podman("kill", "--signal", "SIGKILL", container.name)
        assert agent.ask("result", gated)["error"] == "connection_lost"
        podman("wait", container.name)
        assert container.exit_code() == 137  # 128 + SIGKILL
        podman("rm", container.name)
        assert gone(jailed) == []
        assert [c for c in cgroups if c.exists()] == []
        assert mounts_under(own) == []
    finally:
        if agent is not None:
            agent.remove()
        remove_daemon_pod(container)


DOCUMENTED_STOP_TIMEOUT_S = 30  # docs/running/container-image.md, "Running it"


def start_as_documented(image: str, *options: str) -> Container:
    """The image as docs/running/container-image.md runs it, with ``options`` before the
    image: its own config (``drain_s = 15``)."""
    sockdir = world_tempdir("jaild-test-doc-")
    name = f"jaild-test-doc-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name, "--privileged", "--memory", "4g", *options,
           "-v", f"{sockdir}:/run/jaild", image,
           "/opt/jaild/venv/bin/jaild", "serve", "--socket-group", "users")
    return Container(name, sockdir)


def test_the_documented_stop_timeout_outlasts_the_drain_and_podmans_default_does_not(
    image: str, tmp_path: Path,
) -> None:
    """Issue 43, item 8: the image as documented -- its own ``drain_s = 15`` (with
    ``limits.shutdown_grace_s``, 25 s), ``--stop-timeout 30`` -- and ``podman stop``: a job
    that finishes while the daemon drains returns its result, one that outlasts the drain is
    cancelled and still returns its record, and the daemon exits on its own (exit code 0).
    The control: podman's default stop timeout (10 s) with a job running: its client gets
    ``connection_lost``, the container exit code 137 (SIGKILL). Its drain is raised to 60 s
    (a config mounted over the image's) so that podman's SIGKILL comes 50 s before the
    drain would end, not 5 s: the outcome cannot depend on how loaded the host is."""
    doc = (ROOT / "docs" / "running" / "container-image.md").read_text()
    assert f"--stop-timeout {DOCUMENTED_STOP_TIMEOUT_S} " in doc
    config = (ROOT / "image" / "jaild.toml").read_text()
    assert "\ndrain_s = 15\n" in config
    (tmp_path / "jaild.toml").write_text(config.replace("\ndrain_s = 15\n", "\ndrain_s = 60\n"))
    tmp_path.chmod(0o755)
    documented = start_as_documented(image, "--stop-timeout", str(DOCUMENTED_STOP_TIMEOUT_S))
    default = start_as_documented(image, "-v", f"{tmp_path / 'jaild.toml'}:/etc/jaild/jaild.toml:ro")
    gates = {name: threading.Event() for name in ("finishes", "outlasts", "killed")}
    entered = {name: threading.Event() for name in gates}

    def tool(name: str) -> Any:
        def gate() -> str:
            entered[name].set()
            gates[name].wait()
            return "released"
        return gate

    stops: list[subprocess.Popen[str]] = []
    try:
        documented.wait_serving()
        default.wait_serving()
        with Client(documented.socket) as one, Client(default.socket) as other:
            jobs = {name: (other if name == "killed" else one).submit(
                        "print(await tools.gate())", tools={"gate": tool(name)})
                    for name in gates}
            for name in gates:
                assert entered[name].wait(guard(60)), name
            stops = [stopping(documented), stopping(default)]
            wait_draining(documented)
            gates["finishes"].set()
            finished = jobs["finishes"].result(timeout=guard(60))
            assert (finished.status, finished.stdout.strip()) == ("ok", "released")
            outlasted = jobs["outlasts"].result(timeout=guard(120))  # the drain's end
            assert outlasted.status == "cancelled", outlasted
            with pytest.raises(ConnectionLost):
                jobs["killed"].result(timeout=guard(120))
        for stop in stops:
            _out, err = stop.communicate(timeout=guard(120))
            assert stop.returncode == 0, err
        codes = [int(podman("inspect", "-f", "{{.State.ExitCode}}", c.name).stdout)
                 for c in (documented, default)]
        assert codes == [0, 137], (codes, documented.logs()[-2000:])
        assert "drained for 15 s: 1 job(s) still running are cancelled" in documented.logs()
    finally:
        for event in gates.values():
            event.set()
        for stop in stops:
            if stop.poll() is None:
                stop.kill()
                stop.communicate()
        for container in (documented, default):
            podman("rm", "-f", "-t", "0", container.name, check=False)
            shutil.rmtree(container.sockdir, ignore_errors=True)
