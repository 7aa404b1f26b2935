"""Which principals a client CA may name (``tls.scoped_client_cas``, :class:`jaild.daemon.
tls.ClientTrust`): a tenant's CA names its tenant's principals and no other's. Each refusal
has its control: the same certificate, or the same CA, accepted where its scope allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaild.daemon.config import load_config_file
from jaild.daemon.tls import load_client_trust, server_context
from jaild.errors import StartupError
from tests.tls import CertAuthority

A = "spiffe://cluster.local/ns/team-a/sa/*"
B = "spiffe://cluster.local/ns/team-b/sa/*"


def svid(namespace: str, account: str = "agent") -> str:
    return f"spiffe://cluster.local/ns/{namespace}/sa/{account}"


@pytest.fixture
def cas(tmp_path: Path) -> tuple[CertAuthority, CertAuthority, CertAuthority]:
    """team-a's CA, team-b's, and one that may name anyone."""
    return (CertAuthority(tmp_path / "a", "team-a CA"), CertAuthority(tmp_path / "b", "team-b CA"),
            CertAuthority(tmp_path / "any", "any CA"))


def test_a_tenants_ca_names_its_tenants_principals_and_no_others(
        cas: tuple[CertAuthority, CertAuthority, CertAuthority]) -> None:
    a, b, _ = cas
    trust = load_client_trust("", [f"{a.cert}={A}", f"{b.cert}={B}"])
    assert trust.scoped
    own = a.client("a", uri=svid("team-a")).certificate
    assert trust.refusal(own, svid("team-a")) is None  # control: its own namespace
    forged = a.client("forged", uri=svid("team-b")).certificate
    reason, text = trust.refusal(forged, svid("team-b")) or ("", "")
    assert reason == "out_of_scope"
    assert svid("team-b") in text and "team-a CA" in text and A in text
    # the same principal from team-b's own CA is let in: the name is not what is refused
    assert trust.refusal(b.client("b", uri=svid("team-b")).certificate, svid("team-b")) is None
    # a look-alike namespace is another namespace
    refused = trust.refusal(a.client("x", uri=svid("team-ab")).certificate, svid("team-ab"))
    assert refused is not None and refused[0] == "out_of_scope"


def test_a_ca_listed_twice_names_what_either_pattern_admits(
        cas: tuple[CertAuthority, CertAuthority, CertAuthority]) -> None:
    a, _, _ = cas
    trust = load_client_trust("", [f"{a.cert}={A}", f"{a.cert}={B}"])
    for namespace in ("team-a", "team-b"):
        leaf = a.client(namespace, uri=svid(namespace)).certificate
        assert trust.refusal(leaf, svid(namespace)) is None
    leaf = a.client("c", uri=svid("team-c")).certificate
    assert trust.refusal(leaf, svid("team-c")) is not None


def test_client_ca_names_anyone_and_scoping_it_too_is_refused(
        cas: tuple[CertAuthority, CertAuthority, CertAuthority], tmp_path: Path) -> None:
    a, _, anyone = cas
    trust = load_client_trust(anyone.cert, [f"{a.cert}={A}"])
    leaf = anyone.client("b", uri=svid("team-b")).certificate
    assert trust.refusal(leaf, svid("team-b")) is None  # tls.client_ca: any principal
    refused = trust.refusal(a.client("f", uri=svid("team-b")).certificate, svid("team-b"))
    assert refused is not None and refused[0] == "out_of_scope"
    # a CA both unscoped and scoped would name anyone anyway: refused at start, naming it
    both = tmp_path / "both.pem"
    both.write_bytes(Path(a.cert).read_bytes() + Path(anyone.cert).read_bytes())
    with pytest.raises(StartupError, match=r"team-a CA is in tls\.client_ca too"):
        load_client_trust(str(both), [f"{a.cert}={A}"])
    # control: without the overlap the same files load
    load_client_trust(anyone.cert, [f"{a.cert}={A}"])


def test_with_scopes_an_intermediate_of_a_scoped_ca_is_not_trusted(
        cas: tuple[CertAuthority, CertAuthority, CertAuthority], tmp_path: Path) -> None:
    """team-a's CA key signs an intermediate CA of its own, which signs team-b's name: OpenSSL
    would verify the chain (team-a's CA is an anchor), but no listed CA issued the leaf
    directly, so it is refused. Control: the leaf team-a's CA signs directly is let in."""
    a, _, _ = cas
    inter = a.intermediate(tmp_path / "inter", "rogue intermediate")
    leaf = inter.client("rogue", uri=svid("team-a")).certificate
    trust = load_client_trust("", [f"{a.cert}={A}"])
    refused = trust.refusal(leaf, svid("team-a"))
    assert refused is not None and refused[0] == "ca_removed"
    assert trust.refusal(a.client("a", uri=svid("team-a")).certificate, svid("team-a")) is None


def test_the_files_are_read_once_each_and_a_bad_one_is_named(
        cas: tuple[CertAuthority, CertAuthority, CertAuthority], tmp_path: Path) -> None:
    a, b, _ = cas
    server = a.server()
    trust = load_client_trust("", [f"{a.cert}={A}", f"{b.cert}={B}"])
    assert len(trust.anchors) == 2
    server_context(server.cert, server.key, trust)  # OpenSSL takes both CAs
    with pytest.raises(StartupError, match=r"tls.scoped_client_cas .*missing.pem: cannot be used"):
        load_client_trust("", [f"{tmp_path}/missing.pem={A}"])


def test_a_config_with_scoped_cas_only_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "jaild.toml"
    path.write_text(
        '[daemon]\nlisten = ["tls://127.0.0.1:0"]\n'
        f'[tls]\ncert = "/c"\nkey = "/k"\nscoped_client_cas = ["/ca/a.pem={A}", "/ca/b.pem={B}"]\n')
    tls = load_config_file(str(path))["tls"]
    assert tls.scoped_client_cas == (f"/ca/a.pem={A}", f"/ca/b.pem={B}")
    assert tls.client_ca == ""
