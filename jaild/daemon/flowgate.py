"""Who a job's information-flow withholding spares (``[[flow.sink]] release_to``).

The rules themselves are :mod:`jaild.policy.flow`; the broker (labels, tool sinks), the
gateway (egress) and the jail's end (result, output, downloads) enforce them.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaild.daemon.core.peer import ENTRY_PREFIXES, Peer, PrincipalKind
from jaild.policy.schema import Policy, user_matches


def names(entries: Iterable[str], peer: Peer) -> bool:
    """Does a list of who (``[[flow.sink]] release_to``, ``[approvals] approvers``) name
    ``peer``? A network client: ``principal:NAME`` only. A pod: ``"*"``,
    ``pod:NAMESPACE/NAME`` or ``serviceaccount:NAMESPACE/NAME`` (globs) -- never a uid, a
    user name or a group, which a pod chooses for itself (``runAsUser``,
    ``supplementalGroups``); both by the one matcher, :meth:`Principal.named_in`. A local
    process: ``"*"``, user names, uids, ``@group``."""
    entries = list(entries)
    if peer.principal.kind is not PrincipalKind.UID:
        return peer.principal.named_in(entries)
    plain = [e for e in entries if not e.startswith(ENTRY_PREFIXES)]
    return user_matches(plain, peer.uid, (peer.gid, *peer.groups))


def flow_released(policy: Policy, peer: Peer) -> frozenset[str]:
    """The labels whose ``[[flow.sink]]`` withholding does not apply to ``peer``: it is in
    the sink's ``release_to`` (:func:`names`)."""
    return frozenset(sink.label for sink in policy.flow.sink
                     if sink.release_to and names(sink.release_to, peer))


__all__ = ["flow_released", "names"]
