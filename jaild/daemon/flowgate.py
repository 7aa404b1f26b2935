"""Who a job's information-flow withholding spares (``[[flow.sink]] release_to``).

The rules themselves are :mod:`jaild.policy.flow`; the broker (labels, tool sinks), the
gateway (egress) and the jail's end (result, output, downloads) enforce them.
"""

from __future__ import annotations

from jaild.daemon.core.peer import Peer
from jaild.policy.schema import Policy, user_matches


def flow_released(policy: Policy, peer: Peer) -> frozenset[str]:
    """The labels whose ``[[flow.sink]]`` withholding does not apply to ``peer``: it is in
    the sink's ``release_to`` (user names, uids, ``@group``, ``principal:NAME``)."""
    out = set()
    principal = peer.principal
    for sink in policy.flow.sink:
        if not sink.release_to:
            continue
        if principal.kind == "cert":
            if f"principal:{principal.name}" in sink.release_to:
                out.add(sink.label)
        elif user_matches([e for e in sink.release_to if not e.startswith("principal:")],
                          peer.uid, (peer.gid, *peer.groups)):
            out.add(sink.label)
    return frozenset(out)


__all__ = ["flow_released"]
