"""Pods as tenants (``access.identity = "kubernetes"``), against the real daemon over its real
socket, with client processes placed in real cgroups named as the kubelet names them (the
cgroupfs and the systemd drivers, on this host's cgroup v1; the guest runs the same on v2)
and the Kubernetes API answered by a small fake (no API server can run here:
``tests/k8s_fake.py``).

Two pods run their clients as the same uid, as pods usually do; each must be a tenant of
its own: its own share (the n+1-th jail is refused ``busy`` naming the pod, the other pod
is not), its own ``ps`` and ``stats``. A deleted pod is refused; a client in no pod is
refused (and served as its uid where so configured); a pid recycled into another pod's
process cannot borrow that pod's identity; nothing a client says in its ``Hello`` changes
whom it is served as. A pod that requests jail slots (``access.slot_resource``) holds that
many jails at once; one that requests none gets the configured share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import DaemonHandle, guard, start_daemon, sweep_cgroups
from tests.k8s_fake import NODE, FakeKubeAPI, make_pod

V2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
# where the kubelet places a container: v1, each of these hierarchies; v2, the one hierarchy
HIERARCHIES = ("",) if V2 else ("memory", "pids", "systemd")


@dataclass(frozen=True)
class Pod:
    uid: str
    name: str
    namespace: str
    driver: str  # cgroupfs or systemd: how the kubelet names its cgroups
    container: str = ""

    @property
    def path(self) -> str:
        """The container's cgroup path, as the kubelet names it (burstable QoS)."""
        if self.driver == "cgroupfs":
            return f"/kubepods/burstable/pod{self.uid}/{self.container}"
        under = self.uid.replace("-", "_")
        return (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{under}.slice"
                f"/cri-containerd-{self.container}.scope")


def new_pod(name: str, driver: str, namespace: str = "agents") -> Pod:
    return Pod(str(uuid.uuid4()), name, namespace, driver, uuid.uuid4().hex * 2)


class Kubelet:
    """Makes pods' container cgroups as the kubelet names them, in each hierarchy the kubelet
    places containers in (v1: memory, pids, name=systemd; v2: the one), and removes them after. No kubelet
    runs here, and this test's own cgroups are not to be left: they go below a top of their
    own inside the test's cgroup of each hierarchy (``<own>/podtest-<random>/kubepods...``,
    as a kubelet's root may be nested)."""

    def __init__(self) -> None:
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _n, controllers, path = line.split(":", 2)
            for c in controllers.split(","):
                own[c.removeprefix("name=")] = path
        top = f"podtest-{uuid.uuid4().hex[:8]}"
        self.tops = [Path(f"/sys/fs/cgroup/{h}{own[h].rstrip('/')}/{top}".replace("//", "/"))
                     for h in HIERARCHIES]

    @property
    def roots(self) -> list[str]:
        """Where this kubelet's hierarchy starts, as the daemon is told
        (``access.kubelet_cgroup_roots``): each top, as a cgroup path."""
        return sorted({"/" + str(top.relative_to(Path("/sys/fs/cgroup", h)))
                       for top, h in zip(self.tops, HIERARCHIES, strict=True)})

    def place(self, pod: Pod, below: str = "") -> None:
        """Make ``pod``'s container cgroups (``below``: under ``<top>/below`` instead of at
        the top -- a subtree of its own, where a forger names them)."""
        for top in self.tops:
            (top / below / pod.path.lstrip("/")).mkdir(parents=True)

    def procs_files(self, pod: Pod, below: str = "") -> list[str]:
        under = f"/{below}" if below else ""
        return [f"{top}{under}{pod.path}/cgroup.procs" for top in self.tops]

    def remove(self) -> None:
        for top in self.tops:
            for root, _dirs, _files in sorted(os.walk(top), key=lambda walked: -len(walked[0])):
                os.rmdir(root)


CLIENT = textwrap.dedent("""
    import json, sys, time
    from jaild.client import Client
    from jaild.errors import JaildError
    def search(q): return [q]
    def send(found): return f"sent {found}"
    TOOLS = [search, send]
    sock, action = sys.argv[1], sys.argv[2]
    out = {}
    try:
        with Client(sock) as c:
            if action == "hold":  # start N sleepers and report, then wait for stdin
                jobs = []
                for _ in range(int(sys.argv[3])):
                    try:
                        jobs.append(c.submit("import time; time.sleep(60)"))
                        out.setdefault("started", 0)
                        out["started"] = out.get("started", 0) + 1
                    except JaildError as exc:
                        out["refused"] = [exc.code, exc.message]
                        break
                out["ps"] = [j.get("pod") for j in c.jobs()]
                out["stats_pods"] = sorted(c.stats().get("pods", {}))
                out["stats_uids"] = sorted(c.stats().get("uids", {}))
                print(json.dumps(out), flush=True)
                sys.stdin.readline()
                for j in jobs:
                    c.kill(j.job_id)
            elif action == "snap":
                with c.session() as s:
                    s.run("x = 41")
                    out["snap"] = s.snapshot()["id"]
            elif action == "restore":
                with c.restore(sys.argv[3]) as s:
                    out["restored"] = s.run("x + 1").result
            elif action == "park":  # a run whose second call waits for approval, then parks
                job = c.submit("tools.send(tools.search('x'))", "durable", tools=TOOLS)
                while not any(a["parked"] for a in c.approvals()):
                    time.sleep(0.05)
                out["parked"] = [job.job_id, c.approvals()[0]["call_id"]]
            elif action == "resume":  # the daemon's word, not the approvals list's
                c.approve(sys.argv[3], int(sys.argv[4]), True, "fine")
                out["resumed"] = c.resume_run(sys.argv[3], TOOLS).result(60).result
            else:
                r = c.run("print(6 * 7)")
                out["run"] = [r.status, r.stdout.strip()]
                out["ps_self"] = [j.get("pod") for j in c.jobs()]
    except JaildError as exc:
        out["error"] = [exc.code, exc.message]
    print(json.dumps(out), flush=True)
""")


def in_pod(kubelet: Kubelet | None, pod: Pod | None, *argv: str, below: str = "") -> list[str]:
    """``argv`` run inside ``pod``'s container cgroup (None: where the test runs)."""
    if pod is None or kubelet is None:
        return list(argv)
    moves = " && ".join(f"echo $$ > {f}" for f in kubelet.procs_files(pod, below))
    return ["sh", "-c", f'{moves} && exec "$@"', "sh", *argv]


def client(kubelet: Kubelet | None, pod: Pod | None, sock: str, action: str,
           *args: str, below: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen(
        in_pod(kubelet, pod, sys.executable, "-c", CLIENT, sock, action, *args, below=below),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=guard(120))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"the client said nothing: {err}"
    return json.loads(lines[-1])  # type: ignore[no-any-return]


@pytest.fixture
def kubelet() -> Iterator[Kubelet]:
    k = Kubelet()
    try:
        yield k
    finally:
        k.remove()


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as fake:
        yield fake


PODS_CONFIG = """
[access]
identity = "kubernetes"
kubernetes_api = "{url}"
kubernetes_token_file = ""
kubernetes_ca_file = ""
node_name = "{node}"
outside_pods = "{outside}"
tenant = "{tenant}"
pod_wait_s = 5
kubelet_cgroup_roots = {roots}
[limits]
max_jobs_per_uid = 2
"""


@pytest.fixture
def pods_daemon(tmp_path: Path, api: FakeKubeAPI, kubelet: Kubelet) -> Iterator[DaemonHandle]:
    handle = daemon_for(tmp_path, api.url, "refuse", kubelet.roots)
    yield handle
    handle.stop()
    sweep_cgroups(handle)


DURABLE = ('[pool]\nmax = 0\n[limits]\nwall_time_s = 900\n[access]\napprove = ["send"]\n'
           '[approvals]\npark_after_s = 0.5\n')
"""Runs whose ``send`` waits for approval, parked half a second after it asks."""


def daemon_for(tmp_path: Path, url: str, outside: str,
               roots: list[str] | None = None, tenant: str = "pod",
               durable: bool = False) -> DaemonHandle:
    path = tmp_path / "jaild.toml"
    path.write_text(PODS_CONFIG.format(url=url, node=NODE, outside=outside, tenant=tenant,
                                       roots=json.dumps(roots or ["/"])))
    policies = {"default": "[limits]\nwall_time_s = 90\n"}
    if durable:
        policies["durable"] = DURABLE
    return start_daemon(tmp_path / "d", policies, with_repo_policies=False,
                        args=("--config", str(path)))


def test_two_pods_of_one_uid_are_two_tenants(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    a = new_pod("agent-a", "cgroupfs")
    b = new_pod("agent-b", "systemd")
    for pod in (a, b):
        api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, service_account="codemode",
                             containers=(pod.container,)))
        kubelet.place(pod)
    holder_a = client(kubelet, a, pods_daemon.socket, "hold", "3")
    try:
        line = holder_a.stdout.readline() if holder_a.stdout else ""
        held = json.loads(line)
        # pod A's share is 2 (limits.max_jobs_per_uid, per principal): the third is refused
        assert held["started"] == 2
        assert held["refused"][0] == "busy"
        assert held["refused"][1].startswith("pod agents/agent-a holds 2 jobs and sessions")
        assert held["ps"] == ["agents/agent-a"] * 2  # its own jobs, named by its pod
        assert held["stats_pods"] in ([], ["agents/agent-a"])  # its own pod's totals only
        assert held["stats_uids"] == []  # root in a pod is not root on the host
        # pod B, the same uid (root) as pod A, still has its whole share ...
        other = result(client(kubelet, b, pods_daemon.socket, "run"))
        assert other["run"] == ["ok", "42"], other
        # ... and sees none of pod A's jobs
        assert other["ps_self"] == []
        # root on the host (in no pod) is refused: this daemon serves pods only
        outside = result(client(None, None, pods_daemon.socket, "run"))
        assert outside["error"][0] == "permission_denied", outside
        assert "is in no pod's cgroup" in outside["error"][1]
    finally:
        if holder_a.stdin:
            holder_a.stdin.write("\n")
            holder_a.stdin.flush()
        holder_a.communicate(timeout=guard(60))


@pytest.mark.parametrize("tenant", ["serviceaccount", "pod"])
def test_a_replacement_pod_reaches_its_predecessors_state_where_accounts_are_tenants(
    tmp_path: Path, api: FakeKubeAPI, kubelet: Kubelet, tenant: str
) -> None:
    """``access.tenant = "serviceaccount"``: a Deployment's replacement pod (another pod, the
    same service account) restores the snapshot its deleted predecessor took, and approves
    and resumes the run it left parked; a pod of another service account does neither. The
    control: with pods as tenants (the default) the replacement is a stranger too."""
    handle = daemon_for(tmp_path, api.url, "refuse", kubelet.roots, tenant=tenant,
                        durable=True)
    try:
        old, new = new_pod("agent-5d8f-x1", "cgroupfs"), new_pod("agent-5d8f-y2", "systemd")
        other = new_pod("agent-other", "cgroupfs")
        for pod, account in ((old, "codemode"), (new, "codemode"), (other, "reporting")):
            api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, service_account=account,
                                 containers=(pod.container,)))
            kubelet.place(pod)
        taken = result(client(kubelet, old, handle.socket, "snap"))
        assert str(taken.get("snap", "")).startswith("snap-"), taken
        left = result(client(kubelet, old, handle.socket, "park"))
        assert "parked" in left, left
        api.delete_pod(old.uid)  # the rollout replaces it
        snap, (run, call) = str(taken["snap"]), left["parked"]  # type: ignore[misc]
        stranger = result(client(kubelet, other, handle.socket, "restore", snap))
        assert stranger["error"][0] == "unknown_snapshot", stranger
        stranger = result(client(kubelet, other, handle.socket, "resume", run, str(call)))
        assert stranger["error"][0] == "unknown_job", stranger
        restored = result(client(kubelet, new, handle.socket, "restore", snap))
        resumed = result(client(kubelet, new, handle.socket, "resume", run, str(call)))
        if tenant == "serviceaccount":
            assert restored["restored"] == 42, restored
            assert resumed["resumed"] == "sent ['x']", resumed
        else:
            assert restored["error"][0] == "unknown_snapshot", restored
            assert resumed["error"][0] == "unknown_job", resumed
    finally:
        handle.stop()
        sweep_cgroups(handle)


def test_a_deleted_pod_is_refused_and_a_known_one_served(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    pod = new_pod("agent-gone", "cgroupfs")
    api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, containers=(pod.container,)))
    kubelet.place(pod)
    served = result(client(kubelet, pod, pods_daemon.socket, "run"))
    assert served["run"] == ["ok", "42"], served  # the control: the same pod, known
    api.delete_pod(pod.uid)
    deadline = time.monotonic() + guard(30)
    while True:
        refused = result(client(kubelet, pod, pods_daemon.socket, "run"))
        if "error" in refused or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # the watch brings the deletion: a liveness wait, not an assertion
    assert refused["error"][0] == "permission_denied", refused
    assert f"its pod {pod.uid} is deleted or terminating" in refused["error"][1]
    unknown = new_pod("agent-never", "systemd")  # in a pod cgroup the API has never heard of
    kubelet.place(unknown)
    never = result(client(kubelet, unknown, pods_daemon.socket, "run"))
    assert never["error"][0] == "permission_denied", never
    assert f"its pod {unknown.uid} is unknown to the Kubernetes API" in never["error"][1]


def test_a_client_outside_pods_is_served_as_its_uid_where_configured(
    tmp_path: Path, api: FakeKubeAPI
) -> None:
    handle = daemon_for(tmp_path, api.url, "uid")
    try:
        outside = result(client(None, None, handle.socket, "run"))
        assert outside["run"] == ["ok", "42"], outside
        assert outside["ps_self"] == []
    finally:
        handle.stop()
        sweep_cgroups(handle)


RECYCLER = textwrap.dedent("""
    import json, os, socket, sys, time
    sock_path = sys.argv[1]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    child = os.fork()
    if child == 0:  # the child connects (SO_PEERCRED names it), then exits at once
        s.connect(sock_path)
        os._exit(0)
    os.waitpid(child, 0)
    print(json.dumps({"connected_by": child}), flush=True)
    sys.stdin.readline()  # the test recycles the pid, then lets the daemon run
    s.settimeout(30)
    from jaild.protocol import encode_frame
    from jaild.protocol.messages import Hello, PROTOCOL_VERSION, encode
    try:
        s.sendall(encode_frame(encode(Hello(protocol=PROTOCOL_VERSION, client="x")), 1 << 16))
    except BrokenPipeError:  # refused before its Hello: the answer is already queued here
        pass
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        more = s.recv(65536)
        if not more:
            break
        data += more
    print(json.dumps({"answer": data[4:].decode(errors="replace")}), flush=True)
""")

SQUATTER = "import sys; sys.stdin.readline()"


def spawn_at(pid: int, argv: list[str]) -> subprocess.Popen[str]:
    """A process that gets exactly ``pid`` (``ns_last_pid``): bounded tries, each a fork."""
    for _ in range(200):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, text=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.communicate()
    raise AssertionError(f"could not get pid {pid} for the squatter in 200 tries")


def test_a_recycled_pid_cannot_borrow_another_pods_identity(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    """A process of pod A connects and exits; its pid goes to a process of pod B before the
    daemon gets to the connection (the daemon is stopped meanwhile). The daemon must not
    serve pod A's leftover connection as pod B -- the control is pod B's own client, which
    is served."""
    a, b = new_pod("attacker", "cgroupfs"), new_pod("victim", "systemd")
    for pod in (a, b):
        api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, containers=(pod.container,)))
        kubelet.place(pod)
    victim = result(client(kubelet, b, pods_daemon.socket, "run"))
    assert victim["run"] == ["ok", "42"], victim  # the control
    os.kill(pods_daemon.proc.pid, signal.SIGSTOP)
    try:
        attacker = subprocess.Popen(
            in_pod(kubelet, a, sys.executable, "-c", RECYCLER, pods_daemon.socket),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert attacker.stdout is not None and attacker.stdin is not None
        gone = json.loads(attacker.stdout.readline())["connected_by"]
        squatter = spawn_at(gone, in_pod(kubelet, b, sys.executable, "-c", SQUATTER))
    finally:
        os.kill(pods_daemon.proc.pid, signal.SIGCONT)
    try:
        attacker.stdin.write("\n")
        attacker.stdin.flush()
        answer = json.loads(attacker.stdout.readline())["answer"]
        assert "permission_denied" in answer and "cannot verify the connecting process" in answer
        assert "victim" not in answer
    finally:
        squatter.communicate("\n", timeout=guard(30))
        attacker.communicate(timeout=guard(30))


def test_a_forged_hello_changes_nothing(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    """The Hello's free-text client name is the only thing a client says of itself: claim
    another pod, or root, in it, and the jobs are still the client's own pod's."""
    pod = new_pod("honest", "cgroupfs")
    api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, containers=(pod.container,)))
    kubelet.place(pod)
    code = textwrap.dedent("""
        import json, sys
        from jaild.client import Client
        with Client(sys.argv[1], name="pod kube-system/admin uid=0 root") as cl:
            job = cl.submit("import time; time.sleep(30)")
            print(json.dumps([j.get("pod") for j in cl.jobs()]), flush=True)
            cl.kill(job.job_id)
    """)
    proc = subprocess.run(in_pod(kubelet, pod, sys.executable, "-c", code, pods_daemon.socket),
                          capture_output=True, text=True, timeout=guard(120), check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == ["agents/honest"]


def test_a_pods_cgroup_names_forged_in_a_subtree_are_refused(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    """Issue 43's forgery: a process that can make cgroups of its own (here: a subtree
    beside the kubelet's root, as a delegated ``user@UID.service`` is) names one exactly as
    the kubelet names the victim pod's container, moves in and connects. The kubelet's root
    is anchored (``access.kubelet_cgroup_roots``): refused, naming it -- while the victim,
    in its real cgroup, is served as itself (the control)."""
    victim = new_pod("victim", "cgroupfs")
    api.add_pod(make_pod(victim.uid, victim.name, victim.namespace,
                         containers=(victim.container,)))
    kubelet.place(victim)
    served = result(client(kubelet, victim, pods_daemon.socket, "run"))
    assert served["run"] == ["ok", "42"], served
    assert served["ps_self"] == [], served  # its own run is over
    forged = Pod(victim.uid, victim.name, victim.namespace, "cgroupfs",
                 uuid.uuid4().hex * 2)  # the victim's pod uid, a container of the forger's
    for driver in ("cgroupfs", "systemd"):
        fake = Pod(forged.uid, forged.name, forged.namespace, driver, forged.container)
        kubelet.place(fake, below=f"mine-{driver}")
        refused = result(client(kubelet, fake, pods_daemon.socket, "run",
                                below=f"mine-{driver}"))
        assert refused["error"][0] == "permission_denied", refused
        assert "outside the kubelet's cgroup root" in refused["error"][1], refused


def test_a_container_the_api_does_not_report_is_refused(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    """A container cgroup in a real pod's cgroup, at the kubelet's root, that the pod's
    status does not list (made by a process with rights over the kubelet's hierarchy, not by
    the runtime) is refused after access.pod_wait_s, naming it; the pod's own container is
    served (the control)."""
    pod = new_pod("listed", "systemd")
    api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, containers=(pod.container,)))
    kubelet.place(pod)
    served = result(client(kubelet, pod, pods_daemon.socket, "run"))
    assert served["run"] == ["ok", "42"], served
    stray = Pod(pod.uid, pod.name, pod.namespace, "systemd", uuid.uuid4().hex * 2)
    kubelet.place(stray)
    refused = result(client(kubelet, stray, pods_daemon.socket, "run"))
    assert refused["error"][0] == "permission_denied", refused
    assert "does not report as one of that pod's containers" in refused["error"][1], refused


def release(*holders: subprocess.Popen[str]) -> None:
    """Let holders (``client(..., "hold", N)``) kill their jobs and exit."""
    for holder in holders:
        if holder.stdin:
            holder.stdin.write("\n")
            holder.stdin.flush()
    for holder in holders:
        holder.communicate(timeout=guard(60))


def held_now(holder: subprocess.Popen[str]) -> dict[str, object]:
    """What a holder started and was refused, once it has tried them all."""
    line = holder.stdout.readline() if holder.stdout else ""
    assert line, holder.stderr.read() if holder.stderr else "no output"
    return json.loads(line)  # type: ignore[no-any-return]


def test_a_pod_over_its_slot_request_is_refused_busy_naming_it(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    """A pod that requests 1 jaild.dev/slots (the extended resource a device plugin
    advertises; access.slot_resource's default) holds one jail at a time: its second
    concurrent job is refused busy naming the request. The control: a pod of the same uid
    that requests none, beside it, runs two at once (limits.max_jobs_per_uid = 2, the
    daemon's config). And a pod that requests 3 holds 3: its request takes the place of
    that share."""
    one = new_pod("agent-one-slot", "cgroupfs")
    plain = new_pod("agent-no-request", "systemd")
    three = new_pod("agent-three-slots", "cgroupfs")
    for pod, slots in ((one, 1), (plain, 0), (three, 3)):
        api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, containers=(pod.container,),
                             slots=slots))
        kubelet.place(pod)
    holders = []
    try:
        holders.append(client(kubelet, one, pods_daemon.socket, "hold", "2"))
        held = held_now(holders[-1])
        assert held["started"] == 1, held
        assert held["refused"] == [
            "busy", "pod agents/agent-one-slot holds 1 jobs and sessions, its request "
            "jaild.dev/slots: 1; retry when one ends, or request more"], held
        # the control: no request, the configured share (2), while the first pod holds its one
        holders.append(client(kubelet, plain, pods_daemon.socket, "hold", "2"))
        held = held_now(holders[-1])
        assert held["started"] == 2 and "refused" not in held, held
        holders.append(client(kubelet, three, pods_daemon.socket, "hold", "3"))
        held = held_now(holders[-1])
        assert held["started"] == 3 and "refused" not in held, held
    finally:
        release(*holders)


def test_a_pods_client_in_a_network_namespace_of_its_own_is_served(
    pods_daemon: DaemonHandle, api: FakeKubeAPI, kubelet: Kubelet
) -> None:
    """Every pod has a network namespace of its own, and the kernel makes the daemon's end of
    a pod's connection in it: the daemon must ask unix_diag about it from there. Before it
    did, such a client was refused ("unix_diag refused the lookup: No such file or
    directory"), which the image under podman showed (test_pods_container.py); the other
    tests here, clients in the daemon's own namespace, are the control."""
    pod = new_pod("own-netns", "systemd")
    api.add_pod(make_pod(pod.uid, pod.name, pod.namespace, containers=(pod.container,)))
    kubelet.place(pod)
    proc = subprocess.Popen(
        in_pod(kubelet, pod, "unshare", "--net", sys.executable, "-c", CLIENT,
               pods_daemon.socket, "run"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    served = result(proc)
    assert served.get("run") == ["ok", "42"], served
