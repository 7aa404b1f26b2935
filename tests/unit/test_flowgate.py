"""Who a ``release_to`` or ``approvers`` list names (jaild.daemon.flowgate.names): a pod by
its name or service account only -- never by the uid or groups it chose for itself."""

from __future__ import annotations

import pytest

from jaild.daemon.core.peer import Peer, Principal, PrincipalKind
from jaild.daemon.flowgate import names


def pod(uid: int = 1000, gid: int = 1000, groups: tuple[int, ...] = ()) -> Peer:
    return Peer(pid=10, uid=uid, gid=gid, groups=groups,
                principal=Principal("pod", uid, "2c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5f",
                                    "agents", "agent-1", "runner"))


def test_a_pod_is_never_named_by_the_uid_or_groups_it_chose() -> None:
    # a pod may run as any uid (runAsUser) with any groups (supplementalGroups): uid 0 too
    for entries in (["1000"], ["0"], ["root"], ["@root"], ["@0"]):
        assert not names(entries, pod(uid=int(entries[0]) if entries[0].isdigit() else 0,
                                      gid=0, groups=(0,))), entries
    # the control: the same entries name a local process with that uid
    assert names(["1000"], Peer(pid=10, uid=1000, gid=1000))
    assert names(["0"], Peer(pid=10, uid=0, gid=0))


def test_a_pod_is_named_by_its_name_or_service_account() -> None:
    assert names(["pod:agents/agent-1"], pod())
    assert names(["pod:agents/agent-*"], pod())
    assert names(["serviceaccount:agents/runner"], pod())
    assert names(["serviceaccount:agents/*"], pod())
    assert not names(["pod:other/agent-1", "serviceaccount:agents/builder"], pod())
    assert names(["*"], pod())


def test_a_pod_known_by_its_uid_alone_has_no_name_to_match() -> None:
    bare = Peer(pid=10, uid=1000, gid=1000,
                principal=Principal("pod", 1000, "2c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5f"))
    assert not names(["pod:*", "serviceaccount:*", "1000"], bare)


def test_network_clients_by_principal_only() -> None:
    cert = Peer.of_certificate("ci", "10.0.0.1:5")
    assert names(["principal:ci"], cert) and not names(["principal:cd", "0", "root"], cert)
    assert not names(["*"], cert)  # "*" is every local user and pod, as it always was
    assert names(["*"], Peer(pid=10, uid=1234, gid=1234))


# --------------------------------------------------------------------------- the one matcher
# Principal.named_in is the matcher every list of who goes through (release_to, approvers);
# names() adds only the host's user database, for uids.

AGENT = Principal("pod", 1000, "2c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5f", "agents", "agent-1",
                  "runner")


def test_the_matcher_names_a_network_client_by_principal_exactly() -> None:
    ci = Principal.of_certificate("spiffe://example.org/ci")
    assert ci.named_in(["principal:spiffe://example.org/ci"])
    assert not ci.named_in(["principal:spiffe://example.org/*"])  # no globs: names only
    assert not ci.named_in(["*", "pod:*", "serviceaccount:*", "0"])


def test_the_matcher_names_a_pod_by_each_of_its_forms() -> None:
    assert AGENT.named_in(["pod:agents/agent-1"])
    assert AGENT.named_in(["pod:*/agent-?"])
    assert AGENT.named_in(["serviceaccount:agents/runner"])
    assert AGENT.named_in(["serviceaccount:agents/*"])
    assert AGENT.named_in(["*"])
    # the non-matches: another pod, another account, the pod's name as an account (and
    # back), a network principal's form, a uid
    assert not AGENT.named_in(["pod:agents/agent-2", "serviceaccount:agents/builder",
                               "serviceaccount:agents/agent-1", "pod:agents/runner",
                               "principal:agents/agent-1", "1000", "@root"])
    assert not AGENT.named_in([])


def test_the_matcher_leaves_uids_to_the_user_database() -> None:
    local = Principal.of_uid(1000)
    assert not local.named_in(["*", "1000", "principal:1000", "pod:*", "serviceaccount:*"])
    assert names(["1000"], Peer(pid=10, uid=1000, gid=1000))  # names() asks the database


def test_in_pod_is_the_pod_by_uid_whatever_its_key() -> None:
    assert AGENT.in_pod(AGENT.pod_uid)
    assert not AGENT.in_pod("another-pod-uid")
    by_account = Principal("pod", 1000, AGENT.pod_uid, "agents", "agent-1", "runner",
                           by_account=True)
    assert by_account.key != AGENT.key and by_account.in_pod(AGENT.pod_uid)
    assert not Principal.of_uid(1000).in_pod("")
    assert not Principal.of_certificate("x").in_pod("")


def test_a_principals_kind_is_typed_and_its_word_unchanged() -> None:
    assert AGENT.kind is PrincipalKind.POD  # a word given is made the member
    assert Principal.of_uid(5).kind is PrincipalKind.UID
    assert Principal.of_certificate("x").kind is PrincipalKind.CERT
    assert [p.to_wire()["kind"] for p in (Principal.of_uid(5), AGENT,
                                          Principal.of_certificate("x"))] == [
        "uid", "pod", "cert"]
    assert all(type(p.to_wire()["kind"]) is str
               for p in (Principal.of_uid(5), AGENT, Principal.of_certificate("x")))
    with pytest.raises(ValueError, match="'node'"):
        Principal("node", 0)
