"""Who is on the other end of a client connection: pure data, read from ``SO_PEERCRED`` by
the server and used by every decision about that client (admission, placement, audit).

A client's *principal* is the tenant the daemon serves it as: what its shares, its zygotes
and warm jails, its audit trail, ``ps``, ``kill`` and ``stats`` are kept by. By default
(``access.identity = "uid"``) that is its uid, as jaild always did. With
``access.identity = "kubernetes"`` it is the client's pod, read from the cgroup the
kubelet put the client process in, so two agent pods running as the same uid are two
tenants, and a pod is one tenant however many uids its containers run as.

A client over the network (a TLS listener, ``daemon.listen``) has no uid: its principal is
the one its verified client certificate names (``kind = "cert"``: the certificate's URI SAN,
such as a SPIFFE ID, else its subject), and ``access.principals`` -- the daemon's and each
policy's -- say which may connect and use what.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

Tenant = int | str
"""A principal's key where jails are kept apart (zygotes, warm pools): a uid, or a pod's
``pod-<pod uid>``. The daemon's own (root's) is 0."""


class PrincipalKind(enum.StrEnum):
    """What a principal is (``Principal.kind``); its value is the word the audit log,
    ``ps`` and ``stats`` carry (``kind`` of :meth:`Principal.to_wire`)."""

    UID = "uid"
    """A local process, served as its uid (``access.identity = "uid"``)."""
    POD = "pod"
    """A Kubernetes pod (``access.identity = "kubernetes"``)."""
    CERT = "cert"
    """A network client, as its verified certificate names it."""


ENTRY_PREFIXES = ("principal:", "pod:", "serviceaccount:")
"""The forms a list of who (``release_to``, ``approvers``) names a network client or a pod
by; every other entry (``"*"`` aside) is a user name, a uid or an ``@group``."""


@dataclass(frozen=True)
class Principal:
    """The tenant a client is served as: a uid, a Kubernetes pod, or the principal a
    network client's certificate names (``kind``)."""

    kind: PrincipalKind
    uid: int
    """The client's uid (a pod's principal keeps it for file ownership and the audit); -1
    for a network client."""
    pod_uid: str = ""
    namespace: str = ""
    name: str = ""
    service_account: str = ""
    by_account: bool = False
    """A pod's principal whose tenant is its service account, not the pod
    (``access.tenant = "serviceaccount"``): every pod of one service account is one tenant."""
    slots: int = 0
    """A pod's request of ``access.slot_resource``: the jobs and sessions it may hold at once
    (admission); 0: it requests none, and the ``limits`` apply."""

    def __post_init__(self) -> None:
        # a word from elsewhere (a test, a record read back) becomes the member, so that
        # ``kind is PrincipalKind.POD`` holds; an unknown word is a ValueError naming it
        object.__setattr__(self, "kind", PrincipalKind(self.kind))

    @classmethod
    def of_uid(cls, uid: int) -> Principal:
        return cls(PrincipalKind.UID, uid)

    @classmethod
    def of_certificate(cls, name: str) -> Principal:
        """A network client, as its verified certificate names it (kept in ``name``)."""
        return cls(PrincipalKind.CERT, -1, name=name)

    @property
    def key(self) -> Tenant:
        """What shares, zygotes and warm pools are kept by (a certificate's principal by a
        digest of its name: the key names cgroups, and a name may hold any character)."""
        if self.kind is PrincipalKind.UID:
            return self.uid
        if self.kind is PrincipalKind.CERT:
            return "cert-" + hashlib.sha256(self.name.encode()).hexdigest()[:16]
        if self.by_account:
            account = f"{self.namespace}/{self.service_account}"
            return "sa-" + hashlib.sha256(account.encode()).hexdigest()[:16]
        return f"pod-{self.pod_uid}"

    @property
    def tenant(self) -> str:
        """The tenant in words (what shares and ownership are counted by): the principal,
        or a pod's service account where the service account is the tenant."""
        if self.by_account:
            return f"service account {self.namespace}/{self.service_account}"
        return str(self)

    @property
    def admin(self) -> bool:
        """Root on the daemon's host (not root in a pod): sees and may kill every job."""
        return self.kind is PrincipalKind.UID and self.uid == 0

    @property
    def pod(self) -> str | None:
        """``namespace/name`` of a pod's principal (``/<pod uid>`` for a pod known by its
        uid alone: the daemon has no access to the Kubernetes API); None for a uid's."""
        if self.kind is not PrincipalKind.POD:
            return None
        return f"{self.namespace}/{self.name}" if self.namespace else f"/{self.pod_uid}"

    def in_pod(self, pod_uid: str) -> bool:
        """Is this the principal of the pod whose uid is ``pod_uid`` (whatever its key)?"""
        return self.kind is PrincipalKind.POD and self.pod_uid == pod_uid

    def named_in(self, entries: Iterable[str]) -> bool:
        """Does a list of who (``[[flow.sink]] release_to``, ``[approvals] approvers``) name
        this principal by a form a principal has (:data:`ENTRY_PREFIXES`)? A network client:
        ``principal:NAME`` only (exactly). A pod: ``"*"``, ``pod:NAMESPACE/NAME`` or
        ``serviceaccount:NAMESPACE/NAME`` (globs); a pod known by its uid alone has no name,
        so only ``"*"``. A uid: never here -- user names, uids and groups need the host's user
        database (:func:`jaild.daemon.flowgate.names`)."""
        entries = list(entries)
        if self.kind is PrincipalKind.CERT:
            return f"principal:{self.name}" in entries
        if self.kind is not PrincipalKind.POD:
            return False
        if "*" in entries:
            return True
        if not self.namespace:  # known by its uid alone: no name to match
            return False
        pod = f"{self.namespace}/{self.name}"
        account = f"{self.namespace}/{self.service_account}"
        for entry in entries:
            if entry.startswith("pod:") and fnmatch.fnmatchcase(pod, entry[len("pod:"):]):
                return True
            if (entry.startswith("serviceaccount:")
                    and fnmatch.fnmatchcase(account, entry[len("serviceaccount:"):])):
                return True
        return False

    def __str__(self) -> str:
        if self.kind is PrincipalKind.UID:
            return f"uid {self.uid}"
        if self.kind is PrincipalKind.CERT:
            return f"principal {self.name}" if self.name else "an unidentified network client"
        return f"pod {self.pod}" if self.namespace else f"pod {self.pod_uid}"

    def to_wire(self) -> dict[str, object]:
        """For the audit log, ``ps`` and ``stats``."""
        if self.kind is PrincipalKind.UID:
            return {"kind": PrincipalKind.UID.value, "uid": self.uid}
        if self.kind is PrincipalKind.CERT:
            return {"kind": PrincipalKind.CERT.value, "principal": self.name}
        return {
            "kind": PrincipalKind.POD.value, "uid": self.uid, "pod_uid": self.pod_uid,
            "namespace": self.namespace, "name": self.name,
            "service_account": self.service_account,
        }


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (from SO_PEERCRED; a network client: its
    certificate and address), and as whom it is served."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    principal: Principal = field(default=None)  # type: ignore[assignment]  # set below
    address: str = ""
    """A network client's address ("HOST:PORT"); "" on the Unix socket."""

    @classmethod
    def of_certificate(cls, name: str, address: str) -> Peer:
        """A network client whose verified certificate names ``name``."""
        return cls(0, -1, -1, (), Principal.of_certificate(name), address)

    def __post_init__(self) -> None:
        if self.principal is None:
            object.__setattr__(self, "principal", Principal.of_uid(self.uid))

    def __str__(self) -> str:
        if self.principal.kind is PrincipalKind.UID:
            return f"uid={self.uid} pid={self.pid}"
        if self.principal.kind is PrincipalKind.CERT:
            return f"{self.principal} from {self.address}"
        return f"{self.principal} uid={self.uid} pid={self.pid}"


__all__ = ["ENTRY_PREFIXES", "Peer", "Principal", "PrincipalKind", "Tenant"]
