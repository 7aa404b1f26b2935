"""Who is on the other end of a client connection: pure data, read from ``SO_PEERCRED`` by
the server and used by every decision about that client (admission, placement, audit).

A client's *principal* is the tenant the daemon serves it as: what its shares, its zygotes
and warm jails, its audit trail, ``ps``, ``kill`` and ``stats`` are kept by. By default
(``access.identity = "uid"``) that is its uid, as jaild always did. With
``access.identity = "kubernetes"`` it is the client's pod, read from the cgroup the
kubelet put the client process in, so two agent pods running as the same uid are two
tenants, and a pod is one tenant however many uids its containers run as.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Tenant = int | str
"""A principal's key where jails are kept apart (zygotes, warm pools): a uid, or a pod's
``pod-<pod uid>``. The daemon's own (root's) is 0."""


@dataclass(frozen=True)
class Principal:
    """The tenant a client is served as: a uid, or a Kubernetes pod (``kind``)."""

    kind: str
    """``uid`` or ``pod``."""
    uid: int
    """The client's uid (a pod's principal keeps it for file ownership and the audit)."""
    pod_uid: str = ""
    namespace: str = ""
    name: str = ""
    service_account: str = ""

    @classmethod
    def of_uid(cls, uid: int) -> Principal:
        return cls("uid", uid)

    @property
    def key(self) -> Tenant:
        """What shares, zygotes and warm pools are kept by."""
        return self.uid if self.kind == "uid" else f"pod-{self.pod_uid}"

    @property
    def admin(self) -> bool:
        """Root on the daemon's host (not root in a pod): sees and may kill every job."""
        return self.kind == "uid" and self.uid == 0

    @property
    def pod(self) -> str | None:
        """``namespace/name`` of a pod's principal (``/<pod uid>`` for a pod known by its
        uid alone: the daemon has no access to the Kubernetes API); None for a uid's."""
        if self.kind != "pod":
            return None
        return f"{self.namespace}/{self.name}" if self.namespace else f"/{self.pod_uid}"

    def __str__(self) -> str:
        if self.kind == "uid":
            return f"uid {self.uid}"
        return f"pod {self.pod}" if self.namespace else f"pod {self.pod_uid}"

    def to_wire(self) -> dict[str, object]:
        """For the audit log, ``ps`` and ``stats``."""
        if self.kind == "uid":
            return {"kind": "uid", "uid": self.uid}
        return {
            "kind": "pod", "uid": self.uid, "pod_uid": self.pod_uid,
            "namespace": self.namespace, "name": self.name,
            "service_account": self.service_account,
        }


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (from SO_PEERCRED), and as whom it is served."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    principal: Principal = field(default=None)  # type: ignore[assignment]  # set below

    def __post_init__(self) -> None:
        if self.principal is None:
            object.__setattr__(self, "principal", Principal.of_uid(self.uid))

    def __str__(self) -> str:
        if self.principal.kind == "uid":
            return f"uid={self.uid} pid={self.pid}"
        return f"{self.principal} uid={self.uid} pid={self.pid}"


__all__ = ["Peer", "Principal", "Tenant"]
