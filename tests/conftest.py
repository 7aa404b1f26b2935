"""Shared fixtures: real daemons on real sockets, starting real nsjail jails.

Integration tests need root (nsjail's cgroups and uid maps) and the jail
environment built by ``make test``. Without them they *fail* with a message
that says what is missing -- they never skip on a machine that can run them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis  # noqa: F401 -- imported early on purpose, see below
import pytest

from jaild.client import Client, JobResult
from jaild.daemon.config import DaemonConfig, default_state_dir

# CPython 3.11.2 (Debian 12's) keeps the AST constructor's recursion depth in global state
# that a garbage-collector finaliser can unbalance (gh-106905, fixed in 3.11.5). pytest
# imports hypothesis's plugin module at the *end* of a session, and parsing it then can
# fail with "AST constructor recursion depth mismatch". Importing it first avoids that.
from jaild.daemon.jails.cgroups import Cgroups, daemon_subtree_dirs, detect
from jaild.daemon.uidblock import flock_holders, lock_path
from jaild.errors import JaildError
from jaild.policy.compile import CgroupLayout
from jaild.protocol import (
    NEED_DATA,
    PROTOCOL_VERSION,
    Connection,
    Role,
    encode,
    encode_frame,
)
from jaild.protocol.messages import Hello, Message, Welcome
from jaild.testing import copy_modules

REPO = Path(__file__).resolve().parent.parent
REPO_POLICIES = REPO / "policies"
TEST_POLICIES = Path(__file__).resolve().parent / "policies"
STATE_DIR = default_state_dir()


def require_jail_host() -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("run as root (nsjail needs to create cgroups and uid maps)")
    if not os.path.exists(os.path.join(STATE_DIR, "envs", "default", "bin", "python3")):
        problems.append(f"build the jail environment first: make jail-env (missing {STATE_DIR}/envs/default)")
    if problems:
        pytest.fail("integration tests cannot run here: " + "; ".join(problems), pytrace=False)


@dataclass
class DaemonHandle:
    """A ``jaild serve`` subprocess on its own socket."""

    socket: str
    policies_dir: str
    proc: subprocess.Popen[bytes]
    log_path: str
    config: DaemonConfig = field(init=False)

    layout: CgroupLayout = field(init=False)
    _subtree_dirs: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.config = DaemonConfig(socket_path=self.socket, policies_dir=self.policies_dir,
                                   state_dir=STATE_DIR)
        self.layout = detect(self.config.subtree)

    @property
    def subtree_dirs(self) -> list[str]:
        """Where this daemon keeps its job cgroups: each v1 hierarchy's ``<subtree>``, or on
        v2 the one inside the cgroup the daemon placed itself in (read from /proc while it
        serves, and remembered, so a test can look there after killing it)."""
        if not self._subtree_dirs:
            self._subtree_dirs = daemon_subtree_dirs(self.proc.pid, self.layout)
        return self._subtree_dirs

    @property
    def job_root(self) -> Path:
        """The directory holding the daemon's job cgroups (v1: the memory hierarchy's)."""
        return self.cgroup_dir("x").parent

    @property
    def placed(self) -> bool:
        """Has :attr:`subtree_dirs` been learned (while the daemon ran)?"""
        return bool(self._subtree_dirs)

    def cgroup_dir(self, ident: str) -> Path:
        """The cgroup of job, session or zygote ``ident`` (v1: in the memory hierarchy)."""
        if self.layout.version == 1:
            return Path(self.layout.v1_base("memory")) / self.config.subtree / ident
        return Path(self.subtree_dirs[0]) / ident

    def measures(self, counter: str) -> bool:
        """Does this kernel keep ``counter`` (``memory.peak``, ``pids.peak``) for job cgroups?
        A usage field the kernel cannot measure must be null (``memory.peak`` arrived in 5.19
        on v2; v1 has ``memory.max_usage_in_bytes`` everywhere)."""
        if self.layout.version == 1:
            if counter == "memory.peak":
                return True
            return (Path(self.layout.v1_base("pids")) / self.config.subtree / counter).exists()
        return (Path(self.subtree_dirs[0]) / counter).exists()

    def cgroups(self) -> Cgroups:
        """The daemon's subtree, as the daemon sees it (to sweep what it left)."""
        layout = self.layout
        if layout.version == 2:
            layout = dataclasses.replace(layout, v2_root=os.path.dirname(self.subtree_dirs[0]))
        return Cgroups(layout)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def client(self) -> Client:
        return Client(self.socket)

    def run(self, code: str, policy: str = "default", **kwargs: object) -> JobResult:
        with Client(self.socket) as c:
            return c.run(code, policy, **kwargs)  # type: ignore[arg-type]

    def assert_serving(self) -> None:
        """The daemon still runs a trivial job correctly."""
        r = self.run("6 * 7")
        assert r.status == "ok", (r.status, r.error, self.log()[-2000:])
        assert r.result == 42

    def audited(self, job_id: str) -> dict[str, str] | None:
        """The fields of the daemon's audit line for a job that ended (its log), if any."""
        for line in self.log().splitlines():
            if "audit: event=job " in line and f" job={job_id} " in line:
                text = line.split("audit: ", 1)[1]
                return {k: json.loads(v) if v.startswith('"') else v
                        for k, v in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', text)}
        return None

    def job_pids(self, job_id: str) -> list[int]:
        """Host pids in a job's cgroup (and its nsjail's below it): the job's processes."""
        root = self.cgroup_dir(job_id)
        pids: set[int] = set()
        for directory, _, files in os.walk(root):  # the cgroup may go while we walk it
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
        return sorted(pids)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=guard(timeout))


HELLO = encode_frame(encode(Hello(protocol=PROTOCOL_VERSION, client="wait")), 1 << 16)


# Liveness guards (never speed claims) stretched on a host known to be slow: the real-host
class ImageBuild:
    """``make image``'s build (image/build.py), for the tests marked ``container``.

    Started when collection ends, beside the tests before them (the container tests run last:
    ``pytest_collection_modifyitems``), so a cold build -- about four minutes of mmdebstrap,
    a wheelhouse and podman's load, mostly downloads and unpacking -- is off ``make test``'s
    path. Its own mount namespace keeps what it mounts (the chroots' /proc, podman's storage)
    out of the host's mount table, which the hostile suite checks. An unchanged build reuses
    its cache (/var/cache/jaild-image) in about a second; a build already running (another
    clone's) holds the cache's lock, and this one waits for it and reuses what it made.

    With ``JAILD_TEST_IMAGE_ARCHIVE`` set, the image is that archive (``make image``'s
    build/jaild-image.oci.tar, built elsewhere: the real-host harness's guests get the host's),
    loaded into podman as ``localhost/jaild:latest`` instead of built.
    """

    proc: subprocess.Popen[bytes] | None = None
    log = REPO / "build" / "image-build.log"

    @classmethod
    def start(cls) -> None:
        archive = os.environ.get("JAILD_TEST_IMAGE_ARCHIVE")
        argv = ([sys.executable, str(REPO / "image" / "build.py")] if not archive else
                ["skopeo", "copy", "--quiet", f"oci-archive:{archive}",
                 "containers-storage:localhost/jaild:latest"])
        cls.log.parent.mkdir(exist_ok=True)
        with cls.log.open("wb") as out:
            cls.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", *argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    @classmethod
    def wait(cls) -> None:
        """Wait for the build; fail with its log if it failed."""
        assert cls.proc is not None, "the image build was not started (collection ends it)"
        try:
            code = cls.proc.wait(timeout=guard(1200))
        except subprocess.TimeoutExpired:
            code = None
        log = cls.log.read_text(errors="replace")[-4000:]
        assert code == 0, f"make image (image/build.py) {'hung' if code is None else f'exit {code}'}:\n{log}"

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            os.killpg(cls.proc.pid, signal.SIGTERM)
            cls.proc.wait()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The container tests last: the image they run is built beside the tests before them."""
    items.sort(key=lambda item: item.get_closest_marker("container") is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("container") for item in session.items):
        ImageBuild.start()


def pytest_sessionfinish() -> None:
    ImageBuild.stop()  # a run cut short does not leave the build behind


# harness sets this for guests under TCG, where everything runs ~10x slower. 1 elsewhere.
TIME_SCALE = float(os.environ.get("JAILD_TEST_TIME_SCALE", "1"))


def guard(seconds: float) -> float:
    """A liveness guard's length here: how long to wait before calling a hang a hang. Never
    use it for a limit under test (a job's deadline that must expire, a tool's timeout)."""
    return seconds * TIME_SCALE


def until(condition: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Wait for ``condition()`` to hold; ``timeout`` is a liveness guard only."""
    deadline = time.monotonic() + guard(timeout)
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {guard(timeout)} s"
        time.sleep(0.02)


# In a jail: its uid on the host, from its user namespace's map (an expression; needs os)
HOST_UID = ("[int(o) + os.getuid() - int(i) for i, o, n in "
            "(line.split() for line in open('/proc/self/uid_map')) "
            "if int(i) <= os.getuid() < int(i) + int(n)][0]")


def wait_for_zygote(client: Client, policy: str) -> None:
    """Wait until ``policy``'s jobs of this client are forked from its zygote. A job that
    finds no ready zygote (none yet, or one retired after ``limits.zygote_idle_s``) is
    spawned as a full nsjail while the zygote starts. A forked jail's uid inside is its uid
    on the host (the zygote's map is the identity for jail uids); a spawned jail is 65534
    inside."""

    def forked() -> bool:
        r = client.run(f"import os\nos.getuid() == {HOST_UID}", policy=policy)
        assert r.status == "ok", (r.status, r.error)
        return bool(r.result)

    until(forked, f"a job of policy {policy} forked from its zygote")


def welcome(path: str, timeout: float) -> Message | None:
    """The daemon's answer to a Hello on ``path`` (its Welcome, or the Error refusing us);
    None if nothing (yet) answers there."""
    conn = Connection(Role.CLIENT, 1 << 16)
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.settimeout(max(0.1, timeout))
            s.connect(path)
            s.sendall(conn.send(Hello(protocol=PROTOCOL_VERSION, client="wait")))
            while True:
                event = conn.next_event()
                if isinstance(event, Message):
                    return event
                if event is not NEED_DATA:
                    return None
                data = s.recv(1 << 16)
                conn.receive_data(data)
                if not data:
                    return None
        except (OSError, JaildError):
            return None


def wait_listening(path: str, proc: subprocess.Popen[bytes], log_path: str,
                   timeout: float = 60) -> None:
    """Wait until the daemon *serves*: its Welcome no longer says it is starting (it
    answers Hello earlier, while its zygotes, self-tests and pools start: core/readiness.py)."""
    deadline = time.monotonic() + guard(timeout)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"jaild exited with {proc.returncode} before serving:\n"
                + Path(log_path).read_text(errors="replace")
            )
        answer = welcome(path, deadline - time.monotonic())
        if answer is not None and not (isinstance(answer, Welcome) and answer.starting):
            return  # ready; or it refuses us (an Error), which is the test's to see
        time.sleep(0.05)
    raise AssertionError("jaild did not start serving in time")


_STARTED_BLOCKS: list[tuple[int, weakref.ref[subprocess.Popen[bytes]]]] = []
"""The uid block of each daemon :func:`start_daemon` started, with its process while that
is referenced: one still running has the block, whether or not it has claimed it yet."""


def block_in_use(base: int) -> bool:
    """Is the uid block from ``base`` taken: by a daemon this session started that still
    runs, or by any jaild instance on this host that holds its claim on it (its lock file's
    flock, in /proc/locks: jaild/daemon/uidblock.py)?"""
    for started, ref in _STARTED_BLOCKS:
        proc = ref()
        if started == base and proc is not None and proc.poll() is None:
            return True
    try:
        st = os.stat(lock_path(base))
    except OSError:
        return False  # never claimed since the host booted
    return bool(flock_holders(Path("/proc/locks").read_text(), st.st_dev, st.st_ino))


def free_socket(directory: Path) -> str:
    """A socket path in ``directory`` whose daemon's uid block is free (:func:`block_in_use`):
    ``jaild.sock``, or where its block is taken, ``jaild-2.sock``, ``jaild-3.sock``... A
    daemon refuses to start on a block another instance holds, and a new socket path meets
    each daemon running 1 time in 4,095: over the suite's hundred and more starts, each beside
    the long-lived daemons (the shared one, the hostile suite's, a module's), some runs in a
    hundred would meet one."""
    n, sock = 1, str(directory / "jaild.sock")
    while block_in_use(DaemonConfig(socket_path=sock).uid_base):
        n += 1
        sock = str(directory / f"jaild-{n}.sock")
    return sock


def policy_texts(*names: str) -> dict[str, str]:
    """The named policies as :func:`start_daemon` serves them with ``with_repo_policies``
    (tests/policies' file where both have one), for a daemon that serves only what its test
    uses: each policy served costs every start a zygote and a self-test (a daemon with all
    13 starts in ~2.6 s here, with one in ~1.1 s)."""
    return {name: ((TEST_POLICIES if (TEST_POLICIES / f"{name}.toml").exists() else
                    REPO_POLICIES) / f"{name}.toml").read_text() for name in names}


def start_daemon(directory: Path, policies: dict[str, str] | None = None, *,
                 with_repo_policies: bool = True, extra_env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), wait: bool = True,
                 python: str = sys.executable, wrapper: tuple[str, ...] = (),
                 socket: str | None = None) -> DaemonHandle:
    """Start ``python -m jaild serve`` with a policy directory built from the given files
    (``python``: another install's interpreter, jaild imported from there; ``wrapper``: a
    command that execs it, such as ``unshare``, keeping its pid), on ``socket`` (default:
    :func:`free_socket`'s in ``directory``)."""
    require_jail_host()
    directory.mkdir(parents=True, exist_ok=True)
    pdir = directory / "policies"
    pdir.mkdir(exist_ok=True)
    if with_repo_policies:
        for src in [*REPO_POLICIES.glob("*.toml"), *TEST_POLICIES.glob("*.toml")]:
            shutil.copy(src, pdir / src.name)
    for name, text in (policies or {}).items():
        (pdir / f"{name}.toml").write_text(text)
    sock = socket or free_socket(directory)
    log_path = str(directory / "jaild.log")
    env = {**os.environ, **(extra_env or {})}
    env.pop("JAILD_SOCKET", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*wrapper, python, "-m", "jaild", "serve", "--socket", sock, "--policies", str(pdir),
             "--state-dir", STATE_DIR, "--log-level", "debug", *args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    handle = DaemonHandle(sock, str(pdir), proc, log_path)
    _STARTED_BLOCKS.append((handle.config.uid_base, weakref.ref(proc)))
    if wait:
        wait_listening(sock, proc, log_path)
        handle.subtree_dirs  # noqa: B018 -- where it placed itself, remembered while it runs
    return handle


def _subtrees() -> set[str]:
    """Every test daemon's cgroup subtree on this host (v1: in the memory hierarchy; v2: at
    the top, or in a daemon's delegated scope or service)."""
    if not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        root = Path(detect("").v1_base("memory"))  # daemons nest in their (our) own cgroup
        return {d.name for d in root.iterdir() if d.name.startswith("jaild-")} if root.is_dir() else set()
    found = set()
    for pattern in ("jaild-*", "*/jaild-*.scope", "*/jaild-*.scope/jaild-*"):
        found |= {str(p) for p in Path("/sys/fs/cgroup").glob(pattern) if p.is_dir()}
    return found


def proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: ``[0]`` the state (``S``,
    ``Z``...), ``[1]`` the parent's pid. Raises OSError once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int(proc_stat(entry)[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


_STARTED_SUBTREES: set[str] = set()
"""The cgroup subtree of every daemon this session started, noted as it was started
(:func:`_note_started_daemon`): the subtrees :func:`no_cgroups_left_behind` holds this
suite to account for."""
_STARTED_INSTANCES: set[str] = set()
"""The instance names (``DaemonConfig.instance``) of the daemons this suite started."""


def serve_socket(argv: list[str], cwd: str | None, env: Mapping[str, str] | None) -> str | None:
    """The socket of the daemon that the command ``argv`` starts (``... jaild serve``, under
    any wrapper): its ``--socket``, else ``$JAILD_SOCKET`` in ``env`` (None: this process's
    environment), else ``daemon.socket`` of its ``--config`` file, made absolute from ``cwd``
    as the daemon does; None if the command starts no daemon or names no socket."""
    if "serve" not in argv:
        return None
    flags: dict[str, str] = {}
    for flag, value in itertools.pairwise(argv):
        if flag in ("--socket", "--config"):
            flags[flag] = value
    for arg in argv:
        name, _, value = arg.partition("=")
        if name in ("--socket", "--config") and value:
            flags[name] = value
    sock = flags.get("--socket") or (os.environ if env is None else env).get("JAILD_SOCKET")
    if not sock and "--config" in flags:
        with contextlib.suppress(OSError, tomllib.TOMLDecodeError, AttributeError):
            path = os.path.join(cwd or os.getcwd(), flags["--config"])
            named = tomllib.loads(Path(path).read_text()).get("daemon", {}).get("socket")
            sock = named if isinstance(named, str) else None
    return os.path.join(cwd or os.getcwd(), sock) if sock else None


def _note_started_daemon(event: str, args: tuple[object, ...]) -> None:
    """An audit hook: note the subtree of each daemon this process starts, as it starts it,
    whoever starts it (:func:`start_daemon`, or a test's own ``Popen`` of ``jaild serve``)."""
    if event != "subprocess.Popen":
        return
    _executable, argv, cwd, env = args
    if not isinstance(argv, list | tuple):
        return  # a shell string: no daemon of ours is started that way
    words = []
    for arg in argv:
        if not isinstance(arg, str | bytes | os.PathLike):
            return
        words.append(os.fsdecode(arg))
    where = os.fsdecode(cwd) if isinstance(cwd, str | bytes | os.PathLike) else None
    sock = serve_socket(words, where, env if isinstance(env, Mapping) else None)
    if sock is not None:
        _STARTED_SUBTREES.add(DaemonConfig(socket_path=sock).subtree)
        _STARTED_INSTANCES.add(DaemonConfig(socket_path=sock).instance)


sys.addaudithook(_note_started_daemon)


def _subtree_name(path: str) -> str:
    """The daemon subtree a path of :func:`_subtrees` is, or is the scope of (v2:
    ``.../jaild-<hash>.scope`` and ``.../jaild-<hash>.scope/jaild-<hash>``; v1: the name)."""
    return os.path.basename(path).removesuffix(".scope")


def held_subtrees() -> set[str]:
    """The subtrees of :func:`_subtrees` that are this suite's daemons' (noted as each was
    started: :func:`_note_started_daemon`)."""
    return {p for p in _subtrees() if _subtree_name(p) in _STARTED_SUBTREES}


@pytest.fixture(scope="session", autouse=True)
def no_state_left_behind() -> Iterator[None]:
    """The snapshots and parked runs this suite's daemons kept in the shared state directory
    (``<state_dir>/snapshots/<instance>``, ``<state_dir>/parked/<instance>``: each daemon's
    own, named for its socket) are removed at the end, as its temporary directories are."""
    yield
    for instance in _STARTED_INSTANCES:
        if instance != "jaild":  # never the host's own daemon's
            for kind in ("snapshots", "parked"):
                shutil.rmtree(os.path.join(STATE_DIR, kind, instance), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_cgroups_left_behind() -> Iterator[None]:
    """The suite leaves no cgroup subtree of any daemon it started (set up first, so checked
    after every other fixture has stopped its daemon; on v2 a stopped daemon's scope is
    systemd's to collect, in a moment).

    Only this suite's daemons are held to account (:func:`held_subtrees`): the subtrees noted
    as they were started, each named for its socket path. Another suite's on this
    host is another instance's whatever its state -- serving, being torn down, or stopped a
    moment ago with its subtree still going -- since nothing at the end can tell whose a
    dead daemon's subtree was. Not covered: a private daemon (``jaild run``'s, in a command
    a test started) that dies leaving its subtree; its path is made inside that command."""
    yield
    deadline = time.monotonic() + guard(10)
    while held_subtrees() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held_subtrees() == set(), "daemons left cgroup subtrees behind"


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """The shared daemon: repository policies plus tests/policies."""
    handle = start_daemon(tmp_path_factory.mktemp("daemon"))
    yield handle
    code = handle.stop()
    assert code == 0, handle.log()[-4000:]
    assert not os.path.exists(handle.socket)


@pytest.fixture
def private_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonHandle]]:
    """Factory for daemons a test may break or stop; all are stopped afterwards."""
    started: list[DaemonHandle] = []

    def factory(*args: object, **kwargs: object) -> DaemonHandle:
        handle = start_daemon(tmp_path / f"d{len(started)}", *args, **kwargs)  # type: ignore[arg-type]
        started.append(handle)
        return handle

    yield factory
    for handle in started:
        if handle.proc.poll() is None:  # a graceful stop removes its cgroups ...
            try:
                handle.stop(signal.SIGTERM, timeout=20)
            except subprocess.TimeoutExpired:
                handle.stop(signal.SIGKILL)
        sweep_cgroups(handle)  # ... and a daemon a test killed leaves them to the next start


def sweep_cgroups(handle: DaemonHandle) -> None:
    """Remove what a stopped daemon left in its cgroup subtree (the daemon's own sweep)."""
    if handle.layout.version == 2 and not handle.placed and handle.proc.poll() is not None:
        # It exited before anyone learned where it placed itself (a start the test expects to
        # fail): a failed start removes its own subtree (server._start_serving), and on v2 a
        # dead daemon's placement cannot be read from /proc.
        return
    cgroups = handle.cgroups()
    cgroups.sweep()
    cgroups.remove_subtree()


WORLD_TMP = "/tmp"
"""Where directories that other uids must reach are made: /tmp itself, not $TMPDIR, which
may be private (Debian's libpam-tmpdir sets it to /tmp/user/<uid>, mode 0700)."""


def world_tempdir(prefix: str) -> Path:
    """A new 0755 directory in a place every uid can traverse."""
    assert os.stat(WORLD_TMP).st_mode & 0o001, f"{WORLD_TMP} is not world-searchable"
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=WORLD_TMP))
    d.chmod(0o755)
    return d


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A scratch directory the jailed uid can traverse (pytest's tmp_path is under a 0700 dir):
    for bind sources, fake nsjail binaries and environments."""
    d = world_tempdir("jaild-test-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def reachable_daemon(world_dir: Path, tmp_path: Path) -> Iterator[Callable[[dict[str, str], str],
                                                                         DaemonHandle]]:
    """``make(policies, config)``: a daemon other uids may reach (its socket in a
    world-searchable directory, ``socket_group = "nogroup"``) serving only ``policies``
    (name -> TOML), with ``config`` (TOML text after the ``[daemon]`` section's first line:
    more ``[daemon]`` keys, then any other sections). Each is stopped and swept at teardown."""
    started: list[DaemonHandle] = []

    def make(policies: dict[str, str], config: str = "") -> DaemonHandle:
        path = tmp_path / f"jaild{len(started)}.toml"
        path.write_text('[daemon]\nsocket_group = "nogroup"\n' + config)
        where = world_dir / f"d{len(started)}"
        handle = start_daemon(where, policies, with_repo_policies=False,
                              args=("--config", str(path)))
        os.chmod(where, 0o755)
        started.append(handle)
        return handle

    yield make
    for handle in started:
        handle.stop()
        sweep_cgroups(handle)


@dataclass(frozen=True)
class ForeignClient:
    """The client library as another uid can run it, wherever the checkout lives.

    A clone under a 0700 home directory is out of reach for any other uid, and so is the
    venv's ``bin/python`` inside it: a process of another uid can neither exec the venv's
    interpreter nor import the checkout. So the modules the client imports -- the checkout's
    own and the venv's (msgpack) -- are copied, exactly those and as they are, into a
    world-readable directory in a world-traversable place, and run by the base interpreter
    the venv was made from, isolated (``-I -S -B``: no environment, no site packages, no
    bytecode written)."""

    python: str
    path: str

    def argv(self, code: str, *args: str) -> list[str]:
        """``python -c code args...`` with the copy first on ``sys.path``."""
        prelude = f"import sys\nsys.path.insert(0, {self.path!r})\n"
        return [self.python, "-I", "-S", "-B", "-c", prelude + code, *args]

    def run(self, code: str, *args: str, uid: int, gid: int,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``code`` as ``uid``:``gid`` with no supplementary groups (not root's), from a
        directory it can reach, with a minimal environment (nothing of root's)."""
        return subprocess.run(
            self.argv(code, *args), capture_output=True, text=True, timeout=guard(timeout),
            check=False, user=uid, group=gid, extra_groups=[], cwd=self.path,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )


def copy_client(directory: Path, *modules: str) -> ForeignClient:
    """Copy what importing ``modules`` loads from outside the standard library (and only
    that) into ``directory``, world-readable; checked to import from the copy alone."""
    copy_modules(directory, modules, timeout_s=guard(60))
    base = getattr(sys, "_base_executable", "") or os.path.realpath(sys.executable)
    foreign = ForeignClient(python=base, path=str(directory))
    check = subprocess.run(foreign.argv("import " + ", ".join(modules)), capture_output=True,
                           text=True, timeout=guard(60), check=False)
    assert check.returncode == 0, f"the copied client does not import: {check.stderr}"
    return foreign


@pytest.fixture(scope="session")
def foreign_client() -> Iterator[ForeignClient]:
    """The client library (``jaild.client``, ``jaild.errors``) runnable by any uid: see
    :class:`ForeignClient`."""
    d = world_tempdir("jaild-test-client-")
    try:
        yield copy_client(d, "jaild.client", "jaild.errors")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def client(daemon: DaemonHandle) -> Iterator[Client]:
    with Client(daemon.socket) as c:
        yield c


def run_unjailed(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Positive control: run the same probe on the host, outside any jail."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=guard(timeout),
        check=False,
    )


class RawClient:
    """The client link by hand, past the client library's own checks: handshake done on
    entering, then ``send`` any message and read the daemon's answers with ``next``."""

    def __init__(self, socket_path: str, timeout: float = 30) -> None:
        self.conn = Connection(Role.CLIENT, 1 << 27)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(guard(timeout))
        self.socket_path = socket_path

    def __enter__(self) -> RawClient:
        self.sock.connect(self.socket_path)
        self.sock.sendall(self.conn.send(Hello(protocol=PROTOCOL_VERSION)))
        assert isinstance(self.next(), Welcome)
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, msg: Message) -> None:
        self.sock.sendall(self.conn.send(msg))

    def next(self) -> Message | None:
        """The next message; None if the daemon closed the connection or went quiet."""
        while True:
            event = self.conn.next_event()
            if event is NEED_DATA:
                try:
                    data = self.sock.recv(1 << 16)
                except TimeoutError:
                    return None
                self.conn.receive_data(data)
                continue
            return event if isinstance(event, Message) else None
