"""Whom a connecting client is served as: its principal (a uid, or a Kubernetes pod).

Theory of operation
-------------------
With ``access.identity = "uid"`` (the default) a client's principal is its uid, read from
``SO_PEERCRED``; nothing here runs.

With ``access.identity = "kubernetes"`` it is the client's pod (:class:`PodPrincipals`):

1. **Which process.** ``SO_PEERCRED`` names the pid that connected. Before anything is read
   about it, :func:`jaild.daemon.identity.peer_cgroup` makes sure that pid still means the
   process holding this connection (a pidfd, and the process holds the client end): a pid
   recycled into another pod's process cannot lend that pod's identity.
2. **Which pod.** The kubelet puts every container in a cgroup named after its pod's uid
   (``.../kubepods/burstable/pod<uid>/<container>`` with the cgroupfs driver,
   ``...kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`` with systemd's); the
   pod's uid is read from there (:func:`jaild.daemon.identity.pod_of_cgroup`). Nothing the
   client says (its ``Hello``) enters into it.
3. **Which namespace and service account.** From the Kubernetes API, given access
   (``access.kubernetes_api``): a watch of the node's pods keeps them
   (:class:`jaild.daemon.identity.PodDirectory`). A pod the watch has not brought yet is
   waited for up to ``access.pod_wait_s``; a deleted or terminating pod is refused. With
   ``kubernetes_api = "none"`` a pod is known by its uid alone (no namespace, no service
   account: policies that name namespaces refuse it).
4. **How many jails.** The same pod object says how many of ``access.slot_resource`` the pod
   requests (:func:`jaild.daemon.identity.pod_slots`); the principal carries it
   (``Principal.slots``) and admission holds the pod to it. A pod known by its uid alone
   requests none.
5. **Which tenant.** The pod (``access.tenant = "pod"``), or its service account
   (``"serviceaccount"``: :attr:`Principal.key` is then the account's, so every pod of it
   -- a Deployment's replacement pod too -- owns the same snapshots, parked runs and share).

A client in no pod's cgroup (a process on the node itself) is refused, or served as its uid
(``access.outside_pods``). Every refusal names the pid and the reason.

The daemon must see its clients' pids, so in a pod it runs in the host's pid namespace
(``hostPID: true``, as node agents do): in a pid namespace of its own, ``SO_PEERCRED``
gives 0 for a client outside it, and the client is refused ("its pid is not visible").
"""

from __future__ import annotations

import logging
import socket
from typing import Protocol

from jaild.daemon import identity
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core.peer import Peer, Principal, PrincipalKind
from jaild.errors import PermissionDenied, StartupError

log = logging.getLogger("jaild")


class Principals(Protocol):
    """Resolves a connecting peer's principal (blocking: run it in a thread)."""

    def resolve(self, sock: socket.socket, peer: Peer) -> Principal: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class PodPrincipals:
    """Pods as principals (``access.identity = "kubernetes"``); see the module docstring."""

    def __init__(self, config: DaemonConfig, directory: identity.PodDirectory | None,
                 roots: tuple[str, ...] = identity.DEFAULT_ROOTS) -> None:
        self.outside = config.outside_pods
        self.by_account = config.tenant == "serviceaccount"
        self.wait_s = config.pod_wait_s
        self.directory = directory
        self.roots = roots  # where the kubelet's hierarchy starts: pods are read there only

    @staticmethod
    def kubelet_roots(config: DaemonConfig, bases: list[str] | None = None) -> tuple[str, ...]:
        """The kubelet cgroup roots pods are read at: ``access.kubelet_cgroup_roots``,
        checked, or those found (``/`` if none is).

        Raises:
            ValueError: a configured root below which another user could write, or the
                daemon's cgroup namespace hides the host's paths.
        """
        problem = identity.cgroup_namespace_problem()
        if problem is not None:
            raise ValueError(problem)
        bases = identity.cgroup_bases() if bases is None else bases
        if config.kubelet_cgroup_roots:
            roots = tuple(identity.normalize_root(r) for r in config.kubelet_cgroup_roots)
            why = identity.check_roots(roots, bases)
            if why is not None:
                raise ValueError(f"access.kubelet_cgroup_roots: {why}")
            return roots
        found, refused = identity.detect_roots(bases)
        for why in refused:
            log.warning("a kubelet cgroup hierarchy is not used to tell pods apart: %s", why)
        return tuple(found) or identity.DEFAULT_ROOTS

    @classmethod
    def from_config(cls, config: DaemonConfig) -> PodPrincipals:
        node = config.node
        api = config.kubernetes_api
        directory: identity.PodDirectory | None
        if api == "none":
            directory = None
        elif api == "":
            directory = identity.PodDirectory.in_cluster(
                node, slot_resource=config.slot_resource)
        else:
            directory = identity.PodDirectory(
                api, token_file=config.kubernetes_token_file or None,
                ca_file=config.kubernetes_ca_file or None, node_name=node,
                slot_resource=config.slot_resource,
            )
        return cls(config, directory, cls.kubelet_roots(config))

    def start(self) -> None:
        if self.directory is not None:
            self.directory.start()

    def stop(self) -> None:
        if self.directory is not None:
            self.directory.stop()

    def resolve(self, sock: socket.socket, peer: Peer) -> Principal:
        """The peer's pod, as a principal.

        Raises:
            PermissionDenied: the process cannot be verified, is in no pod (and
                ``outside_pods`` refuses it), or its pod is deleted or unknown.
        """
        who = f"pid {peer.pid} (uid {peer.uid})"
        if peer.pid <= 0:
            raise PermissionDenied(
                f"uid {peer.uid}: the connecting process's pid is not visible to the daemon "
                "(it runs in a pid namespace of its own: give its pod hostPID)"
            )
        try:
            text = identity.peer_cgroup(sock, peer.pid)
        except identity.PeerUnverified as exc:
            raise PermissionDenied(f"cannot verify the connecting process: {exc}") from None
        ref = identity.pod_of_cgroup(text, self.roots)
        if ref is None and identity.in_kubepods(text):  # a pod's, but not as the kubelet names
            raise PermissionDenied(
                f"{who} is in a kubepods cgroup whose name does not say which pod (outside "
                f"the kubelet's cgroup root, {', '.join(self.roots)}: access."
                "kubelet_cgroup_roots; a static pod; or a name jaild does not know): refused "
                "rather than taken for the node's"
            )
        if ref is None:
            if self.outside == "uid":
                return Principal.of_uid(peer.uid)
            raise PermissionDenied(
                f"{who} is in no pod's cgroup; this daemon serves pods only "
                '(access.outside_pods = "refuse")'
            )
        if self.directory is None:
            return Principal(PrincipalKind.POD, peer.uid, ref.pod_uid)  # known by its uid alone
        if self.directory.deleted(ref.pod_uid):
            raise PermissionDenied(f"{who}: its pod {ref.pod_uid} is deleted or terminating")
        pod = self.directory.get(ref.pod_uid, self.wait_s)
        if pod is None:
            why = self.directory.last_error or "not among the node's pods"
            raise PermissionDenied(
                f"{who}: its pod {ref.pod_uid} is unknown to the Kubernetes API ({why}; "
                f"waited {self.wait_s:g} s, access.pod_wait_s)"
            )
        if self.directory.deleted(ref.pod_uid):  # deleted while we waited
            raise PermissionDenied(f"{who}: its pod {ref.pod_uid} is deleted or terminating")
        if not self.directory.has_container(ref.pod_uid, ref.container_id, self.wait_s):
            raise PermissionDenied(
                f"{who}: its cgroup names container {ref.container_id[:12]} of pod "
                f"{pod.namespace}/{pod.name}, which the Kubernetes API does not report as one "
                f"of that pod's containers (waited {self.wait_s:g} s, access.pod_wait_s)"
            )
        return Principal(
            PrincipalKind.POD, peer.uid, pod.uid, pod.namespace, pod.name, pod.service_account,
            by_account=self.by_account,
            slots=pod.slots,
        )


def principals(config: DaemonConfig) -> PodPrincipals | None:
    """The resolver ``access.identity`` asks for (None: uids, from ``SO_PEERCRED`` alone).

    Raises:
        StartupError: ``access.kubernetes_api`` names no API the daemon can use.
    """
    if config.identity != "kubernetes":
        return None
    if config.tenant == "serviceaccount" and config.kubernetes_api == "none":
        raise StartupError(
            'access.tenant = "serviceaccount": a pod\'s service account comes from the '
            'Kubernetes API, and access.kubernetes_api = "none" (set it, or tenant = "pod")'
        )
    try:
        PodPrincipals.kubelet_roots(config)  # checked first: its own message
    except ValueError as exc:
        raise StartupError(f'access.identity = "kubernetes": {exc}') from None
    try:
        return PodPrincipals.from_config(config)
    except (identity.KubeAPIError, ValueError) as exc:
        raise StartupError(
            f"access.identity = \"kubernetes\": access.kubernetes_api: {exc} (set it to the "
            'API server\'s URL, or "none" to know pods by their uid alone)'
        ) from None


__all__ = ["PodPrincipals", "Principals", "principals"]
