"""jaild.daemon.identity on the real kernel: a connecting process's cgroup read over a real
AF_UNIX connection (live, exited, a zombie, a recycled pid: both with SO_PEERPIDFD and with
pidfd_open as on kernels before 6.5), and real cgroups named as the kubelet names them.

The cgroup tests need root (they make cgroups and move processes) and, like the recycled
pid (written to /proc/sys/kernel/ns_last_pid), are skipped without it. Their cgroups go
under this process's own cgroup of each hierarchy (where jaild puts its own), below a top
named for this run: ``<own>/idtest-<pid>-<random>/kubepods...``, removed depth-first when
the test ends, whatever happened. Nothing else is touched."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaild.daemon import identity
from jaild.daemon.identity import (
    PeerUnverified,
    PodRef,
    in_kubepods,
    peer_cgroup,
    peer_inode,
    pod_of_cgroup,
)
from tests.conftest import guard, until

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="makes cgroups and sets ns_last_pid: root")
PEERPIDFD = [pytest.param(True, id="SO_PEERPIDFD"), pytest.param(False, id="pidfd_open")]

# A client: waits for a line (time to be moved into its cgroups), connects, says so, then
# holds the connection until its stdin closes.
CLIENT = """
import socket, sys
sys.stdin.readline()
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
print("connected", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[socket.socket]:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "jaild.sock"))
        s.listen(8)
        yield s


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Children to kill and reap at the end, whatever happened."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(guard(10))
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()


def client(listener: socket.socket, procs: list[subprocess.Popen[str]],
           before: Callable[[int], None] = lambda pid: None) -> subprocess.Popen[str]:
    """A live client process, connected to ``listener`` (``before(pid)`` runs first)."""
    p = subprocess.Popen([sys.executable, "-c", CLIENT, listener.getsockname()],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(p)
    before(p.pid)
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline() == "connected\n"
    return p


def accept(listener: socket.socket) -> socket.socket:
    listener.settimeout(guard(10))
    conn, _ = listener.accept()
    return conn


def peer_pid(conn: socket.socket) -> int:
    pid: int = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    return pid


def connect_and_exit(listener: socket.socket, sock: socket.socket | None = None) -> int:
    """A child that connects (``sock``, the parent's, if given: the parent keeps holding
    the client end) and exits; reaped. Its pid."""
    args: list[str] = [listener.getsockname()]
    fds: list[int] = []
    if sock is None:
        code = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
    else:
        code = ("import socket, sys; s = socket.socket(fileno=int(sys.argv[2])); "
                "s.connect(sys.argv[1])")
        args.append(str(sock.fileno()))
        fds.append(sock.fileno())
    with subprocess.Popen([sys.executable, "-c", code, *args], pass_fds=fds) as p:
        assert p.wait(guard(30)) == 0
    return p.pid


def _peerpidfd_supported() -> bool:
    a, b = socket.socketpair()
    with a, b:
        try:
            os.close(a.getsockopt(socket.SOL_SOCKET, 77))
        except OSError as e:
            assert e.errno == errno.ENOPROTOOPT
            return False
    return True


# --- the peer's cgroup ------------------------------------------------------------------

@pytest.mark.parametrize("peerpidfd", PEERPIDFD)
def test_a_live_client_is_verified(listener: socket.socket, processes: list[subprocess.Popen[str]],
                                   peerpidfd: bool) -> None:
    p = client(listener, processes)
    with accept(listener) as conn:
        assert peer_pid(conn) == p.pid
        text = peer_cgroup(conn, p.pid, peerpidfd=peerpidfd)
        assert text == Path(f"/proc/{p.pid}/cgroup").read_text()
        # what the holder check looks for: the client's socket, among its fds
        links = {os.readlink(f) for f in Path(f"/proc/{p.pid}/fd").iterdir()}
        assert f"socket:[{peer_inode(conn)}]" in links


@pytest.mark.parametrize("peerpidfd", PEERPIDFD)
def test_a_client_that_exited_is_refused(listener: socket.socket, peerpidfd: bool) -> None:
    pid = connect_and_exit(listener)  # connected and reaped before the accept
    with accept(listener) as conn:
        assert peer_pid(conn) == pid
        with pytest.raises(PeerUnverified) as refused:
            peer_cgroup(conn, pid, peerpidfd=peerpidfd)
        assert refused.value.reason == f"the connecting process (pid {pid}) has exited"


@pytest.mark.parametrize("peerpidfd", PEERPIDFD)
def test_a_zombie_is_refused(listener: socket.socket, processes: list[subprocess.Popen[str]],
                             peerpidfd: bool) -> None:
    p = client(listener, processes)
    assert p.stdin is not None
    p.stdin.close()  # it exits, not reaped: a zombie, its fds closed
    until(lambda: Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
          "the zombie", 30)
    with accept(listener) as conn, pytest.raises(PeerUnverified) as refused:
        peer_cgroup(conn, p.pid, peerpidfd=peerpidfd)
    assert refused.value.reason == f"the connecting process (pid {p.pid}) has exited"


def test_a_client_that_closed_its_end_is_refused(
        listener: socket.socket, processes: list[subprocess.Popen[str]]) -> None:
    """Alive, but no longer holding the connection (closed, or handed to another process)."""
    code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "s.close(); print('closed', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, listener.getsockname()],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    processes.append(p)
    assert p.stdout is not None and p.stdout.readline() == "closed\n"
    with accept(listener) as conn:
        for peerpidfd in (True, False):
            with pytest.raises(PeerUnverified) as refused:
                peer_cgroup(conn, p.pid, peerpidfd=peerpidfd)
            assert refused.value.reason == (f"pid {p.pid} does not hold this connection "
                                            "(its client end is closed)")


def test_pid_zero_is_refused(listener: socket.socket) -> None:
    """SO_PEERCRED says 0 for a process outside our pid namespace."""
    with socket.socket(socket.AF_UNIX) as c:
        c.connect(listener.getsockname())
        with accept(listener) as conn, pytest.raises(PeerUnverified, match="pid namespace"):
            peer_cgroup(conn, 0)


def take_pid(pid: int, procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """A new process with pid ``pid`` (free): ns_last_pid set to pid - 1, then a fork --
    again while another process on the machine forks in between. Bounded."""
    for _ in range(200):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, text=True)
        procs.append(p)
        if p.pid == pid:
            return p
        p.kill()
    pytest.fail(f"could not get pid {pid} again in 200 forks")


@needs_root
def test_a_recycled_pid_is_refused(listener: socket.socket,
                                   processes: list[subprocess.Popen[str]]) -> None:
    """The client connects and exits; a new process gets its pid. The client end is still
    held (by this test), so only the pid can lie. With SO_PEERPIDFD the pidfd is the exited
    client's; with pidfd_open (kernels before 6.5) it is the new process's, which does not
    hold the connection."""
    with socket.socket(socket.AF_UNIX) as held:
        pid = connect_and_exit(listener, held)
        with accept(listener) as conn:
            assert peer_pid(conn) == pid
            impostor = take_pid(pid, processes)
            assert impostor.pid == pid and impostor.poll() is None  # the setup worked
            for peerpidfd, reason in (
                (True, f"the connecting process (pid {pid}) has exited"),
                (False, f"pid {pid} does not hold this connection (a recycled pid?)"),
            ):
                if peerpidfd and not _peerpidfd_supported():
                    continue
                with pytest.raises(PeerUnverified) as refused:
                    peer_cgroup(conn, pid, peerpidfd=peerpidfd)
                assert refused.value.reason == reason
    # the positive control: the same probe, on the same listener, passes a live client
    p = client(listener, processes)
    with accept(listener) as conn:
        for peerpidfd in (True, False):
            assert peer_cgroup(conn, p.pid, peerpidfd=peerpidfd) == \
                Path(f"/proc/{p.pid}/cgroup").read_text()


# --- real cgroups named as the kubelet names them ---------------------------------------

UID = "2c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5f"
UID2 = "7d3e2f10-0b1c-4d5e-8f90-a1b2c3d4e5f6"
CID = secrets.token_hex(32)
CGROUPFS = f"kubepods/burstable/pod{UID}/{CID}"
SYSTEMD = (f"kubepods.slice/kubepods-burstable.slice/"
           f"kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope")
# the hierarchies a kubelet and its runtime place containers in (v1 mounts on this host's
# kind of layout; "unified": the v2 hierarchy of a hybrid host, if mounted)
HIERARCHIES = {"memory": "memory", "pids": "pids", "systemd": "name=systemd", "unified": ""}


def _own(controller: str) -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if (controller == "" and hid == "0" and controllers == "") or (
                controller and controller in controllers.split(",")):
            return path
    return None


class KubeCgroups:
    """Cgroups made for one test under a top of its own in each hierarchy; removed at the
    end (depth-first, after the test's processes are gone)."""

    def __init__(self) -> None:
        self.tops: dict[str, Path] = {}
        name = f"idtest-{os.getpid()}-{secrets.token_hex(4)}"
        for mount, controller in HIERARCHIES.items():
            own = _own(controller)
            root = Path("/sys/fs/cgroup", mount)
            if own is None or not (root / "cgroup.procs").exists():
                continue
            top = root / own.lstrip("/") / name
            assert not top.exists(), f"{top} exists: not ours, refusing to reuse it"
            top.mkdir()
            self.tops[mount] = top
        assert "memory" in self.tops and "pids" in self.tops, "no v1 memory and pids here"

    def place(self, pid: int, path: str, mounts: tuple[str, ...] | None = None) -> None:
        """Make ``<top>/path`` in each of ``mounts`` (all by default) and move ``pid`` in."""
        for mount in mounts or tuple(self.tops):
            d = self.tops[mount] / path
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup.procs").write_text(str(pid))

    @property
    def roots(self) -> tuple[str, ...]:
        """Where these tests' kubelet hierarchy starts, in each hierarchy (configured, as a
        nested kubelet's root is: access.kubelet_cgroup_roots)."""
        return tuple(sorted({self.path_of(m, "x").removesuffix("/x") for m in self.tops}))

    def path_of(self, mount: str, path: str) -> str:
        """What /proc/<pid>/cgroup shows for ``<top>/path``."""
        return "/" + str((self.tops[mount] / path).relative_to(f"/sys/fs/cgroup/{mount}"))

    def remove(self) -> None:
        problems = []
        for top in self.tops.values():
            for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):  # depth-first
                def gone(d: str = d) -> bool:
                    try:
                        os.rmdir(d)
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        if e.errno != errno.EBUSY:
                            raise
                        return False  # a process not yet reaped in the kernel's eyes
                    return True
                with contextlib.suppress(AssertionError):
                    until(gone, f"removing {d}", 10)
                if os.path.exists(d):
                    problems.append(d)
        assert not problems, f"cgroups left behind: {problems}"


@pytest.fixture
def kube_cgroups(processes: list[subprocess.Popen[str]]) -> Iterator[KubeCgroups]:
    if not ROOT:
        pytest.skip("makes cgroups: root")
    cgroups = KubeCgroups()
    try:
        yield cgroups
    finally:
        for p in processes:  # out of the cgroups first (the processes fixture reaps too)
            if p.poll() is None:
                p.kill()
            p.wait(guard(10))
        cgroups.remove()


@pytest.mark.parametrize(("path", "expected"), [
    (CGROUPFS, PodRef(UID, CID, "burstable", "cgroupfs")),
    (SYSTEMD, PodRef(UID, CID, "burstable", "systemd")),
    (f"kubepods/pod{UID}/{CID}/sub", PodRef(UID, CID, "guaranteed", "cgroupfs")),
], ids=["cgroupfs", "systemd", "below-the-container"])
def test_a_client_in_a_pods_cgroups(kube_cgroups: KubeCgroups, listener: socket.socket,
                                    processes: list[subprocess.Popen[str]],
                                    path: str, expected: PodRef) -> None:
    p = client(listener, processes, lambda pid: kube_cgroups.place(pid, path))
    text = Path(f"/proc/{p.pid}/cgroup").read_text()
    assert f":memory:{kube_cgroups.path_of('memory', path)}\n" in text  # the setup worked
    assert pod_of_cgroup(text, kube_cgroups.roots) == expected
    with accept(listener) as conn:
        for peerpidfd in (True, False):
            text = peer_cgroup(conn, p.pid, peerpidfd=peerpidfd)
            assert pod_of_cgroup(text, kube_cgroups.roots) == expected


def test_only_the_memory_hierarchy(kube_cgroups: KubeCgroups, listener: socket.socket,
                                   processes: list[subprocess.Popen[str]]) -> None:
    """A runtime that placed the container in one hierarchy only: that line suffices."""
    p = client(listener, processes,
               lambda pid: kube_cgroups.place(pid, f"kubepods/besteffort/pod{UID}/{CID}",
                                              ("memory",)))
    with accept(listener) as conn:
        text = peer_cgroup(conn, p.pid)
    assert pod_of_cgroup(text, kube_cgroups.roots) == PodRef(UID, CID, "besteffort",
                                                             "cgroupfs")


def test_hierarchies_that_disagree(kube_cgroups: KubeCgroups, listener: socket.socket,
                                   processes: list[subprocess.Popen[str]]) -> None:
    def place(pid: int) -> None:
        kube_cgroups.place(pid, f"kubepods/burstable/pod{UID}/{CID}", ("memory",))
        kube_cgroups.place(pid, f"kubepods/burstable/pod{UID2}/{CID}", ("pids",))

    p = client(listener, processes, place)
    with accept(listener) as conn:
        text = peer_cgroup(conn, p.pid)
    # refused, not a host process
    assert pod_of_cgroup(text, kube_cgroups.roots) is None and in_kubepods(text)


def test_a_host_process(listener: socket.socket, processes: list[subprocess.Popen[str]]) -> None:
    p = client(listener, processes)
    with accept(listener) as conn:
        text = peer_cgroup(conn, p.pid)
    assert pod_of_cgroup(text) is None and not in_kubepods(text)


def test_the_descriptor_scan_is_bounded(listener: socket.socket,
                                        processes: list[subprocess.Popen[str]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client holding more descriptors than the scan looks through is refused, naming the
    bound, instead of holding the daemon's loop while each is read; the same client under a
    bound above its count is verified (the control)."""
    p = client(listener, processes, lambda pid: None)
    with accept(listener) as conn:
        held = len(os.listdir(f"/proc/{p.pid}/fd"))
        assert peer_cgroup(conn, p.pid)  # the control: found within the default bound
        monkeypatch.setattr(identity, "MAX_PEER_FDS", held - 1)
        with pytest.raises(PeerUnverified, match=f"more than {held - 1} descriptors"):
            peer_cgroup(conn, p.pid)


def test_a_pods_names_in_a_subtree_of_ones_own_are_not_the_pod(
        kube_cgroups: KubeCgroups, listener: socket.socket,
        processes: list[subprocess.Popen[str]]) -> None:
    """The forgery of issue 43: a process that can make cgroups of its own names one as the
    kubelet names the victim's container, below its own subtree, and moves in. Read with the
    kubelet's root configured, it names no pod (and is in a kubepods cgroup: refused, not
    taken for a host process); the real pod, at the root, is the pod (the control)."""
    forged = f"mine/kubepods/burstable/pod{UID}/{CID}"
    cid2 = secrets.token_hex(32)
    real = f"kubepods/burstable/pod{UID}/{cid2}"
    attacker = client(listener, processes, lambda pid: kube_cgroups.place(pid, forged))
    victim = client(listener, processes, lambda pid: kube_cgroups.place(pid, real))
    with accept(listener) as first, accept(listener) as second:
        texts = {peer_pid(c): peer_cgroup(c, peer_pid(c)) for c in (first, second)}
    assert pod_of_cgroup(texts[attacker.pid], kube_cgroups.roots) is None
    assert in_kubepods(texts[attacker.pid])
    assert pod_of_cgroup(texts[victim.pid], kube_cgroups.roots) == PodRef(
        UID, cid2, "burstable", "cgroupfs")
