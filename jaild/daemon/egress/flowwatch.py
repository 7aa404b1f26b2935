"""The egress gateway's information-flow side (its step 7; :mod:`jaild.policy.flow`).

A :class:`FlowWatch` belongs to one door. It answers which hosts the labels the job holds
*now* close to it (a refusal is a ``403``, kind ``flow``, naming the label and the rule), and
keeps the connections open to hosts so that, when a tool reply brings the job a label,
:meth:`FlowWatch.recheck` cuts every one to a host that label closes: a tunnel opened before
the read carries nothing after it. Every refusal and cut is reported (``on_refused``) for the
run's record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NoReturn

from jaild.errors import EgressRefusal
from jaild.policy.egress import EgressRules
from jaild.policy.flow import ClosedSend, FlowCode, FlowRules

Live = tuple[asyncio.StreamWriter, asyncio.StreamWriter, str, int]
"""A connection open to a host: (jail side, host side, host, port)."""

OnRefused = Callable[[ClosedSend, str, str, FlowCode, str], None]
"""Told of each send the labels closed: (sink, label, ``host:port``, code, why)."""


class FlowWatch:
    """One door's flow checks and open connections (see the module docstring).

    Args:
        rules: the door's egress rules (their ports apply to the sinks' ``egress`` too).
        flow: the policy's flow rules (None, or no sinks: nothing closes).
        labels: the labels the job holds now.
        on_refused: see :data:`OnRefused`.
    """

    def __init__(self, rules: EgressRules, flow: FlowRules | None,
                 labels: Callable[[], frozenset[str]], on_refused: OnRefused) -> None:
        self._rules = rules
        self._flow = flow if flow is not None and flow.sinks else None
        self._labels = labels
        self._on_refused = on_refused
        self._sink_rules: dict[tuple[str, ...], EgressRules] = {}
        self._live: set[Live] = set()

    def closed(self, host: str, port: int) -> tuple[str, str] | None:
        """(label, why) if a label the job holds closes ``host:port`` to it."""
        flow = self._flow
        if flow is None:
            return None
        labels = self._labels()
        if not labels:
            return None
        return flow.egress_refusal(labels, host, port, self._sink_allows)

    def _sink_allows(self, patterns: tuple[str, ...], host: str, port: int) -> bool:
        rules = self._sink_rules.get(patterns)
        if rules is None:
            rules = EgressRules.parse(patterns, self._rules.ports, False)
            self._sink_rules[patterns] = rules
        return rules.target_refusal(host, port) is None

    def check(self, host: str, port: int) -> None:
        """Refuse ``host:port`` if a label the job holds closes it.

        Raises:
            EgressRefusal: ``403``, kind ``flow`` (reported first).
        """
        closed = self.closed(host, port)
        if closed is not None:
            self._refuse(host, port, closed)

    def _refuse(self, host: str, port: int, closed: tuple[str, str]) -> NoReturn:
        self._on_refused(ClosedSend.EGRESS, closed[0], f"{host}:{port}", FlowCode.FLOW_EGRESS,
                         closed[1])
        raise EgressRefusal(403, "flow", closed[1])

    def track(self, writer: asyncio.StreamWriter, up_writer: asyncio.StreamWriter, host: str,
              port: int) -> Live:
        """A connection to ``host`` is open: :meth:`recheck` may cut it. A label that came
        while it was being dialled refuses it now (the host side closed).

        Raises:
            EgressRefusal: as :meth:`check`.
        """
        closed = self.closed(host, port)
        if closed is not None:
            up_writer.close()
            self._refuse(host, port, closed)
        live = (writer, up_writer, host, port)
        self._live.add(live)
        return live

    def forget(self, live: Live) -> None:
        """The connection ``live`` is over (or has nothing more to cut)."""
        self._live.discard(live)

    def recheck(self) -> int:
        """The job holds new labels: cut every open connection to a host they close.
        Returns how many were cut."""
        cut = 0
        for live in list(self._live):
            writer, up_writer, host, port = live
            closed = self.closed(host, port)
            if closed is None:
                continue
            self._live.discard(live)
            cut += 1
            self._on_refused(ClosedSend.EGRESS, closed[0], f"{host}:{port}", FlowCode.FLOW_CUT,
                             f"the connection was cut: {closed[1]}")
            for side in (up_writer, writer):
                side.transport.abort()
        return cut


__all__ = ["FlowWatch", "Live", "OnRefused"]
