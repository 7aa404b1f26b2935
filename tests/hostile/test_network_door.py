"""The network door: a client over mutual TLS is let in only with a certificate of the CA
the daemon trusts, valid now, over TLS 1.3, naming a principal the daemon admits; it is
then served as that principal and nothing it says changes that. Every refusal happens
before ``Welcome``, is audited with what was presented and counted -- and the same probe
from a client the daemon admits (the control) gets in. Certificates are renewed without a
restart."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.errors import DaemonUnavailable, PermissionDenied, UnknownJob
from jaild.protocol import PROTOCOL_VERSION, Connection, Role, encode, encode_frame
from jaild.protocol.messages import Error, Hello, ListJobs, RunJob, Welcome
from tests.conftest import guard, until
from tests.network import DEFAULT_POLICY, TlsDaemon, start_tls_daemon
from tests.tls import Issued, Pki, client_context, make_pki, spiffe_id

pytestmark = pytest.mark.integration

RESTRICTED = DEFAULT_POLICY.replace(
    "[access]\n", f'[access]\nprincipals = ["{spiffe_id("alice")}"]\n', 1
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[TlsDaemon]:
    d = start_tls_daemon(
        tmp_path_factory.mktemp("door"), pki,
        policies={"default": DEFAULT_POLICY, "restricted": RESTRICTED},
        principals=("spiffe://jaild.test/agent/*",),
        metrics="127.0.0.1:0",
        limits={"handshake_timeout_s": 2},
        tls={"reload_s": 0.3},
    )
    yield d
    assert d.stop() == 0, d.handle.log()[-3000:]


@pytest.fixture(scope="module")
def mallory(pki: Pki) -> Issued:
    """Another agent of the same trust domain: let in at the door, not into ``restricted``."""
    return pki.ca.client("mallory", uri=spiffe_id("mallory"))


def refusals(door: TlsDaemon, reason: str) -> list[dict[str, object]]:
    return [r for r in door.audit() if r.get("event") == "refused" and r.get("tls_reason") == reason]


def host_and_port(door: TlsDaemon) -> tuple[str, int]:
    host, port = door.address[len("tls://"):].rsplit(":", 1)
    return host, int(port)


def tls_socket(door: TlsDaemon, context: ssl.SSLContext) -> ssl.SSLSocket:
    host, port = host_and_port(door)
    raw = socket.create_connection((host, port), timeout=guard(10))
    return context.wrap_socket(raw, server_hostname="localhost")


def read_message(sock: socket.socket, conn: Connection) -> object:
    from jaild.protocol import CLOSED, NEED_DATA

    while True:
        event = conn.next_event()
        if event is not NEED_DATA:
            return event
        data = sock.recv(65536)
        conn.receive_data(data)
        if not data:
            return CLOSED


# ------------------------------------------------------------------ who gets in


def test_a_certificate_of_the_ca_is_served_as_the_principal_it_names(door: TlsDaemon) -> None:
    with door.client() as c:
        job = c.submit("import time\ntime.sleep(30)")
        try:
            (mine,) = [j for j in c.jobs() if j["id"] == job.job_id]
            assert mine["principal"] == spiffe_id("alice")
            assert "uid" not in mine or mine["uid"] is None
        finally:
            job.cancel()
            job.result()
        assert c.stats()["principals"].keys() == {spiffe_id("alice")}
    (line,) = [r for r in door.audit() if r.get("job") == job.job_id]
    assert line["principal"] == spiffe_id("alice") and line["address"]


@pytest.mark.parametrize(
    ("which", "reason"),
    [
        ("none", "no_certificate"),
        ("foreign", "unknown_ca"),
        ("expired", "expired"),
        ("future", "not_yet_valid"),
        ("tls12", "protocol_version"),
    ],
)
def test_a_bad_certificate_or_version_is_refused_in_the_handshake(
    door: TlsDaemon, pki: Pki, which: str, reason: str
) -> None:
    context = {
        "none": lambda: client_context(pki.ca.cert),
        "foreign": lambda: client_context(pki.ca.cert, pki.foreign_client),
        "expired": lambda: client_context(pki.ca.cert, pki.expired_client),
        "future": lambda: client_context(pki.ca.cert, pki.future_client),
        "tls12": lambda: client_context(pki.ca.cert, pki.client, tls12_only=True),
    }[which]()
    before = door.sample("jaild_tls_refused_connections_total", reason=reason)
    seen = len(refusals(door, reason))
    with pytest.raises((PermissionDenied, DaemonUnavailable)) as info:
        Client(door.address, tls=context, server_name="localhost")
    assert "TLS" in str(info.value)
    until(lambda: len(refusals(door, reason)) == seen + 1, f"a {reason} refusal audited")
    record = refusals(door, reason)[-1]
    assert str(record["address"]).startswith("127.0.0.1:")
    assert record["code"] in ("permission_denied", "unsupported_version")
    assert door.sample("jaild_tls_refused_connections_total", reason=reason) == before + 1
    # the control: the same daemon lets alice in, the same way
    with Client(door.address, tls=client_context(pki.ca.cert, pki.client),
                server_name="localhost") as c:
        assert c.run("6 * 7").result == 42


def test_plaintext_never_reaches_the_protocol(door: TlsDaemon) -> None:
    seen = len(refusals(door, "not_tls"))
    hello = encode_frame(encode(Hello(protocol=PROTOCOL_VERSION, client="plain")), 1 << 16)
    with socket.create_connection(host_and_port(door), timeout=guard(10)) as s:
        s.sendall(hello)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert b"Welcome" not in answer and b"Error" not in answer  # no frame of the protocol
    until(lambda: len(refusals(door, "not_tls")) == seen + 1, "the plaintext refusal audited")


def test_a_principal_the_daemon_does_not_admit_gets_an_error_before_welcome(
    door: TlsDaemon, pki: Pki
) -> None:
    seen = [r for r in door.audit() if r.get("principal") == "CN=bob"]
    with pytest.raises(PermissionDenied, match=r"access\.principals"):
        door.client(pki.cn_only_client)  # its certificate is good: its name is not admitted
    until(lambda: len([r for r in door.audit() if r.get("principal") == "CN=bob"])
          == len(seen) + 1, "bob's refusal audited")
    with door.client() as c:  # the control
        assert c.run("1").result == 1


def test_a_policy_admits_only_its_principals(door: TlsDaemon, mallory: Issued) -> None:
    with door.client(mallory) as c:
        assert c.run("1").result == 1  # let in at the door, and into default
        with pytest.raises(PermissionDenied):
            c.run("1", "restricted")
    with door.client() as c:  # the control: alice may
        assert c.run("2", "restricted").result == 2


def test_what_a_client_says_in_its_hello_changes_nothing(
    door: TlsDaemon, pki: Pki, mallory: Issued
) -> None:
    """Mallory's Hello claims to be alice: it is still served as mallory."""
    conn = Connection(Role.CLIENT, 1 << 24)
    with tls_socket(door, client_context(pki.ca.cert, mallory)) as s:
        s.sendall(conn.send(Hello(protocol=PROTOCOL_VERSION, client=spiffe_id("alice"))))
        assert isinstance(read_message(s, conn), Welcome)
        from jaild.protocol.messages import JobDescription

        s.sendall(conn.send(RunJob(ref=1, job=JobDescription(code="1"), policy="restricted")))
        answer = read_message(s, conn)
        assert isinstance(answer, Error) and answer.code == "permission_denied"
        s.sendall(conn.send(ListJobs(ref=2)))
        read_message(s, conn)


def test_one_principal_cannot_see_or_kill_anothers_jobs(door: TlsDaemon, mallory: Issued) -> None:
    with door.client(mallory) as m, door.client() as a:
        job = m.submit("import time\ntime.sleep(30)")
        try:
            assert job.job_id not in {j["id"] for j in a.jobs()}
            with pytest.raises(UnknownJob):
                a.kill(job.job_id)
            assert job.job_id in {j["id"] for j in m.jobs()}  # the control: its owner sees it
        finally:
            m.kill(job.job_id)
        assert job.result().status == "cancelled"


# ------------------------------------------------------------------ before Hello


def test_the_pre_hello_limits_hold_over_tls(door: TlsDaemon, pki: Pki) -> None:
    conn = Connection(Role.CLIENT, 1 << 24)
    with tls_socket(door, client_context(pki.ca.cert, pki.client)) as s:
        s.sendall((1 << 20).to_bytes(4, "big"))  # a 1 MiB frame before Hello
        answer = read_message(s, conn)
        assert isinstance(answer, Error) and answer.code == "frame_too_large"
    started = time.monotonic()
    with tls_socket(door, client_context(pki.ca.cert, pki.client)) as s:  # says nothing
        answer = read_message(s, Connection(Role.CLIENT, 1 << 24))
        assert isinstance(answer, Error) and answer.code == "read_timeout"
    assert time.monotonic() - started >= 1.5  # handshake_timeout_s = 2


def test_a_silent_tcp_connection_is_dropped_after_the_handshake_timeout(door: TlsDaemon) -> None:
    seen = len(refusals(door, "handshake_timeout"))
    with socket.create_connection(host_and_port(door), timeout=guard(10)) as s:
        assert s.recv(1) == b""  # closed by the daemon, not by this end
    until(lambda: len(refusals(door, "handshake_timeout")) == seen + 1,
          "the silent connection's refusal audited")


# ------------------------------------------------------------------ renewal


def served_serial(door: TlsDaemon, pki: Pki) -> int:
    with tls_socket(door, client_context(pki.ca.cert, pki.client)) as s:
        der = s.getpeercert(binary_form=True)
    from cryptography import x509

    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_renewed_certificate_is_served_without_a_restart(door: TlsDaemon, pki: Pki) -> None:
    first = served_serial(door, pki)
    assert first == pki.server.certificate.serial_number  # the control: what was configured
    renewed = pki.ca.server(("localhost",), ("127.0.0.1",), stem=Path(pki.server.cert).stem)
    assert renewed.cert == pki.server.cert  # the same files, new contents
    until(lambda: served_serial(door, pki) == renewed.certificate.serial_number,
          "the renewed certificate served (reload_s)")
    again = pki.ca.server(("localhost",), ("127.0.0.1",), stem=Path(pki.server.cert).stem)
    os.kill(door.handle.proc.pid, signal.SIGHUP)  # SIGHUP reloads at once too
    until(lambda: served_serial(door, pki) == again.certificate.serial_number,
          "the certificate reloaded on SIGHUP")
    # a broken file keeps the certificate in use, and says so
    Path(pki.server.cert).write_text("not a certificate\n")
    until(lambda: "TLS certificates not reloaded" in door.handle.log(), "the broken file noticed")
    assert served_serial(door, pki) == again.certificate.serial_number
    with door.client() as c:
        assert c.run(f"{secrets.randbelow(100)} + 0").status == "ok"


# ------------------------------------------------------------------ what ends a connection


@pytest.fixture
def two_cas(tmp_path: Path) -> Iterator[tuple[TlsDaemon, Path, Issued, Pki]]:
    """A daemon of its own (and a PKI of its own: the module's server certificate is
    rewritten by the renewal test) whose tls.client_ca trusts two CAs (a file of both): the
    PKI's, and another whose client ``dave`` it returns; and the file, to change."""
    from tests.tls import CertAuthority

    pki = make_pki(tmp_path / "pki")
    other = CertAuthority(tmp_path / "other", "other test CA")
    dave = other.client("dave", uri=spiffe_id("dave"))
    bundle = tmp_path / "client-ca.pem"
    bundle.write_bytes(Path(pki.ca.cert).read_bytes() + Path(other.cert).read_bytes())
    d = start_tls_daemon(tmp_path / "d", pki, principals=("spiffe://jaild.test/agent/*",),
                         tls={"client_ca": str(bundle), "reload_s": 0.3})
    try:
        yield d, bundle, dave, pki
    finally:
        assert d.stop() == 0, d.handle.log()[-3000:]


def test_a_connection_ends_when_its_certificate_expires(door: TlsDaemon, pki: Pki) -> None:
    """A client let in with a certificate valid for a few more seconds is served, then its
    connection ends at the certificate's expiry -- an Error naming it, its job cancelled --
    while a connection of a certificate still valid goes on (the control)."""
    import datetime

    life = guard(6)  # long enough for the handshake and a job on a loaded machine
    ends = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=life)
    carol = pki.ca.client("carol", uri=spiffe_id("carol"), not_after=ends)
    with door.client(carol) as short, door.client() as control:
        assert short.run("1 + 1").result == 2  # served while valid
        job = short.submit("import time\ntime.sleep(600)")
        until(lambda: short.lost is not None, "the connection ended at the expiry",
              timeout=life + 30)
        assert datetime.datetime.now(datetime.UTC) >= ends - datetime.timedelta(seconds=1)
        assert "client certificate expired" in short.lost.message, short.lost
        with pytest.raises(Exception):  # noqa: B017 -- its job is gone with the connection
            job.result(timeout=guard(10))
        assert control.run("2 + 2").result == 4
    (line,) = [r for r in door.audit() if r.get("tls_reason") == "expired"
               and spiffe_id("carol") in str(r.get("principal", "")) + str(r.get("message", ""))]
    assert line


def test_a_connection_ends_when_its_ca_is_no_longer_trusted(
        two_cas: tuple[TlsDaemon, Path, Issued, Pki]) -> None:
    """tls.client_ca changed to leave out the CA that issued a live connection's
    certificate: at the reload, that connection ends (an Error naming it); one whose CA is
    still there goes on (the control). A new connection of the dropped CA is refused in its
    handshake, as before."""
    d, bundle, dave, pki = two_cas
    with d.client(dave) as dropped, d.client() as kept:
        assert dropped.run("1").result == 1 and kept.run("1").result == 1
        bundle.write_bytes(Path(pki.ca.cert).read_bytes())  # the other CA leaves
        until(lambda: dropped.lost is not None, "the connection of the dropped CA ended")
        assert "no longer trusted" in dropped.lost.message, dropped.lost
        assert kept.run("2").result == 2
    with pytest.raises(PermissionDenied, match="refused this client's certificate"):
        d.client(dave)
    assert [r for r in d.audit() if r.get("tls_reason") == "ca_removed"]


def test_one_source_cannot_hold_every_handshake_slot(tmp_path: Path) -> None:
    """A host that opens connections and never handshakes holds at most
    ``limits.max_handshakes_per_source`` slots; its next connection is closed at once
    (audited ``busy`` naming the limit), while a client from another address is let in and
    served (the control) -- the slots are per source, not one pool it could fill."""
    pki = make_pki(tmp_path / "pki")
    d = start_tls_daemon(tmp_path / "d", pki, principals=("spiffe://jaild.test/agent/*",),
                         limits={"max_handshakes_per_source": 3,
                                 "handshake_timeout_s": guard(60)})
    try:
        host, port = host_and_port(d)
        silent = []
        for _ in range(3):
            s = socket.create_connection((host, port), timeout=guard(10))
            silent.append(s)
        until(lambda: len(silent) == 3 and d.handle.proc.poll() is None, "3 silent connections")
        with socket.create_connection((host, port), timeout=guard(10)) as fourth:
            assert fourth.recv(1) == b""  # closed by the daemon before any TLS
        until(lambda: any("max_handshakes_per_source" in str(r.get("message", ""))
                          for r in d.audit()), "the fourth connection's refusal audited")
        other = socket.socket(socket.AF_INET)
        other.bind(("127.0.0.2", 0))  # another source (the loopback network is 127/8)
        other.settimeout(guard(10))
        other.connect((host, port))
        with client_context(pki.ca.cert, pki.client).wrap_socket(
                other, server_hostname="localhost") as tls:
            conn = Connection(Role.CLIENT, 1 << 24)
            tls.sendall(conn.send(Hello(protocol=PROTOCOL_VERSION, client="other-host")))
            assert isinstance(read_message(tls, conn), Welcome)
        for s in silent:
            s.close()
    finally:
        assert d.stop() == 0, d.handle.log()[-3000:]
