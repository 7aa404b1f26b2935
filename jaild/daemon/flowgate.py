"""Who a job's information-flow withholding spares (``[[flow.sink]] release_to``).

The rules themselves are :mod:`jaild.policy.flow`; the broker (labels, tool sinks), the
gateway (egress) and the jail's end (result, output, downloads) enforce them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from jaild.daemon.core.peer import Peer
from jaild.policy.schema import Policy, user_matches


def names(entries: Iterable[str], peer: Peer) -> bool:
    """Does a list of who (``[[flow.sink]] release_to``, ``[approvals] approvers``) name
    ``peer``? A network client: ``principal:NAME`` only. A pod: ``"*"``,
    ``pod:NAMESPACE/NAME`` or ``serviceaccount:NAMESPACE/NAME`` (globs) -- never a uid, a
    user name or a group, which a pod chooses for itself (``runAsUser``,
    ``supplementalGroups``). A local process: ``"*"``, user names, uids, ``@group``."""
    entries = list(entries)
    principal = peer.principal
    if principal.kind == "cert":
        return f"principal:{principal.name}" in entries
    if principal.kind == "pod":
        if "*" in entries:
            return True
        if not principal.namespace:  # known by its uid alone: no name to match
            return False
        pod = f"{principal.namespace}/{principal.name}"
        account = f"{principal.namespace}/{principal.service_account}"
        return any(fnmatch.fnmatchcase(pod, e.removeprefix("pod:")) for e in entries
                   if e.startswith("pod:")) or any(
            fnmatch.fnmatchcase(account, e.removeprefix("serviceaccount:")) for e in entries
            if e.startswith("serviceaccount:"))
    plain = [e for e in entries if not e.startswith(("principal:", "pod:", "serviceaccount:"))]
    return user_matches(plain, peer.uid, (peer.gid, *peer.groups))


def flow_released(policy: Policy, peer: Peer) -> frozenset[str]:
    """The labels whose ``[[flow.sink]]`` withholding does not apply to ``peer``: it is in
    the sink's ``release_to`` (:func:`names`)."""
    return frozenset(sink.label for sink in policy.flow.sink
                     if sink.release_to and names(sink.release_to, peer))


__all__ = ["flow_released", "names"]
