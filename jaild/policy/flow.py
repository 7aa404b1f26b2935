"""Information-flow rules: what a job has read decides where it may send.

Theory of operation
-------------------
A tool result may carry *labels* (``private``, ``user:alice``, ``untrusted``, names the
operator chooses): the policy's ``[[flow.source]]`` tables label every result of a tool, a
tool's spec may declare the labels of its results (``ToolSpec.labels``), and a tool host may
add labels to one result (``ClientToolReturned.labels``). The broker adds them to the *job's*
labels the moment the reply passes it, before the jail can read it; labels only accumulate,
within a job and within a session across its runs (and into its snapshots, forks and
parked runs).

Each ``[[flow.sink]]`` says what stays open once a job holds its label:

===============  ==================================================  ======================
sink             rule                                                where it is enforced
===============  ==================================================  ======================
egress           ``egress``: the hosts still reachable (absent:      the gateway: ``403``
                 unchanged; ``[]``: none)                            naming label and rule;
                                                                     tunnels already open
                                                                     to a closed host cut
tools            ``deny_tools`` refused, ``approve_tools`` need      the broker: the call is
                 approval (``"*"``: every tool)                      refused ``flow_denied``
result, output,  ``result``/``output``/``downloads`` = ``withhold``  the daemon, before the
downloads        (or, for result and output, ``redact``: every      client sees them
                 string and bytes value of a reply with the label
                 replaced, :mod:`jaild.policy.redact`; what cannot
                 be redacted is withheld) unless the caller is in
                 ``release_to``
===============  ==================================================  ======================

*Integrity* is the other direction: a tool in ``flow.protect`` (or whose spec says
``protected``) must not get arguments that may depend on untrusted data, so once the job
holds a label of ``flow.untrusted`` its calls are refused (``integrity``) or need approval
(``flow.on_untrusted = "approve"``).

The job is the unit: no byte inside the jail is tracked. Everything the job holds may carry
what it read, which is why labels never leave a job or its session, and why nothing the jail
says -- a frame, a file, its output -- can add or remove one.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jaild.protocol.fields import LABEL, MAX_LABELS

LABEL_RE = re.compile(LABEL + r"\Z")


class Disposition(enum.StrEnum):
    """What a ``[[flow.sink]]`` does to one of a run's :class:`Delivery` s once a job holds
    its label (the word a policy writes: ``result = "withhold"``)."""

    ALLOW = "allow"
    WITHHOLD = "withhold"
    REDACT = "redact"
    """Every string and bytes value of a labelled reply replaced (result and output only)."""


class Delivery(enum.StrEnum):
    """What the daemon hands a run's caller at its end, which a sink may close (the keys of
    :meth:`FlowRules.withheld`; ``FlowRecord.withheld`` and ``redacted``)."""

    RESULT = "result"
    OUTPUT = "output"
    DOWNLOADS = "downloads"


class FlowCode(enum.StrEnum):
    """Why the flow rules closed a send (``FlowRefusal.code``; a refused tool call's
    ``error_type``)."""

    FLOW_DENIED = "flow_denied"
    """A tool of a sink's ``deny_tools``."""
    FLOW_APPROVAL = "flow_approval"
    """A tool of a sink's ``approve_tools``: sent for approval."""
    INTEGRITY = "integrity"
    """A protected tool called by a job holding untrusted data."""
    FLOW_EGRESS = "flow_egress"
    """A gateway request to a host a sink's ``egress`` closes."""
    FLOW_CUT = "flow_cut"
    """A connection already open to such a host, cut when the label came."""


class ClosedSend(enum.StrEnum):
    """Which send the flow rules closed (``FlowRefusal.sink``)."""

    EGRESS = "egress"
    """A gateway request refused, or a connection cut."""
    TOOL = "tool"
    """A tool call refused."""
    APPROVAL = "approval"
    """A tool call sent for approval because of a label."""


class OnUntrusted(enum.StrEnum):
    """``flow.on_untrusted``: what a protected tool called with untrusted data held gets."""

    REFUSE = "refuse"
    APPROVE = "approve"


DISPOSITIONS = tuple(Disposition)
SINKS = tuple(Delivery)
MIN_REDACTED_CHARS = 4
"""Shorter strings of a labelled reply are not redacted (they would blank every ``a``)."""
MAX_SECRETS = 4096
"""Values of labelled replies a job (a session) keeps for redaction; past it, or past
:data:`MAX_SECRET_BYTES`, its redaction is exhausted and ``redact`` withholds."""
MAX_SECRET_BYTES = 4 << 20


@dataclass(frozen=True)
class FlowSource:
    """One ``[[flow.source]]``: every result of ``tool`` (a glob) carries ``labels``."""

    tool: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class FlowSink:
    """One ``[[flow.sink]]``: what stays open once a job holds ``label``."""

    label: str
    egress: tuple[str, ...] | None = None
    deny_tools: tuple[str, ...] = ()
    approve_tools: tuple[str, ...] = ()
    result: Disposition = Disposition.ALLOW
    output: Disposition = Disposition.ALLOW
    downloads: Disposition = Disposition.ALLOW
    release_to: tuple[str, ...] = ()

    def describe(self) -> str:
        """This rule in words (``policy explain``, the code-mode prompt)."""
        parts = []
        if self.egress is not None:
            parts.append("egress only to " + ", ".join(self.egress) if self.egress
                         else "no egress")
        if self.deny_tools:
            parts.append("tools refused: " + ", ".join(self.deny_tools))
        if self.approve_tools:
            parts.append("tools needing approval: " + ", ".join(self.approve_tools))
        for how in (Disposition.WITHHOLD, Disposition.REDACT):
            held = [s for s in SINKS if getattr(self, s) == how]
            if held:
                verb = f"{how}{'e' if how == Disposition.REDACT else ''}d"
                parts.append(" and ".join(held) + f" {verb}"
                             + (f" (except for {', '.join(self.release_to)})"
                                if self.release_to else ""))
        return f"once a job holds {self.label!r}: " + ("; ".join(parts) or "nothing closes")


def check_labels(labels: Iterable[Any], what: str) -> str | None:
    """Why ``labels`` are not valid label names (None: they are)."""
    items = list(labels)
    if len(items) > MAX_LABELS:
        return f"{what}: at most {MAX_LABELS} labels, got {len(items)}"
    for item in items:
        if not isinstance(item, str) or not LABEL_RE.match(item):
            return f"{what}: {item!r} is not a label (lower case, digits, _.:@-, 1-64 chars)"
    return None


def _strings(raw: Any, key: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ValueError(f"{key}: must be a list of strings, got {raw!r}")
    return tuple(raw)


def parse_source(raw: Any) -> FlowSource:
    """One ``[[flow.source]]`` table. Raises ValueError naming the key."""
    if not isinstance(raw, dict):
        raise ValueError("must be a table {tool, labels}")
    unknown = set(raw) - {"tool", "labels"}
    if unknown:
        raise ValueError(f"{min(unknown)}: unknown key; accepts tool, labels")
    tool = raw.get("tool")
    if not isinstance(tool, str) or not tool:
        raise ValueError(f"tool: must be a tool name or glob, got {tool!r}")
    labels = _strings(raw.get("labels"), "labels")
    why = check_labels(labels, "labels")
    if why is not None or not labels:
        raise ValueError(why or "labels: must name at least one label")
    return FlowSource(tool, labels)


def parse_sink(raw: Any) -> FlowSink:
    """One ``[[flow.sink]]`` table. Raises ValueError naming the key."""
    if not isinstance(raw, dict):
        raise ValueError("must be a table {label, egress, deny_tools, ...}")
    known = ("label", "egress", "deny_tools", "approve_tools", *SINKS, "release_to")
    unknown = set(raw) - set(known)
    if unknown:
        raise ValueError(f"{min(unknown)}: unknown key; accepts {', '.join(known)}")
    label = raw.get("label")
    if not isinstance(label, str) or check_labels([label], "label") is not None:
        raise ValueError(f"label: {label!r} is not a label (lower case, digits, _.:@-)")
    values: dict[str, Any] = {"label": label}
    if "egress" in raw:
        values["egress"] = _strings(raw["egress"], "egress")
    for key in ("deny_tools", "approve_tools", "release_to"):
        if key in raw:
            values[key] = _strings(raw[key], key)
    for key in SINKS:
        if key in raw:
            allowed = DISPOSITIONS if key != Delivery.DOWNLOADS else DISPOSITIONS[:2]
            if not isinstance(raw[key], str) or raw[key] not in allowed:
                raise ValueError(f"{key}: must be one of {', '.join(allowed)}, got "
                                 f"{raw[key]!r}")
            values[key] = Disposition(raw[key])
    return FlowSink(**values)


@dataclass(frozen=True)
class FlowPlan:
    """One ``[[flow.plan]]``: a protected ``tool`` (a glob) that a job holding untrusted data
    may still call -- once per *intent* the job declared before it held any, with every
    argument as that intent pinned it, except the ``free`` ones (see :class:`Intent`)."""

    tool: str
    free: tuple[str, ...] = ()

    def describe(self) -> str:
        free = f" ({', '.join(self.free)} may follow the data)" if self.free else ""
        return (f"{self.tool}: callable with untrusted data held exactly as the job planned "
                f"it before{free}")

    def pins(self, intended: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
        """What an intent pins: the values it names, and every other argument of the tool's
        ``schema`` that is not free as *absent* (None: the call must not give it)."""
        pinned = dict(intended)
        for arg in (schema.get("properties") or ()):
            if arg not in pinned and arg not in self.free:
                pinned[arg] = None
        return pinned


def parse_plan(raw: Any) -> FlowPlan:
    """One ``[[flow.plan]]`` table. Raises ValueError naming the key."""
    if not isinstance(raw, dict):
        raise ValueError("must be a table {tool, free}")
    unknown = set(raw) - {"tool", "free"}
    if unknown:
        raise ValueError(f"{min(unknown)}: unknown key; accepts tool, free")
    tool = raw.get("tool")
    if not isinstance(tool, str) or not tool:
        raise ValueError(f"tool: must be a tool name or glob, got {tool!r}")
    return FlowPlan(tool, _strings(raw.get("free", []), "free"))


INTEND_TOOL = "@intend"
"""The name the jail's ``tools.intend(tool, **pinned)`` calls: answered by the broker, never
routed (no tool host's tool can have it: tool names are identifiers)."""
MAX_INTENTS = 64


@dataclass
class Intent:
    """A call the job planned before it read untrusted data: its tool and the values it
    pinned. Used at most once, by the first protected call after the taint that matches."""

    tool: str
    pinned: dict[str, Any]
    used: bool = False

    def matches(self, tool: str, given: Mapping[str, Any]) -> bool:
        return (not self.used and tool == self.tool
                and all(given.get(k) == v for k, v in self.pinned.items()))


@dataclass(frozen=True)
class ToolVerdict:
    """What the flow rules say of one call: refuse it, or ask for approval, and why."""

    refuse: bool
    code: FlowCode  # FLOW_DENIED | FLOW_APPROVAL | INTEGRITY
    label: str
    message: str


@dataclass
class FlowRules:
    """A policy's ``[flow]``, compiled for the broker and the gateway."""

    sources: tuple[FlowSource, ...] = ()
    sinks: Mapping[str, tuple[FlowSink, ...]] = field(default_factory=dict)
    untrusted: frozenset[str] = frozenset({"untrusted"})
    protect: tuple[str, ...] = ()
    on_untrusted: OnUntrusted = OnUntrusted.REFUSE
    policy: str = ""
    plans: tuple[FlowPlan, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.sources or self.sinks or self.protect)

    def source_labels(self, tool: str) -> frozenset[str]:
        """The labels the policy puts on every result of ``tool``."""
        return frozenset(label for s in self.sources if fnmatch.fnmatchcase(tool, s.tool)
                         for label in s.labels)

    def closing(self, labels: Iterable[str]) -> list[FlowSink]:
        """The sink rules of the labels held."""
        return [sink for label in sorted(set(labels)) for sink in self.sinks.get(label, ())]

    def plan(self, tool: str) -> FlowPlan | None:
        """The ``[[flow.plan]]`` of ``tool`` (the first that names it), if any."""
        return next((p for p in self.plans if fnmatch.fnmatchcase(tool, p.tool)), None)

    def tool_verdict(self, labels: frozenset[str], tool: str, protected: bool = False,
                     planned: Any = lambda: False) -> ToolVerdict | None:
        """A call of ``tool`` by a job holding ``labels``: refused, needing approval, or
        None (the flow rules leave it alone). A refusal wins over an approval.
        ``planned()``: asked only when integrity would stop the call -- does it match an
        intent the job declared before it held untrusted data (and use it up)? Then
        integrity lets it through; the sinks' rules still apply."""
        approve: ToolVerdict | None = None
        for sink in self.closing(labels):
            if _matches(tool, sink.deny_tools):
                return ToolVerdict(True, FlowCode.FLOW_DENIED, sink.label, (
                    f"{tool} is closed to a job holding label {sink.label!r} (policy "
                    f"{self.policy!r}, [[flow.sink]] label = {sink.label!r}: deny_tools)"))
            if approve is None and _matches(tool, sink.approve_tools):
                approve = ToolVerdict(False, FlowCode.FLOW_APPROVAL, sink.label, (
                    f"{tool} needs approval for a job holding label {sink.label!r} (policy "
                    f"{self.policy!r}, [[flow.sink]] label = {sink.label!r}: approve_tools)"))
        if protected or _matches(tool, self.protect):
            tainted = sorted(labels & self.untrusted)
            if tainted and not planned():
                verdict = ToolVerdict(
                    self.on_untrusted == OnUntrusted.REFUSE, FlowCode.INTEGRITY, tainted[0], (
                    f"{tool} is protected: its arguments must not depend on untrusted data, "
                    f"and this job holds {tainted[0]!r} (policy {self.policy!r}, flow.protect; "
                    f"flow.on_untrusted = {self.on_untrusted!r})"))
                if verdict.refuse:
                    return verdict
                approve = approve or verdict
        return approve

    def egress_refusal(self, labels: frozenset[str], host: str, port: int,
                       allowed: Any) -> tuple[str, str] | None:
        """A request to ``host:port`` by a job holding ``labels``: ``(label, why)`` if a
        label's sink closes it. ``allowed(patterns, host, port)``: does one of the egress
        patterns name the target."""
        for sink in self.closing(labels):
            if sink.egress is None or allowed(sink.egress, host, port):
                continue
            still = ", ".join(sink.egress) or "no host"
            return sink.label, (
                f"egress to {host}:{port} is closed to a job holding label {sink.label!r} "
                f"(policy {self.policy!r}, [[flow.sink]] label = {sink.label!r}: egress = "
                f"{list(sink.egress)!r}); still open to it: {still}")
        return None

    def withheld(self, labels: frozenset[str], released: Any,
                 how: Disposition | str = Disposition.WITHHOLD) -> dict[str, str]:
        """Which of result/output/downloads (:class:`Delivery`, the keys) are withheld
        (``how = REDACT``: redacted) from the caller, each with the (first) label that says
        so. ``released(label)``: is the caller in that label's sink's ``release_to``.

        Raises:
            ValueError: ``how`` is not a :class:`Disposition`'s word.
        """
        how = Disposition(how)
        out: dict[str, str] = {}
        for sink in self.closing(labels):
            if sink.release_to and released(sink.label):
                continue
            for what in SINKS:
                if getattr(sink, what) == how and what not in out:
                    out[what] = sink.label
        return out

    def redacting(self, labels: Iterable[str]) -> frozenset[str]:
        """Those of ``labels`` whose sinks redact something: a reply carrying one has its
        strings kept, to be redacted."""
        return frozenset(label for label in labels for sink in self.sinks.get(label, ())
                         if Disposition.REDACT in (sink.result, sink.output))

    def describe(self) -> list[str]:
        """Every rule in words."""
        lines = [f"results of {s.tool} carry {', '.join(s.labels)}" for s in self.sources]
        lines += [sink.describe() for sinks in self.sinks.values() for sink in sinks]
        lines += [plan.describe() for plan in self.plans]
        if self.protect:
            refused = self.on_untrusted == OnUntrusted.REFUSE
            lines.append(f"{', '.join(self.protect)}: "
                         f"{'refused' if refused else 'need approval'} "
                         f"once a job holds {', '.join(sorted(self.untrusted))}")
        return lines


def strings_of(value: Any, out: set[str | bytes], budget: list[int]) -> bool:
    """Collect the str and bytes values (at least :data:`MIN_REDACTED_CHARS` characters or
    bytes long; not a map's keys) of an unpacked reply into ``out``, within ``budget`` =
    [values left, bytes left (UTF-8)], which it spends; iteratively (a reply may be deep).

    Returns:
        True if every one fitted the budget; False if one did not (and with it the budget
        is spent): the job's redaction is *exhausted* and what its labels redact must be
        withheld instead (:mod:`jaild.policy.redact`, docs/using/flow.md).
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            if len(item) >= MIN_REDACTED_CHARS and item not in out:
                size = len(item.encode("utf-8", "surrogatepass") if isinstance(item, str)
                           else item)
                if budget[0] < 1 or budget[1] < size:
                    budget[0] = budget[1] = 0
                    return False
                out.add(item)
                budget[0] -= 1
                budget[1] -= size
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):  # its values: keys are the reply's shape, not its data
            stack.extend(item.values())
    return True


def _matches(tool: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(tool, p) for p in patterns)


def compile_flow(policy: str, sources: tuple[FlowSource, ...], sinks: tuple[FlowSink, ...],
                 untrusted: tuple[str, ...], protect: tuple[str, ...],
                 on_untrusted: str, plans: tuple[FlowPlan, ...] = ()) -> FlowRules:
    by_label: dict[str, list[FlowSink]] = {}
    for sink in sinks:
        by_label.setdefault(sink.label, []).append(sink)
    return FlowRules(sources, {k: tuple(v) for k, v in by_label.items()},
                     frozenset(untrusted), protect, OnUntrusted(on_untrusted), policy, plans)


__all__ = [
    "INTEND_TOOL", "LABEL", "MAX_INTENTS", "MAX_LABELS", "ClosedSend", "Delivery", "Disposition",
    "FlowCode", "FlowPlan", "FlowRules", "FlowSink", "FlowSource", "Intent", "OnUntrusted",
    "ToolVerdict", "check_labels", "compile_flow", "parse_plan",
    "parse_sink", "parse_source",
]
