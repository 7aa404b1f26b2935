"""A test bed of network "nodes" on one machine: network namespaces on a bridge, HAProxy in
front of them, and failures to inject.

What a test gets
----------------
``with Testbed() as bed:`` makes, all in network namespaces of its own (nothing is added to
the host's namespace):

* ``bed.switch``: a namespace holding a Linux bridge, and nothing else (no address);
* ``bed.node(1)`` ... ``bed.node(N)`` (N = 3 by default): each a namespace with loopback up
  and one veth to the bridge, addressed ``10.A.B.11``, ``.12``, ... on a /24 picked per bed;
* ``bed.client`` (``.2``): where a test's client runs;
* ``bed.lb`` (``.3``): where HAProxy runs (:meth:`Testbed.start_haproxy`). A namespace of its
  own rather than the client's, so that a node sees HAProxy's connections and health checks
  come from an address that is neither the client's nor its own, as behind a real balancer,
  and a fault injected on the client leaves the balancer alone;
* ``bed.outside``: a namespace attached to nothing (loopback only). It is what "not on the
  bed's network" means in a test: a connect from it to a node fails at once with
  ENETUNREACH. The host's own namespace is no substitute: there the bed's private addresses
  follow the host's default route off the machine, and no test may send packets there.

Each :class:`Station` (one of these namespaces) has its ``netns`` name, ``address`` and
``nsenter()``, the argv prefix that runs a command inside only its *network* namespace
(``nsenter --net=/run/netns/NAME``; not ``ip netns exec``, which also remounts /sys and so
hides /sys/fs/cgroup's mounts that jaild needs).

Names: every namespace is ``jtb-<token>-<role>`` and every interface ``jtb<token><role>``
(at most 15 characters), ``token`` 6 random hex digits; the /24 is derived from the token too.
So several beds -- in one suite, or two suites in two clones -- run side by side.

A typical test::

    from tests.fleet import Testbed, in_netns, require_testbed_host

    @pytest.fixture
    def bed() -> Iterator[Testbed]:
        require_testbed_host()
        with Testbed(nodes=3) as bed:
            yield bed

    def test_x(bed: Testbed) -> None:
        for i in (1, 2, 3):                       # a process in each node's namespace
            bed.spawn(bed.node(i), ["jaild", "serve", ...], name=f"jaild{i}")
        lb = bed.start_haproxy(bed.backends(port=8443, health_port=9100))
        lb.wait_up()                              # all three passed a health check
        with in_netns(bed.client):                # this thread's sockets are the client's
            client = FleetClient(...)             # ... and so are the threads it starts
        bed.partition(2)                          # node 2 goes silent; bed.heal(2) undoes it

Processes: :meth:`Testbed.spawn` runs argv in a station's namespace, its output in a log
under ``bed.directory``; :meth:`Testbed.start_echo` and :meth:`Testbed.start_health` start
small stand-ins for a daemon (a TCP echo that names its node; an HTTP ``GET /metrics``).

Threads: :func:`in_netns` moves the *calling thread* into a namespace and back. A thread
started inside the block stays in that namespace for good (a new thread shares its creator's
namespaces), so a client that starts an event-loop thread there keeps making its sockets
there. So do the worker threads of an executor first used inside (``getaddrinfo`` in
asyncio's default executor): create what must stay outside before entering.

Failures, each undone by its pair: :meth:`Testbed.partition`/:meth:`Testbed.heal` (the node
drops every IPv4 packet on its bed interface, both ways: no RST, no ICMP, its links stay up --
a peer sees silence, and so does the node), :meth:`Testbed.link_down`/:meth:`Testbed.link_up`
(the node's interface goes down: its own stack knows, its connected route goes and its own
connects fail with ENETUNREACH; its peers see silence).

Teardown (``__exit__``, also when the test failed): every process the bed started is
stopped (its process group: SIGTERM, then SIGKILL), the namespaces are deleted (their veths
and bridge go with them), then :meth:`Testbed.leftovers` must be empty -- no netns of the
bed's names, no process it started, no task anywhere still in one of its namespaces, no link
of its names in the caller's namespace -- or :class:`TestbedLeftovers` is raised (added as a
note instead when the test's own exception is on its way). The bed's directory (logs,
configs, HAProxy's socket) is removed, but kept when the body raised.

The bed is IPv4 only: interfaces get no IPv6 link-local address (``addrgenmode none``).

Needs root, ``ip`` (iproute2), ``nsenter`` (util-linux), ``iptables`` and
``haproxy``: ``make test`` installs them (the Makefile's ``TEST_PACKAGES``).
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import io
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from tests.conftest import guard

NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]

TOOLS = {"ip": "iproute2", "nsenter": "util-linux",
         "iptables-restore": "iptables", "haproxy": "haproxy"}


class TestbedError(RuntimeError):
    """Making, changing or driving the bed failed (the command's output is in the message)."""

    __test__ = False


class TestbedLeftovers(AssertionError):
    """Teardown found something of the bed still there."""

    __test__ = False


def require_testbed_host() -> None:
    """Fail (never skip) when this machine cannot make a bed, saying what is missing."""
    problems = []
    if os.geteuid() != 0:
        problems.append("run as root (network namespaces, veths, iptables)")
    missing = sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        problems.append(f"install {' '.join(missing)} (make test does: TEST_PACKAGES)")
    if problems:
        pytest.fail("the network test bed cannot run here: " + "; ".join(problems),
                    pytrace=False)


# -- namespaces -----------------------------------------------------------------------------

def netns_path(netns: str | Station) -> str:
    """The bind mount of a named namespace (``/run/netns/NAME``); a path is kept as it is."""
    if isinstance(netns, Station):
        return netns.path
    return netns if "/" in netns else f"{NETNS_DIR}/{netns}"


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def current_netns() -> int:
    """The inode of the calling thread's network namespace (compare with :func:`netns_id`)."""
    return os.stat("/proc/thread-self/ns/net").st_ino


def netns_id(netns: str | Station) -> int:
    """The inode of a named network namespace."""
    return os.stat(netns_path(netns)).st_ino


@contextlib.contextmanager
def in_netns(netns: str | Station) -> Iterator[None]:
    """Move the calling thread into ``netns`` (a :class:`Station`, a name under /run/netns
    or a path) for the block, and back to the namespace it was in on exit (so blocks nest).

    Only this thread moves. Sockets made inside belong to ``netns`` for their whole life,
    and threads started inside stay there after the block ends (Linux: a new thread shares
    its creator's namespaces)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def connect(frm: str | Station, address: str, port: int, timeout: float = 5.0) -> socket.socket:
    """A TCP connection made from inside ``frm``'s namespace (the socket stays there).

    Raises:
        OSError: as ``socket.create_connection`` does (ENETUNREACH where there is no route).
    """
    with in_netns(frm):
        return socket.create_connection((address, port), timeout=timeout)


@dataclass(frozen=True)
class Station:
    """One network namespace of the bed."""

    role: str
    """``switch``, ``node1``..., ``client``, ``lb``, ``outside``."""
    netns: str
    """The namespace's name (``/run/netns/<netns>``)."""
    address: str | None = None
    """Its IPv4 address on the bed (none for ``switch`` and ``outside``)."""
    interface: str | None = None
    """Its interface on the bed, inside its namespace."""
    port: str | None = None
    """The bridge port its veth plugs into, in the switch's namespace."""

    @property
    def path(self) -> str:
        return f"{NETNS_DIR}/{self.netns}"

    def nsenter(self) -> list[str]:
        """The argv prefix that runs a command inside this network namespace only (the
        mount namespace, /sys and the cgroup mounts stay the caller's)."""
        return ["nsenter", f"--net={self.path}"]


# -- processes ------------------------------------------------------------------------------

@dataclass
class Process:
    """A process started in a namespace, its output in a log file, in a session (process
    group) of its own."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, argv: Sequence[str], log_path: Path, name: str,
              env: dict[str, str] | None = None) -> Process:
        with log_path.open("wb") as log:
            popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        return cls(name, popen, log_path)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
        """Signal its process group, wait up to ``timeout`` s for it to exit, then SIGKILL
        the group; its exit status. What it left in its group is killed before it is reaped
        (while its zombie still holds the group's id, so no other group can have it)."""
        if self.popen.returncode is not None:
            return self.popen.returncode
        pid = self.popen.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + guard(timeout)
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return self.popen.wait()


SERVER_CODE = r"""
import http.server, socketserver, sys
kind, address, port, name, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]

class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(name.encode() + b" " + line)
            self.wfile.flush()

class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == path
        body = f"jaild_testbed_up{{node={name!r}}} 1\n".encode() if ok else b"not found\n"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

Server((address, port), Echo if kind == "echo" else Metrics).serve_forever()
"""
"""The stand-in servers (:meth:`Testbed.start_echo`, :meth:`Testbed.start_health`): the
echo answers each line with ``<node> <line>``; the health server answers ``GET <path>`` with
200 and anything else with 404."""


def wait_until(condition: Callable[[], object], what: str, timeout: float = 10.0,
               interval: float = 0.02) -> None:
    """Wait for ``condition()`` to hold; ``timeout`` is a liveness guard (``guard``)."""
    deadline = time.monotonic() + guard(timeout)
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {guard(timeout)} s")
        time.sleep(interval)


# -- HAProxy --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """A server HAProxy balances to."""

    name: str
    address: str
    port: int
    health_port: int | None = None
    """The port health checks go to (``check port N``); none: the traffic port."""


@dataclass(frozen=True)
class ServerState:
    """A backend server as HAProxy's ``show stat`` reports it."""

    name: str
    status: str
    """``UP``, ``DOWN``, ``MAINT``, ``UP 1/2`` (going down), ``DOWN 1/2``, ``no check``..."""
    check_status: str
    """The last check's result: ``L7OK``, ``L4OK``, ``L4CON`` (refused), ``L4TOUT``,
    ``L7STS`` (bad status), ``INI`` (none yet)..."""

    @property
    def up(self) -> bool:
        """UP *and* it passed a check (HAProxy counts a server UP before its first check)."""
        return self.status == "UP" and self.check_status in ("L4OK", "L6OK", "L7OK")

    @property
    def down(self) -> bool:
        return self.status == "DOWN"


class Haproxy:
    """HAProxy in TCP mode in front of ``backends``, in the foreground (``-db``), its stats
    socket and config in ``directory``, its log (with every check's state change) beside.

    Args:
        nsenter: the argv prefix that puts it in its namespace (``()``: the caller's).
        directory: where its config, stats socket and log go (keep the path short: a unix
            socket's path has at most 107 bytes).
        backends: what it balances to, in order.
        bind: the frontend's address; port: its port.
        balance: ``roundrobin``, ``leastconn`` or any other ``balance`` algorithm.
        check: ``http``: ``GET check_path`` must answer 200 (jaild's ``/metrics``); ``tcp``:
            a connect is enough; ``none``: no checks (every server is always UP).
        inter_ms, fall, rise: checks every ``inter_ms`` ms; ``fall`` failures in a row take a
            server DOWN, ``rise`` passes bring it back.
        check_timeout_ms: a check that has no answer by then failed (a silent node).
        server_options: appended to every ``server`` line (``send-proxy-v2``...).
        backend_lines: extra lines for the backend section (``option redispatch``...).
    """

    def __init__(self, nsenter: Sequence[str], directory: Path, backends: Sequence[Backend], *,
                 bind: str = "127.0.0.1", port: int = 8443, balance: str = "roundrobin",
                 check: Literal["http", "tcp", "none"] = "http", check_path: str = "/metrics",
                 inter_ms: int = 250, fall: int = 2, rise: int = 1, check_timeout_ms: int = 500,
                 connect_timeout_ms: int = 1000, server_options: str = "",
                 backend_lines: Sequence[str] = (), name: str = "haproxy") -> None:
        self.nsenter = list(nsenter)
        self.directory = Path(directory)
        self.backends = list(backends)
        self.bind, self.port = bind, port
        self.balance, self.check, self.check_path = balance, check, check_path
        self.inter_ms, self.fall, self.rise = inter_ms, fall, rise
        self.check_timeout_ms, self.connect_timeout_ms = check_timeout_ms, connect_timeout_ms
        self.server_options, self.backend_lines = server_options, list(backend_lines)
        self.name = name
        self.config_path = self.directory / f"{name}.cfg"
        self.socket_path = self.directory / f"{name}.sock"
        self.log_path = self.directory / f"{name}.log"
        if len(os.fsencode(self.socket_path)) > 107:
            raise TestbedError(f"HAProxy's stats socket path is too long: {self.socket_path}")
        self.process: Process | None = None

    def config(self) -> str:
        """The configuration it runs with."""
        lines = [
            "global",
            "    log stdout format raw local0 info",
            f"    stats socket {self.socket_path} mode 600 level admin",
            "    maxconn 512",
            "    nbthread 1",
            "defaults",
            "    mode tcp",
            "    log global",
            "    option tcplog",
            "    option dontlognull",
            f"    timeout connect {self.connect_timeout_ms}ms",
            "    timeout client 60s",
            "    timeout server 60s",
            f"    timeout check {self.check_timeout_ms}ms",
            "frontend fe",
            f"    bind {self.bind}:{self.port}",
            "    default_backend be",
            "backend be",
            f"    balance {self.balance}",
        ]
        if self.check == "http":
            lines += [f"    option httpchk GET {self.check_path}",
                      "    http-check expect status 200"]
        lines.append(f"    default-server inter {self.inter_ms}ms fastinter {self.inter_ms}ms "
                     f"downinter {self.inter_ms}ms fall {self.fall} rise {self.rise}")
        lines += [f"    {line}" for line in self.backend_lines]
        for b in self.backends:
            server = f"    server {b.name} {b.address}:{b.port}"
            if self.check != "none":
                server += " check" + (f" port {b.health_port}" if b.health_port else "")
            lines.append(server + (f" {self.server_options}" if self.server_options else ""))
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 10.0) -> Haproxy:
        """Write the config, check it (``haproxy -c``), start it and wait until its stats
        socket answers.

        Raises:
            TestbedError: the config is refused or HAProxy exits (its log in the message).
        """
        self.config_path.write_text(self.config())
        checked = subprocess.run(["haproxy", "-c", "-q", "-f", str(self.config_path)],
                                 capture_output=True, text=True, check=False)
        if checked.returncode != 0:
            raise TestbedError(f"haproxy -c refused {self.config_path}:\n{checked.stdout}"
                               f"{checked.stderr}\n{self.config()}")
        self.process = Process.start([*self.nsenter, "haproxy", "-db", "-f",
                                      str(self.config_path)], self.log_path, self.name)

        def answers() -> bool:
            if self.process is not None and not self.process.running():
                raise TestbedError(f"haproxy exited ({self.process.popen.returncode}):\n"
                                   f"{self.process.log()}")
            try:
                return "Name: HAProxy" in self.command("show info")
            except OSError:
                return False

        wait_until(answers, "HAProxy's stats socket answering", timeout)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def log(self) -> str:
        return self.process.log() if self.process is not None else ""

    def command(self, command: str, timeout: float = 5.0) -> str:
        """One command on the stats socket (``level admin``: ``show stat``, ``show servers
        state``, ``set server be/NAME state maint``...); its whole answer."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(guard(timeout))
            s.connect(str(self.socket_path))
            s.sendall(command.encode() + b"\n")
            chunks = []
            while data := s.recv(65536):
                chunks.append(data)
        return b"".join(chunks).decode(errors="replace")

    def servers(self) -> dict[str, ServerState]:
        """Each backend server's state, by name (``show stat``)."""
        text = self.command("show stat")
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: ServerState(row["svname"], row["status"], row["check_status"])
                for row in rows
                if row.get("pxname") == "be" and row.get("svname") not in ("FRONTEND", "BACKEND")}

    def set_state(self, server: str, state: Literal["ready", "drain", "maint"]) -> None:
        """Put a server in maintenance, drain it or make it ready again (the admin's way)."""
        answer = self.command(f"set server be/{server} state {state}").strip()
        if answer:
            raise TestbedError(f"set server be/{server} state {state}: {answer}")

    def wait_up(self, count: int | None = None, timeout: float = 10.0) -> dict[str, ServerState]:
        """Wait until at least ``count`` servers (default: all) are UP having passed a
        check; the states then."""
        want = len(self.backends) if count is None else count
        states: dict[str, ServerState] = {}

        def enough() -> bool:
            nonlocal states
            states = self.servers()
            return sum(s.up for s in states.values()) >= want

        try:
            wait_until(enough, f"{want} servers UP in HAProxy", timeout, interval=0.05)
        except TimeoutError as e:
            raise TimeoutError(f"{e}: {states}\n{self.log()[-3000:]}") from None
        return states

    def wait_status(self, server: str, up: bool, timeout: float = 10.0) -> ServerState:
        """Wait until ``server`` is UP having passed a check (``up``) or DOWN (not ``up``)."""
        state: ServerState | None = None

        def there() -> bool:
            nonlocal state
            state = self.servers()[server]
            return state.up if up else state.down

        try:
            wait_until(there, f"{server} {'UP' if up else 'DOWN'} in HAProxy", timeout,
                       interval=0.05)
        except TimeoutError as e:
            raise TimeoutError(f"{e}: {state}\n{self.log()[-3000:]}") from None
        assert state is not None
        return state


# -- the bed --------------------------------------------------------------------------------

def _run(argv: Sequence[str], input_text: str | None = None) -> str:
    proc = subprocess.run(list(argv), input=input_text, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        shown = f"\n{input_text}" if input_text else ""
        raise TestbedError(f"{' '.join(argv)} exited {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}{shown}")
    return proc.stdout


def _ip_batch(netns: str, commands: Sequence[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "-n", netns, "-batch", "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class Testbed:
    """The bed (see the module's docstring). Use it as a context manager.

    Args:
        nodes: how many node namespaces (1 to 200).
        directory: where logs, configs and sockets go; default a new directory in the
            temporary directory, removed at teardown (kept when the body raised).
        token: the names' token (6 hex digits); default random.
    """

    __test__ = False

    def __init__(self, nodes: int = 3, *, directory: Path | None = None,
                 token: str | None = None) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be 1 to 200, not {nodes}")
        self._node_count = nodes
        self._token_given = token
        self._own_directory = directory is None
        self._directory_given = directory
        self.token = ""
        self.subnet = ipaddress.IPv4Network("10.0.0.0/24")
        self.directory = Path()
        self.switch = self.client = self.lb = self.outside = Station("", "")
        self.nodes: list[Station] = []
        self.bridge = ""
        self._made: list[str] = []  # namespaces made, in order
        self._inodes: set[int] = set()
        self._processes: list[Process] = []
        self._haproxies: list[Haproxy] = []
        self._partitioned: set[str] = set()
        self._closed = False

    # -- making ----------------------------------------------------------------------------

    def _name_everything(self, token: str) -> None:
        self.token = token
        raw = bytes.fromhex(token)
        self.subnet = ipaddress.IPv4Network(f"10.{200 + raw[0] % 50}.{raw[1]}.0/24")
        net = self.subnet.network_address
        prefix = f"jtb-{token}"

        def attached(role: str, short: str, host: int) -> Station:
            return Station(role, f"{prefix}-{short}", str(net + host), f"jtb{token}{short}",
                           f"jtb{token}{short}p")

        self.switch = Station("switch", f"{prefix}-sw")
        self.nodes = [attached(f"node{i}", f"n{i}", 10 + i)
                      for i in range(1, self._node_count + 1)]
        self.client = attached("client", "cl", 2)
        self.lb = attached("lb", "lb", 3)
        self.outside = Station("outside", f"{prefix}-out")
        self.bridge = f"jtb{token}br"

    @property
    def stations(self) -> list[Station]:
        """Every namespace of the bed: the switch, the nodes, client, lb, outside."""
        return [self.switch, *self.nodes, self.client, self.lb, self.outside]

    @property
    def attached(self) -> list[Station]:
        """The stations with an address on the bridge."""
        return [*self.nodes, self.client, self.lb]

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        self._inodes.add(netns_id(name))

    def __enter__(self) -> Testbed:
        try:
            self._make()
        except BaseException:
            with contextlib.suppress(Exception):
                self._teardown()
            raise
        return self

    def _make(self) -> None:
        for _ in range(8):  # a token another bed holds: its switch's name exists
            self._name_everything(self._token_given or secrets.token_hex(3))
            try:
                self._add_netns(self.switch.netns)
                break
            except TestbedError as e:
                if self._token_given or "File exists" not in str(e):
                    raise
        else:
            raise TestbedError("no free token for the bed's names")
        if self._own_directory:
            self.directory = Path(tempfile.mkdtemp(prefix=f"jtb-{self.token}-"))
        else:
            assert self._directory_given is not None
            self.directory = self._directory_given
            self.directory.mkdir(parents=True, exist_ok=True)
        for station in self.stations[1:]:
            self._add_netns(station.netns)
        # The switch: the bridge and a veth per station, the far end made straight into the
        # station's namespace (so it never exists in the host's).
        switch = ["link set lo up",
                  f"link add {self.bridge} type bridge stp_state 0",
                  f"link set {self.bridge} addrgenmode none up"]
        for s in self.attached:
            switch += [f"link add {s.port} type veth peer name {s.interface} netns {s.netns}",
                       f"link set {s.port} addrgenmode none master {self.bridge} up"]
        self._batches({self.switch.netns: switch})
        batches = {self.outside.netns: ["link set lo up"]}
        for s in self.attached:
            batches[s.netns] = ["link set lo up", f"link set {s.interface} addrgenmode none",
                                f"addr add {s.address}/{self.subnet.prefixlen} dev {s.interface}",
                                f"link set {s.interface} up"]
        self._batches(batches)

    def _batches(self, batches: dict[str, list[str]]) -> None:
        """``ip -n NS -batch`` for each namespace, side by side."""
        running = [(ns, commands, _ip_batch(ns, commands)) for ns, commands in batches.items()]
        failures = []
        for ns, commands, proc in running:
            out, _ = proc.communicate("\n".join(commands) + "\n")
            if proc.returncode != 0:
                failures.append(f"ip -n {ns} -batch: {out.strip()}\n  " + "\n  ".join(commands))
        if failures:
            raise TestbedError("making the bed failed:\n" + "\n".join(failures))

    # -- looking ---------------------------------------------------------------------------

    def node(self, i: int) -> Station:
        """Node ``i``, counted from 1."""
        if not 1 <= i <= len(self.nodes):
            raise IndexError(f"the bed has nodes 1 to {len(self.nodes)}, not {i}")
        return self.nodes[i - 1]

    def _station(self, which: int | Station) -> Station:
        return self.node(which) if isinstance(which, int) else which

    def _attached(self, which: int | Station) -> Station:
        station = self._station(which)
        if station.interface is None or station.port is None:
            raise ValueError(f"{station.role} has no link on the bed")
        return station

    def in_netns(self, which: int | Station) -> contextlib.AbstractContextManager[None]:
        """:func:`in_netns` for node ``i`` or a station."""
        return in_netns(self._station(which))

    def connect(self, frm: int | Station, address: str, port: int,
                timeout: float = 5.0) -> socket.socket:
        """:func:`connect` from node ``i`` or a station."""
        return connect(self._station(frm), address, port, timeout)

    def backends(self, port: int, health_port: int | None = None,
                 nodes: Sequence[int] | None = None) -> list[Backend]:
        """HAProxy backends ``node1``... at the nodes' addresses (default every node)."""
        chosen = nodes or range(1, len(self.nodes) + 1)
        return [Backend(self.node(i).role, str(self.node(i).address), port, health_port)
                for i in chosen]

    # -- processes -------------------------------------------------------------------------

    def spawn(self, where: int | Station, argv: Sequence[str], name: str,
              env: dict[str, str] | None = None) -> Process:
        """Run ``argv`` in a station's network namespace (``nsenter``), its output in
        ``<directory>/<name>.log``; stopped at teardown at the latest."""
        station = self._station(where)
        log = self.directory / f"{name}.log"
        n = 1
        while log.exists():
            n += 1
            log = self.directory / f"{name}-{n}.log"
        process = Process.start([*station.nsenter(), *argv], log, name, env)
        self._processes.append(process)
        return process

    def wait_for_port(self, where: int | Station, port: int, address: str | None = None,
                      process: Process | None = None, timeout: float = 10.0) -> None:
        """Wait until something accepts on ``address:port`` (default the station's own
        address), tried from inside the station's namespace; fail early, with its log, if
        ``process`` exits first."""
        station = self._station(where)
        target = address or station.address or "127.0.0.1"

        def accepts() -> bool:
            if process is not None and not process.running():
                raise TestbedError(f"{process.name} exited ({process.popen.returncode}) "
                                   f"before listening on {target}:{port}:\n{process.log()}")
            try:
                connect(station, target, port, timeout=1.0).close()
            except OSError:
                return False
            return True

        wait_until(accepts, f"a listener on {target}:{port} in {station.netns}", timeout)

    def _serve(self, kind: str, where: int | Station, port: int, path: str,
               wait: bool) -> Process:
        station = self._station(where)
        process = self.spawn(station, [sys.executable, "-I", "-c", SERVER_CODE, kind,
                                       str(station.address), str(port), station.role, path],
                             f"{kind}-{station.role}-{port}")
        if wait:
            self.wait_for_port(station, port, process=process)
        return process

    def start_echo(self, where: int | Station, port: int, *, wait: bool = True) -> Process:
        """A TCP echo server on the station's address: each line comes back as
        ``<role> <line>`` (``node1 hello\\n``), so a reply names the node that sent it."""
        return self._serve("echo", where, port, "", wait)

    def start_health(self, where: int | Station, port: int, path: str = "/metrics", *,
                     wait: bool = True) -> Process:
        """An HTTP server on the station's address answering ``GET path`` with 200 (what
        HAProxy's ``http`` check asks of jaild's metrics endpoint)."""
        return self._serve("health", where, port, path, wait)

    def start_haproxy(self, backends: Sequence[Backend], port: int = 8443,
                      name: str = "haproxy", **options: object) -> Haproxy:
        """HAProxy in the ``lb`` namespace on ``lb.address:port`` (see :class:`Haproxy` for
        ``options``), started and answering on its stats socket; stopped at teardown."""
        proxy = Haproxy(self.lb.nsenter(), self.directory, backends, bind=str(self.lb.address),
                        port=port, name=name, **options)  # type: ignore[arg-type]
        self._haproxies.append(proxy)
        proxy.start()
        assert proxy.process is not None
        self._processes.append(proxy.process)
        return proxy

    # -- failures --------------------------------------------------------------------------

    def _iptables(self, station: Station, op: str) -> None:
        rules = (f"*filter\n{op} INPUT -i {station.interface} -j DROP\n"
                 f"{op} OUTPUT -o {station.interface} -j DROP\nCOMMIT\n")
        _run([*station.nsenter(), "iptables-restore", "-w", "5", "--noflush"], rules)

    def partition(self, which: int | Station) -> None:
        """The node (or station) silently drops every IPv4 packet on its bed interface, in
        and out (iptables DROP in its namespace). Its links stay up and ARP still answers: a
        peer's sends succeed and are never answered, with no RST and no ICMP. The node's own
        loopback is untouched. Idempotent."""
        station = self._attached(which)
        if station.netns not in self._partitioned:
            self._iptables(station, "-I")
            self._partitioned.add(station.netns)

    def heal(self, which: int | Station) -> None:
        """Undo :meth:`partition` (a no-op where there is none)."""
        station = self._attached(which)
        if station.netns in self._partitioned:
            self._iptables(station, "-D")
            self._partitioned.discard(station.netns)

    def link_down(self, which: int | Station) -> None:
        """Take the node's (or station's) bed interface down: its connected route goes, its
        own connects fail with ENETUNREACH, its peers hear nothing from it."""
        station = self._attached(which)
        _run(["ip", "-n", station.netns, "link", "set", "dev", str(station.interface), "down"])

    def link_up(self, which: int | Station, timeout: float = 10.0) -> None:
        """Bring it back up (its address is kept), and wait until both ends of its veth are
        up again."""
        station = self._attached(which)
        _run(["ip", "-n", station.netns, "link", "set", "dev", str(station.interface), "up"])

        def up(netns: str, dev: str) -> bool:
            out = _run(["ip", "-n", netns, "-o", "link", "show", "dev", dev])
            return "state UP" in out

        wait_until(lambda: up(station.netns, str(station.interface))
                   and up(self.switch.netns, str(station.port)),
                   f"{station.role}'s link up", timeout)

    # -- teardown --------------------------------------------------------------------------

    def leftovers(self) -> list[str]:
        """What of the bed is still there: its namespaces, processes it started still
        running, tasks anywhere still in one of its namespaces, links of its names in the
        caller's namespace. Empty after teardown."""
        found: list[str] = []
        if os.path.isdir(NETNS_DIR):
            found += [f"netns {n}" for n in sorted(os.listdir(NETNS_DIR))
                      if n.startswith(f"jtb-{self.token}-")]
        found += [f"process {p.name} (pid {p.pid})" for p in self._processes if p.running()]
        if self._inodes:
            found += [f"task {t} in one of the bed's namespaces" for t in self._tasks_inside()]
        links = _run(["ip", "-o", "link", "show"])
        found += [f"link {line.split(':')[1].strip()} in the caller's namespace"
                  for line in links.splitlines() if f"jtb{self.token}" in line]
        return found

    def _tasks_inside(self) -> list[str]:
        wanted = {f"net:[{i}]" for i in self._inodes}
        inside = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{pid}/task/{tid}/ns/net") in wanted:
                            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                            inside.append(f"{pid}/{tid} ({comm})")
        return inside

    def _teardown(self) -> None:
        errors = []
        for process in reversed(self._processes):
            try:
                process.stop()
            except Exception as e:  # stop the others all the same
                errors.append(f"stopping {process.name}: {e}")
        for name in reversed(self._made):
            if os.path.exists(f"{NETNS_DIR}/{name}"):
                try:
                    _run(["ip", "netns", "delete", name])
                except TestbedError as e:
                    errors.append(str(e))
        if errors:
            raise TestbedError("tearing the bed down failed: " + "; ".join(errors))

    def close(self, keep_directory: bool = False) -> None:
        """Tear the bed down and check that nothing of it is left.

        Raises:
            TestbedLeftovers: something is left (named in the message).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._teardown()
        finally:
            left = self.leftovers()
            if self._own_directory and not keep_directory and not left:
                shutil.rmtree(self.directory, ignore_errors=True)
        if left:
            raise TestbedLeftovers(f"the test bed {self.token} left: {', '.join(left)} "
                                   f"(logs in {self.directory})")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        try:
            self.close(keep_directory=exc is not None)
        except (TestbedLeftovers, TestbedError) as e:
            if exc is None:
                raise
            exc.add_note(f"and at teardown: {e}")
        if exc is not None and self._own_directory:
            exc.add_note(f"the test bed's logs: {self.directory}")


def read_line(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Read up to and including a newline (b'' when the peer closed first)."""
    sock.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def exchange(sock: socket.socket, line: bytes, timeout: float = 5.0) -> bytes:
    """Send ``line`` (a newline added) and return the reply line."""
    sock.sendall(line + b"\n")
    return read_line(sock, guard(timeout))


__all__ = [
    "Backend", "Haproxy", "Process", "ServerState", "Station", "Testbed", "TestbedError",
    "TestbedLeftovers", "connect", "current_netns", "exchange", "in_netns",
    "netns_id", "netns_path", "read_line", "require_testbed_host", "wait_until",
]
