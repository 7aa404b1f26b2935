"""A door's flow side (jaild.daemon.egress.flowwatch): refusals by the labels held now, and
the cut of the connections open to a host a new label closes. The door's own tests
(test_egress_gateway) drive it through real sockets; these hold it to its parts."""

from __future__ import annotations

from typing import Any, cast

import pytest

from jaild.daemon.egress.flowwatch import FlowWatch
from jaild.errors import EgressRefusal
from jaild.policy.egress import EgressRules
from jaild.policy.flow import ClosedSend, FlowCode, compile_flow, parse_sink


class Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class Writer:
    def __init__(self) -> None:
        self.transport = Transport()
        self.closed = False

    def close(self) -> None:
        self.closed = True


def watch(labels: set[str], refused: list[tuple[Any, ...]]) -> FlowWatch:
    rules = EgressRules.parse(["a.example", "b.example"], (443,), False)
    flow = compile_flow("web", (), (parse_sink({"label": "private", "egress": ["a.example"]}),),
                        (), (), "refuse")
    return FlowWatch(rules, flow, lambda: frozenset(labels),
                     lambda *args: refused.append(args))


def test_a_host_a_held_label_closes_is_refused_and_reported() -> None:
    labels: set[str] = set()
    refused: list[tuple[Any, ...]] = []
    w = watch(labels, refused)
    w.check("b.example", 443)  # no label yet: open
    labels.add("private")
    w.check("a.example", 443)  # still open to it
    with pytest.raises(EgressRefusal) as info:
        w.check("b.example", 443)
    assert (info.value.status, info.value.kind) == (403, "flow")
    assert [r[:4] for r in refused] == [
        (ClosedSend.EGRESS, "private", "b.example:443", FlowCode.FLOW_EGRESS)]


def test_no_sinks_close_nothing() -> None:
    w = FlowWatch(EgressRules.parse(["b.example"], (443,), False), None,
                  lambda: frozenset({"private"}), lambda *_: None)
    assert w.closed("b.example", 443) is None


def test_a_new_label_cuts_the_open_connections_it_closes_and_only_those() -> None:
    labels: set[str] = set()
    refused: list[tuple[Any, ...]] = []
    w = watch(labels, refused)
    jail_b, host_b, jail_a, host_a = Writer(), Writer(), Writer(), Writer()
    w.track(cast(Any, jail_b), cast(Any, host_b), "b.example", 443)
    w.track(cast(Any, jail_a), cast(Any, host_a), "a.example", 443)
    assert w.recheck() == 0 and not refused  # the control: no label, nothing cut
    labels.add("private")
    assert w.recheck() == 1
    assert jail_b.transport.aborted and host_b.transport.aborted
    assert not (jail_a.transport.aborted or host_a.transport.aborted)
    assert [r[:4] for r in refused] == [
        (ClosedSend.EGRESS, "private", "b.example:443", FlowCode.FLOW_CUT)]
    assert w.recheck() == 0  # cut once


def test_a_connection_forgotten_is_not_cut_and_one_dialled_into_a_label_is_refused() -> None:
    labels: set[str] = set()
    refused: list[tuple[Any, ...]] = []
    w = watch(labels, refused)
    jail, host = Writer(), Writer()
    live = w.track(cast(Any, jail), cast(Any, host), "b.example", 443)
    w.forget(live)
    labels.add("private")
    assert w.recheck() == 0 and not jail.transport.aborted
    late = Writer()
    with pytest.raises(EgressRefusal):
        w.track(cast(Any, Writer()), cast(Any, late), "b.example", 443)
    assert late.closed and [r[3] for r in refused] == [FlowCode.FLOW_EGRESS]
