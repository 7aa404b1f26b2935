"""One CA per tenant (``tls.scoped_client_cas``), over real mutual TLS: a certificate that
tenant A's CA signed is served when it names one of A's principals and refused when it names
B's -- the recipe of cert-manager with an Issuer per namespace, where anyone who can create a
Certificate in namespace A can have A's CA sign any name. Each refusal has its control: the
same name from B's own CA, the same CA naming A's principal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.errors import PermissionDenied
from tests.conftest import until
from tests.network import TlsDaemon, start_tls_daemon
from tests.tls import CertAuthority, Issued, Pki, make_pki

pytestmark = pytest.mark.integration


def svid(namespace: str, account: str = "agent") -> str:
    return f"spiffe://cluster.local/ns/{namespace}/sa/{account}"


class Tenants:
    def __init__(self, root: Path) -> None:
        self.pki: Pki = make_pki(root / "pki")  # the daemon's own certificate, and its CA
        self.a = CertAuthority(root / "a", "team-a CA")
        self.b = CertAuthority(root / "b", "team-b CA")


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Tenants:
    return Tenants(tmp_path_factory.mktemp("tenants"))


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, tenants: Tenants) -> Iterator[TlsDaemon]:
    d = start_tls_daemon(
        tmp_path_factory.mktemp("door"), tenants.pki,
        principals=("spiffe://cluster.local/ns/*/sa/*",),
        tls={"client_ca": "", "reload_s": 0.3, "scoped_client_cas": [
            f"{tenants.a.cert}=spiffe://cluster.local/ns/team-a/sa/*",
            f"{tenants.b.cert}=spiffe://cluster.local/ns/team-b/sa/*"]},
    )
    yield d
    assert d.stop() == 0, d.handle.log()[-3000:]


def refused(door: TlsDaemon, reason: str) -> list[dict[str, object]]:
    return [r for r in door.audit()
            if r.get("event") == "refused" and r.get("tls_reason") == reason]


def served_as(door: TlsDaemon, cert: Issued) -> str:
    with door.client(cert) as c:
        assert c.run("6 * 7").result == 42
        (name,) = c.stats()["principals"].keys()
        return str(name)


def test_a_tenants_ca_cannot_mint_another_tenants_principal(
        door: TlsDaemon, tenants: Tenants) -> None:
    # the control: team-a's CA naming team-a's service account is served as it
    assert served_as(door, tenants.a.client("a", uri=svid("team-a"))) == svid("team-a")
    # the same CA naming team-b's: refused before the protocol, audited with both names
    seen = len(refused(door, "out_of_scope"))
    forged = tenants.a.client("forged", uri=svid("team-b"))
    with pytest.raises(PermissionDenied, match="refused this client's certificate"):
        door.client(forged)
    until(lambda: len(refused(door, "out_of_scope")) == seen + 1, "the refusal audited")
    message = str(refused(door, "out_of_scope")[-1]["message"])
    assert svid("team-b") in message and "team-a CA" in message, message
    # the same name from team-b's own CA is served: the CA, not the name, was refused
    assert served_as(door, tenants.b.client("b", uri=svid("team-b"))) == svid("team-b")
    # and a certificate with no URI SAN names its subject, which no tenant's pattern admits
    with pytest.raises(PermissionDenied):
        door.client(tenants.a.client("bare"))


def test_an_intermediate_made_with_a_tenants_ca_key_is_refused(
        door: TlsDaemon, tenants: Tenants, tmp_path: Path) -> None:
    """team-a's CA key signs an intermediate CA, whose leaf the client presents with its
    chain: OpenSSL verifies it (team-a's CA is an anchor), so the refusal is jaild's scope
    check, not the handshake (``ca_removed``, not ``unknown_ca``: the control that the chain
    was good). Without it, the intermediate could be used to hide which tenant's CA signed."""
    inter = tenants.a.intermediate(tmp_path / "inter", "rogue intermediate")
    leaf = inter.client("rogue", uri=svid("team-a"))
    chain = tmp_path / "chain.pem"
    chain.write_bytes(Path(leaf.cert).read_bytes() + Path(inter.cert).read_bytes())
    unknown, removed = len(refused(door, "unknown_ca")), len(refused(door, "ca_removed"))
    with pytest.raises(PermissionDenied):
        door.client(Issued(str(chain), leaf.key, leaf.certificate))
    until(lambda: len(refused(door, "ca_removed")) == removed + 1, "the refusal audited")
    assert len(refused(door, "unknown_ca")) == unknown
    # control: without its chain the same leaf fails OpenSSL's own verification
    with pytest.raises(PermissionDenied):
        door.client(leaf)
    until(lambda: len(refused(door, "unknown_ca")) == unknown + 1, "unknown_ca audited")


def test_a_tenants_ca_replaced_ends_its_live_connections_only(
        door: TlsDaemon, tenants: Tenants, tmp_path: Path) -> None:
    """team-a's file rewritten with another CA: at the reload team-a's live connection ends;
    team-b's goes on (the control)."""
    original = Path(tenants.a.cert).read_bytes()
    other = CertAuthority(tmp_path / "a2", "team-a CA, replaced")
    try:
        with (door.client(tenants.a.client("a", uri=svid("team-a"))) as a,
              door.client(tenants.b.client("b", uri=svid("team-b"))) as b):
            assert a.run("1").result == 1 and b.run("1").result == 1
            Path(tenants.a.cert).write_bytes(Path(other.cert).read_bytes())
            until(lambda: a.lost is not None, "team-a's connection ended")
            assert "no longer trusted" in a.lost.message, a.lost
            assert b.run("2").result == 2
    finally:
        Path(tenants.a.cert).write_bytes(original)
