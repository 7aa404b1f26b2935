"""The network test bed (tests/fleet.py) and the certificates (tests/tls.py), proved with
plain processes before any jaild runs on them.

Every refusal has its positive control beside it: a node unreachable from outside is reached
from the client; a backend HAProxy stops using got connections while healthy and gets them
again once healthy; a partitioned peer's silence follows an answered exchange and ends with
the answer after heal(); each refused certificate is refused by a server that accepts the
good one.

No test here sends a packet to the bed's addresses from the host's own namespace: that
namespace routes them to its default gateway, off this machine. "Unreachable from outside" is
asked from ``bed.outside``, a namespace attached to nothing, where a connect fails before any
packet is sent.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from tests.conftest import guard
from tests.fleet import (
    Testbed,
    TestbedError,
    current_netns,
    exchange,
    in_netns,
    netns_id,
    read_line,
    require_testbed_host,
    wait_until,
)
from tests.tls import Issued, Pki, client_context, make_pki, server_context, spiffe_id

pytestmark = pytest.mark.integration

ECHO = 7000
HEALTH = 9100
FRONTEND = 8443


@pytest.fixture
def bed() -> Iterator[Testbed]:
    require_testbed_host()
    with Testbed() as b:
        yield b


def echo_from(bed: Testbed, address: str, port: int, line: bytes) -> bytes:
    """One connection from the client's namespace: ``line`` out, the reply back."""
    with bed.connect(bed.client, address, port, timeout=guard(5)) as s:
        return exchange(s, line)


# -- reachability ---------------------------------------------------------------------------

def test_a_node_is_reached_from_the_bed_and_not_from_outside(bed: Testbed) -> None:
    bed.start_echo(1, ECHO)
    node = bed.node(1)
    assert echo_from(bed, str(node.address), ECHO, b"ping") == b"node1 ping\n"
    with bed.connect(2, str(node.address), ECHO) as s:  # node to node too
        assert exchange(s, b"peer") == b"node1 peer\n"

    with pytest.raises(OSError) as refused:
        bed.connect(bed.outside, str(node.address), ECHO, timeout=guard(5))
    assert refused.value.errno == errno.ENETUNREACH

    # The host's namespace holds nothing of the bed: no address in its subnet, no link.
    addresses = json.loads(subprocess.run(["ip", "-j", "addr", "show"], capture_output=True,
                                          text=True, check=True).stdout)
    held = [ipaddress.ip_address(a["local"]) for link in addresses
            for a in link.get("addr_info", [])]
    assert not [a for a in held if a in bed.subnet]
    assert not [link["ifname"] for link in addresses if bed.token in link["ifname"]]
    assert current_netns() not in {netns_id(s) for s in bed.stations}


def test_names_fit_and_are_the_beds_own(bed: Testbed) -> None:
    names = [s.netns for s in bed.stations]
    assert len(set(names)) == len(names)
    assert all(n.startswith(f"jtb-{bed.token}-") for n in names)
    interfaces = [bed.bridge] + [str(s.interface) for s in bed.attached] + \
        [str(s.port) for s in bed.attached]
    assert all(len(i) <= 15 and bed.token in i for i in interfaces), interfaces
    assert bed.node(1).nsenter() == ["nsenter", f"--net=/run/netns/{bed.node(1).netns}"]
    # nsenter leaves the mount namespace alone: /sys and the host's cgroup mounts are seen
    # inside as outside (not a /sys remounted for the namespace, as `ip netns exec` does).
    def sys_mounts(mountinfo: str) -> list[str]:
        return [line for line in mountinfo.splitlines() if line.split()[4].startswith("/sys")]

    inside = subprocess.run([*bed.node(1).nsenter(), "cat", "/proc/self/mountinfo"],
                            capture_output=True, text=True, check=True).stdout
    assert sys_mounts(inside) == sys_mounts(Path("/proc/self/mountinfo").read_text())
    assert [m for m in sys_mounts(inside) if " - cgroup" in m]
    ip = subprocess.run([*bed.node(1).nsenter(), "ip", "-o", "-4", "addr", "show"],
                        capture_output=True, text=True, check=True).stdout
    assert f"{bed.node(1).address}/24" in ip and "127.0.0.1/8" in ip


# -- in_netns -------------------------------------------------------------------------------

def test_a_thread_started_in_a_namespace_stays_there(bed: Testbed) -> None:
    bed.start_echo(1, ECHO)
    address = str(bed.node(1).address)
    go = threading.Event()
    outcome: dict[str, object] = {}

    def worker() -> None:
        go.wait(guard(10))
        try:
            with socket.create_connection((address, ECHO), timeout=guard(5)) as s:
                outcome["reply"] = exchange(s, b"from the thread")
        except OSError as e:
            outcome["error"] = e
        outcome["netns"] = current_netns()

    home = current_netns()
    with in_netns(bed.outside):  # a namespace with no route: where the thread "lives"
        with bed.in_netns(bed.client):
            assert current_netns() == netns_id(bed.client)
            thread = threading.Thread(target=worker)
            thread.start()
        # The block is over: this thread is back outside, and cannot reach the node ...
        assert current_netns() == netns_id(bed.outside)
        with pytest.raises(OSError) as refused:
            socket.create_connection((address, ECHO), timeout=guard(5))
        assert refused.value.errno == errno.ENETUNREACH
        # ... while the thread started inside connects only now, from the client's namespace.
        go.set()
        thread.join(guard(10))
    assert not thread.is_alive()
    assert outcome == {"reply": b"node1 from the thread\n", "netns": netns_id(bed.client)}
    assert current_netns() == home


# -- HAProxy --------------------------------------------------------------------------------

def spread(bed: Testbed, count: int) -> Counter[str]:
    """Which node answered each of ``count`` connections through HAProxy."""
    seen: Counter[str] = Counter()
    for n in range(count):
        reply = echo_from(bed, str(bed.lb.address), FRONTEND, b"%d" % n)
        seen[reply.split(b" ")[0].decode()] += 1
    return seen


def test_haproxy_spreads_connections_and_follows_health(bed: Testbed) -> None:
    echoes = [bed.start_echo(i, ECHO, wait=False) for i in (1, 2, 3)]
    health = {i: bed.start_health(i, HEALTH, wait=False) for i in (1, 2, 3)}
    for i, p in [*enumerate(echoes, 1), *health.items()]:
        bed.wait_for_port(i, ECHO if p in echoes else HEALTH, process=p)
    lb = bed.start_haproxy(bed.backends(ECHO, health_port=HEALTH), port=FRONTEND,
                           balance="roundrobin", check="http")
    assert "option httpchk GET /metrics" in lb.config()
    states = lb.wait_up(3)
    assert {s.check_status for s in states.values()} == {"L7OK"}

    # With every health port up, every node gets connections (the control).
    assert set(spread(bed, 6)) == {"node1", "node2", "node3"}

    health[2].stop()
    assert lb.wait_status("node2", up=False).check_status in ("L4CON", "L4TOUT", "L7STS")
    seen = spread(bed, 6)
    assert set(seen) == {"node1", "node3"}, seen

    health[2] = bed.start_health(2, HEALTH)
    lb.wait_status("node2", up=True)
    assert set(spread(bed, 6)) == {"node1", "node2", "node3"}
    assert "node2 is DOWN" in lb.log() and "node2 is UP" in lb.log()


def test_haproxy_tcp_check_and_admin_state(bed: Testbed) -> None:
    for i in (1, 2):
        bed.start_echo(i, ECHO)
    lb = bed.start_haproxy(bed.backends(ECHO, nodes=(1, 2)), port=FRONTEND, check="tcp",
                           balance="leastconn")
    assert {s.check_status for s in lb.wait_up().values()} == {"L4OK"}
    lb.set_state("node1", "maint")
    assert set(spread(bed, 4)) == {"node2"}
    lb.set_state("node1", "ready")
    lb.wait_status("node1", up=True)
    assert "node1" in spread(bed, 4)
    state = lb.command("show servers state be")
    assert "node1" in state and "node2" in state


def test_haproxy_refuses_a_bad_config_saying_why(bed: Testbed) -> None:
    with pytest.raises(TestbedError, match="haproxy -c refused"):
        bed.start_haproxy(bed.backends(ECHO), balance="no-such-algorithm")


# -- failures -------------------------------------------------------------------------------

def test_partition_is_silence_and_heal_ends_it(bed: Testbed) -> None:
    bed.start_echo(1, ECHO)
    with bed.connect(bed.client, str(bed.node(1).address), ECHO, timeout=guard(5)) as s:
        assert exchange(s, b"before") == b"node1 before\n"  # the control
        bed.partition(1)
        s.sendall(b"during\n")  # a send succeeds: nothing says the peer is gone
        s.settimeout(1.0)
        with pytest.raises(TimeoutError):  # no reply, no RST (ConnectionResetError), no EOF
            s.recv(100)
        bed.heal(1)
        assert read_line(s, guard(10)) == b"node1 during\n"  # TCP's retransmission arrives
        assert exchange(s, b"after") == b"node1 after\n"


def test_link_down_is_silence_the_node_knows_of(bed: Testbed) -> None:
    bed.start_echo(2, ECHO)
    with bed.connect(bed.client, str(bed.node(2).address), ECHO, timeout=guard(5)) as s:
        assert exchange(s, b"before") == b"node2 before\n"
        bed.link_down(2)
        s.sendall(b"during\n")
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(100)
        # Unlike a partition, the node itself knows: it has no route to the client now.
        with pytest.raises(OSError) as refused:
            bed.connect(2, str(bed.client.address), ECHO, timeout=guard(5))
        assert refused.value.errno == errno.ENETUNREACH
        bed.link_up(2)
        assert read_line(s, guard(10)) == b"node2 during\n"


# -- teardown -------------------------------------------------------------------------------

def test_teardown_leaves_nothing_even_when_the_test_fails() -> None:
    require_testbed_host()
    with pytest.raises(RuntimeError, match="the test failed") as failed, \
            Testbed(nodes=2) as bed:
        echo = bed.start_echo(1, ECHO)
        lb = bed.start_haproxy(bed.backends(ECHO, nodes=(1,)), check="tcp")
        with Testbed(nodes=1) as other:  # a second bed beside it: names of its own
            assert other.token != bed.token
            assert not {s.netns for s in other.stations} & {s.netns for s in bed.stations}
            other_left = other
        names = [s.netns for s in bed.stations]
        # The check sees a live bed (so an empty answer after teardown means something).
        seen = bed.leftovers()
        assert {f"netns {n}" for n in names} <= set(seen)
        assert any(f"pid {echo.pid}" in x for x in seen)
        assert any("task" in x for x in seen)
        directory = bed.directory
        raise RuntimeError("the test failed")
    assert bed.leftovers() == [] and other_left.leftovers() == []
    assert not echo.running() and lb.process is not None and not lb.process.running()
    assert not [n for n in names if Path("/run/netns", n).exists()]
    assert any("logs" in note for note in getattr(failed.value, "__notes__", []))
    assert directory.is_dir()  # kept, the body having failed
    shutil.rmtree(directory)


# -- certificates ---------------------------------------------------------------------------

def identity(der: bytes | None) -> str:
    """A client certificate's URI SAN, or its subject CN where it has none."""
    assert der is not None
    cert = x509.load_der_x509_certificate(der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    cns = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    return uris[0] if uris else str(cns[0].value)


class TlsServer:
    """A mutual-TLS server on loopback that records, per connection, the client's identity
    (its URI SANs or CN) or why the handshake failed."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.outcomes: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            with raw:
                raw.settimeout(guard(5))
                try:
                    with self.context.wrap_socket(raw, server_side=True) as tls:
                        who = identity(tls.getpeercert(binary_form=True))
                        self.outcomes.append(f"ok {who}")
                        tls.sendall(f"hello {who}\n".encode())
                except (ssl.SSLError, OSError) as e:
                    self.outcomes.append(f"refused {getattr(e, 'reason', None) or e}")

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        self.listener.close()
        self.thread.join(guard(5))

    def attempt(self, context: ssl.SSLContext, name: str = "localhost") -> str:
        """Connect with ``context``; the server's outcome for this connection."""
        before = len(self.outcomes)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=guard(5)) as raw, \
                    context.wrap_socket(raw, server_hostname=name) as tls:
                read_line(tls, guard(5))  # TLS 1.3: a refused client cert shows on reading
        except (ssl.SSLError, OSError):
            pass
        wait_until(lambda: len(self.outcomes) > before, "the server's outcome", 5)
        assert len(self.outcomes) == before + 1, self.outcomes
        return self.outcomes[-1]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path, server_names=("localhost",), server_ips=("127.0.0.1",))


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[TlsServer]:
    server = TlsServer(server_context(pki.ca.cert, pki.server))
    yield server
    server.close()


def as_client(pki: Pki, cert: Issued | None, **options: bool) -> ssl.SSLContext:
    return client_context(pki.ca.cert, cert, **options)


def test_mutual_tls_accepts_the_good_clients(pki: Pki, tls_server: TlsServer) -> None:
    assert tls_server.attempt(as_client(pki, pki.client)) == f"ok {spiffe_id('alice')}"
    assert tls_server.attempt(as_client(pki, pki.cn_only_client)) == "ok bob"
    assert pki.client.certificate.subject.rfc4514_string() == "CN=alice"


@pytest.mark.parametrize(("which", "reason"), [
    ("expired_client", "CERTIFICATE_VERIFY_FAILED"),
    ("future_client", "CERTIFICATE_VERIFY_FAILED"),
    ("foreign_client", "CERTIFICATE_VERIFY_FAILED"),
    ("server", "CERTIFICATE_VERIFY_FAILED"),  # a server certificate: no clientAuth
    (None, "PEER_DID_NOT_RETURN_A_CERTIFICATE"),
])
def test_mutual_tls_refuses_the_bad_clients(pki: Pki, tls_server: TlsServer,
                                            which: str | None, reason: str) -> None:
    assert tls_server.attempt(as_client(pki, pki.client)).startswith("ok")  # the control
    cert: Issued | None = getattr(pki, which) if which else None
    assert tls_server.attempt(as_client(pki, cert)) == f"refused {reason}"


def test_tls12_only_clients_are_refused(pki: Pki, tls_server: TlsServer) -> None:
    assert tls_server.attempt(as_client(pki, pki.client)).startswith("ok")
    outcome = tls_server.attempt(as_client(pki, pki.client, tls12_only=True))
    assert outcome == "refused UNSUPPORTED_PROTOCOL"


def test_clients_check_the_server(pki: Pki, tls_server: TlsServer) -> None:
    foreign = client_context(pki.foreign_ca.cert, pki.client)
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=guard(5)) as raw, \
            pytest.raises(ssl.SSLCertVerificationError):
        foreign.wrap_socket(raw, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=guard(5)) as raw, \
            pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        as_client(pki, pki.client).wrap_socket(raw, server_hostname="elsewhere.test")
