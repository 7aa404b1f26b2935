"""Who a ``release_to`` or ``approvers`` list names (jaild.daemon.flowgate.names): a pod by
its name or service account only -- never by the uid or groups it chose for itself."""

from __future__ import annotations

from jaild.daemon.core.peer import Peer, Principal
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
