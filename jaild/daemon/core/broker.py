"""The tool broker: every rule a jail's tool call must pass, as pure code.

Theory of operation
-------------------
A jailed job calls the client's tools through the daemon. Every ``CallTool``
frame is hostile input, so before any handler runs the call must pass, in this
order (the first failing check decides the answer):

=====================  ==============================================  ==================
check                  refused when                                    answer
=====================  ==============================================  ==================
call id                it collides with a call still in flight         the job is killed
                                                                       (``channel_error``)
call quota             ``limits.tool_calls`` calls already made        ``quota_exceeded``
tool name              no tool of that name was registered             ``unknown_tool``
in-flight cap          ``limits.tool_calls_in_flight`` calls pending   ``too_many_calls``
traffic quota          the arguments pass ``limits.tool_bytes``        ``quota_exceeded``
arguments              they do not fit the tool's JSON schema          ``invalid_arguments``
=====================  ==============================================  ==================

Every call the jail makes counts against ``limits.tool_calls``, refused or not: a job
that keeps calling an unknown tool (or calls past a refusal) uses up its quota like
one whose calls succeed, and every call after that is refused ``quota_exceeded``.
The refusal codes are :data:`REFUSALS` (the audit summarises them per job).

An admitted call is routed to the client with whether it needs approval (the
tool asks for it, or the policy does) and its timeout (the policy's
``tool_call_timeout_s``, shortened by the tool's own). Its reply passes two
more checks: a value larger than ``limits.tool_payload_bytes`` becomes
``payload_too_large``, and one that takes the job's traffic past
``limits.tool_bytes`` becomes ``quota_exceeded``.

Every refused or answered call is one entry of the call log (the record's
``tool_calls``), up to :data:`MAX_CALL_RECORDS`; further calls are only counted
(``tool_calls_omitted``). A call withdrawn because its job ended is not logged.

Schemas are compiled once each. Those a tool's signature makes (an object of named,
simply typed properties) also get a plain-Python check (:func:`quick_check`, ~1 µs
against jsonschema's ~10): it passes only calls jsonschema passes, and leaves every
other call -- and every error message -- to jsonschema.

Information flow (:mod:`jaild.policy.flow`): every reply a tool gives adds its labels -- the
policy's ``[[flow.source]]`` ones for the tool, the tool spec's, and the reply's own -- to the
broker's :attr:`Broker.labels` before the jail can read it. The labels belong to the jail
(one job, or a session's runs): :meth:`Broker.new_run` keeps them, and nothing the jail sends
changes them. An admitted call then passes the flow rules of the labels held: refused
(``flow_denied``, ``integrity``) or sent for approval; each such decision is listed in
:attr:`Broker.flow_refusals` for the run's record. A reply with a label whose sink redacts
leaves its str and bytes values in :attr:`Broker.secrets`, within a budget; one that does not
fit sets :attr:`Broker.redaction_exhausted`, and ``redact`` withholds from then on.

The broker does no IO and keeps no clock: durations are given to it.
:class:`Broker` has three verbs: :meth:`Broker.admit` a call, :meth:`Broker.answer`
it (or :meth:`Broker.withdraw` it), and :meth:`Broker.new_run` for a session's next
run (which starts the counts afresh).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from jaild.daemon.core.disclosure import UNKNOWN_TOOL
from jaild.errors import RemoteProtocolError
from jaild.policy.flow import (
    INTEND_TOOL,
    MAX_INTENTS,
    MAX_SECRET_BYTES,
    MAX_SECRETS,
    ClosedSend,
    FlowCode,
    FlowRules,
    Intent,
    strings_of,
)
from jaild.policy.schema import Limits
from jaild.protocol import pack, unpack
from jaild.protocol.messages import ToolSpec
from jaild.protocol.records import MAX_CALL_RECORDS

_CACHE_MAX = 4096

REFUSALS = frozenset(
    {"unknown_tool", "too_many_calls", "quota_exceeded", "invalid_arguments", "payload_too_large"}
)
"""The error types the broker answers a call with itself (no handler ran, or its result
was refused): unbounded in number only through a job's quota, and audited in summary."""


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True, slots=True)
class Refused:
    """Answer the call with ``ToolFailed(error_type, message)`` now; no handler runs."""

    call_id: int
    name: str
    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class Answered:
    """Answer the call with ``ToolReturned(value)`` now: the broker's own (an intent)."""

    call_id: int
    name: str
    value: bytes


@dataclass(frozen=True, slots=True)
class Admitted:
    """Route the call to the client; answer it within ``timeout_s``."""

    call_id: int
    name: str
    args: bytes
    needs_approval: bool
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Violation:
    """The jail broke the channel's rules: kill the job (``channel_error``)."""

    message: str


@dataclass(frozen=True, slots=True)
class Answer:
    """What to send the jail for a finished call: ``ToolReturned(value)`` when ``ok``,
    else ``ToolFailed(error_type, message)``."""

    call_id: int
    name: str
    ok: bool
    value: bytes = b""
    error_type: str = ""
    message: str = ""
    args_bytes: int = 0
    """The size of the call's packed arguments (for the observers: traces)."""
    result_bytes: int = 0
    """The size of the packed value returned (0 unless ``ok``)."""
    labels_added: frozenset[str] = frozenset()
    """Labels the job holds from this reply on that it did not before."""

    @property
    def outcome(self) -> str:
        """``ok`` or the error type (for audit and metrics)."""
        return "ok" if self.ok else self.error_type


# --------------------------------------------------------------------------- schemas


_MISSING = object()
_SIMPLE_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: type(v) is str,
    "integer": lambda v: type(v) is int,  # not bool; an integral float is left to jsonschema
    "number": lambda v: type(v) is int or type(v) is float,
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
    "array": lambda v: type(v) is list,
    "object": lambda v: type(v) is dict,
}
_ANNOTATIONS = frozenset({"description", "title", "default", "examples"})
_QUICK_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties"}


def quick_check(schema: dict[str, Any]) -> Callable[[dict[str, Any]], bool] | None:
    """A plain-Python check of the schemas tool signatures make -- an object of named
    properties, each of one simple type or any, some required, others maybe forbidden --
    or None for any other schema.

    It is only ever a shortcut: True where jsonschema would find the arguments valid
    (nothing it does not check stricter, e.g. ``1.0`` is not an integer here), False
    where it cannot tell -- and then jsonschema decides, and words the error."""
    if not schema.keys() <= _QUICK_KEYS or schema.get("type") != "object":
        return None
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    if type(properties) is not dict or type(required) is not list or type(extra) is not bool:
        return None
    if not all(type(name) is str for name in required):
        return None
    tests: dict[str, Callable[[Any], bool] | None] = {}
    for name, sub in properties.items():
        if type(sub) is not dict or not sub.keys() <= _ANNOTATIONS | {"type"}:
            return None
        kind = sub.get("type")
        if kind is None:
            tests[name] = None  # any value
        elif type(kind) is str and kind in _SIMPLE_TYPES:
            tests[name] = _SIMPLE_TYPES[kind]
        else:
            return None
    needed = tuple(required)

    def check(instance: dict[str, Any]) -> bool:
        for name in needed:
            if name not in instance:
                return False
        for name, value in instance.items():
            test = tests.get(name, _MISSING)
            if test is _MISSING:
                if not extra:
                    return False
            elif test is not None and not test(value):  # type: ignore[operator]
                return False
        return True

    return check


class Validators:
    """Compiled JSON-schema validators, one per distinct schema (clients send the same
    schemas again and again, so they are compiled once): jsonschema's, and for the
    schemas tool signatures make, a plain-Python shortcut (:func:`quick_check`) that
    answers a valid call without it."""

    def __init__(self) -> None:
        self._by_text: dict[str, Any] = {}
        self._quick: dict[str, Callable[[dict[str, Any]], bool] | None] = {}
        self._keys: dict[int, tuple[dict[str, Any], str]] = {}

    def _key(self, schema: dict[str, Any]) -> str:
        key = self._keys.get(id(schema))
        if key is None or key[0] is not schema:
            key = (schema, json.dumps(schema, sort_keys=True, default=repr))
            if len(self._keys) > _CACHE_MAX:
                self._keys.clear()
            self._keys[id(schema)] = key
        return key[1]

    def validator(self, schema: dict[str, Any]) -> Any:
        """The validator of ``schema``. Raises jsonschema's SchemaError if it is not one."""
        text = self._key(schema)
        validator = self._by_text.get(text)
        if validator is None:
            from jsonschema import validators

            cls = validators.validator_for(schema)
            cls.check_schema(schema)
            validator = cls(schema)
            if len(self._by_text) > _CACHE_MAX:
                self._by_text.clear()
            self._by_text[text] = validator
        return validator

    def quick(self, schema: dict[str, Any]) -> Callable[[dict[str, Any]], bool] | None:
        """:func:`quick_check` of ``schema``, made once per distinct schema."""
        text = self._key(schema)
        if text not in self._quick:
            if len(self._quick) > _CACHE_MAX:
                self._quick.clear()
            self._quick[text] = quick_check(schema)
        return self._quick[text]

    def check_arguments(
        self, schema: dict[str, Any], tool: str, packed: bytes
    ) -> tuple[str, str] | None:
        """Check a call's packed ``[args, kwargs]`` against the tool's JSON schema: None if
        they fit (or the tool has no schema), else ("invalid_arguments", why) naming the
        argument."""
        if not schema:
            return None
        try:
            decoded = unpack(packed)
        except RemoteProtocolError as exc:
            return ("invalid_arguments", f"{tool}: undecodable arguments: {exc.message}")
        if not (
            isinstance(decoded, list)
            and len(decoded) == 2
            and isinstance(decoded[0], list)
            and isinstance(decoded[1], dict)
        ):
            return ("invalid_arguments", f"{tool}: arguments must be [args, kwargs]")
        args, kwargs = decoded
        names = list(schema.get("properties") or {})
        if len(args) > len(names):
            return (
                "invalid_arguments",
                f"{tool} takes at most {len(names)} positional argument(s) "
                f"({', '.join(names) or 'none'}); got {len(args)}",
            )
        instance = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key in instance:
                return ("invalid_arguments", f"{tool}: argument {key!r} given twice")
            instance[key] = value
        quick = self.quick(schema)
        if quick is not None and quick(instance):
            return None
        return schema_error(tool, self.validator(schema), instance)


def schema_error(tool: str, validator: Any, instance: dict[str, Any]) -> tuple[str, str] | None:
    """("invalid_arguments", message naming the argument) for the most relevant error."""
    if validator.is_valid(instance):
        return None
    from jsonschema.exceptions import best_match

    error = best_match(validator.iter_errors(instance))
    if error is None:
        return None
    where = "".join(
        f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
        for i, p in enumerate(error.absolute_path)
    )
    what = f"argument {where!r}: " if where else ""
    return ("invalid_arguments", f"{tool}: {what}{error.message}"[:4096])


# --------------------------------------------------------------------------- the broker


class Broker:
    """The tool rules of one job (or of one session's runs, see :meth:`new_run`).

    Args:
        tools: the tools the client registered for the job.
        limits: the job's limits (``tool_calls``, ``tool_bytes``, ``tool_calls_in_flight``,
            ``tool_payload_bytes``, ``tool_call_timeout_s``).
        approval_required: which tool names the policy says need approval
            (``Policy.needs_approval``).
        validators: the shared schema cache (a fresh one if omitted).
        flow: the policy's information-flow rules (none if omitted).
        labels: the labels the jail holds from its start (a restored state's).
    """

    def __init__(
        self,
        tools: tuple[ToolSpec, ...],
        limits: Limits,
        approval_required: Callable[[str], bool] = lambda _: False,
        validators: Validators | None = None,
        flow: FlowRules | None = None,
        *,
        labels: Iterable[str] = (),
    ) -> None:
        self._validators = validators if validators is not None else Validators()
        self.in_flight: dict[int, tuple[str, int]] = {}  # call id -> (tool name, args' bytes)
        # the jail's: held from its start (a restored state's), every run of it, never reset
        self.labels: set[str] = set(labels)
        # str and bytes values of replies with a redacting label -> it
        self.secrets: dict[str | bytes, str] = {}
        self._secret_budget = [MAX_SECRETS, MAX_SECRET_BYTES]
        self.flow = flow if flow is not None else FlowRules()
        # A reply's values did not fit the budget, or labels came without their values (a
        # restored state's): ``redact`` cannot be done, it withholds, for the jail's life.
        self.redaction_exhausted = bool(self.labels and self.flow.redacting(self.labels))
        # [[flow.plan]]: the calls the job planned before it held untrusted data
        self.intents: list[Intent] = []
        self.set_job(tools, limits, approval_required)
        self.new_run()

    def set_job(
        self,
        tools: tuple[ToolSpec, ...],
        limits: Limits,
        approval_required: Callable[[str], bool] = lambda _: False,
        flow: FlowRules | None = None,
    ) -> None:
        """The tools and limits of the job now served (a pooled or session jail's next);
        ``flow``: its policy's flow rules."""
        self.limits = limits
        if flow is not None:
            self.flow = flow
        self._tools: Mapping[str, ToolSpec] = {t.name: t for t in tools}
        # do replies carry labels without their own? (else answer() skips the rules)
        self._labelling = bool(self.flow.sources) or any(t.labels for t in tools)
        # decided once per job, not per call
        self._approval = {t.name for t in tools if t.approval or approval_required(t.name)}

    def new_run(self) -> None:
        """Start the counts and the call log afresh (a session's next run)."""
        self.entries: list[dict[str, Any]] = []
        self.omitted = 0
        self.tool_time_s = 0.0
        self.calls_made = 0  # every call the jail made, refused or not: against limits.tool_calls
        self.tool_bytes = 0  # packed arguments and results, against limits.tool_bytes
        self.flow_refusals: list[dict[str, str]] = []  # this run's (the record's flow)

    @property
    def calls_logged(self) -> int:
        """Calls in the log, listed or only counted."""
        return len(self.entries) + self.omitted

    def admit(self, call_id: int, name: str,
              args: bytes) -> Admitted | Answered | Refused | Violation:
        """Decide a ``CallTool`` from the jail: route it, refuse it, or kill the job.

        A refusal is logged here; an admitted call is in flight until answered or withdrawn.
        """
        if call_id in self.in_flight:
            return Violation(f"the jail reused call id {call_id} while in flight")
        if name == INTEND_TOOL:
            return self._intend(call_id, args)
        refusal = self._refusal(name, args)
        self.calls_made += 1
        approval = name in self._approval
        if refusal is None and self.labels:
            spec = self._tools[name]
            verdict = self.flow.tool_verdict(frozenset(self.labels), name, spec.protected,
                                             lambda: self._planned(spec, args))
            if verdict is not None:
                self.flow_refused(ClosedSend.TOOL if verdict.refuse else ClosedSend.APPROVAL,
                                  verdict.label, name, verdict.code, verdict.message)
                if verdict.refuse:
                    refusal = (verdict.code, verdict.message)
                else:
                    approval = True
        if refusal is not None:
            if name not in self._tools:  # the jail's word: never recorded, nor audited
                name = UNKNOWN_TOOL
            self._log(name, 0.0, refusal[0])
            return Refused(call_id, name, *refusal)
        size = len(args)
        self.tool_bytes += size
        self.in_flight[call_id] = (name, size)
        return Admitted(call_id, name, args, approval, self.timeout_s(name))

    def _intend(self, call_id: int, args: bytes) -> Answered | Refused:
        """``tools.intend(tool, **pinned)``: a call the job plans before it reads untrusted
        data (:class:`~jaild.policy.flow.Intent`), answered here, never routed."""
        self.calls_made += 1

        def refused(code: str, why: str) -> Refused:
            self._log(INTEND_TOOL, 0.0, code)
            return Refused(call_id, INTEND_TOOL, code, why)

        if self.calls_made > self.limits.tool_calls:
            return refused("quota_exceeded", f"this job made its {self.limits.tool_calls} tool "
                           "calls, refused ones included (limits.tool_calls)")
        try:
            (tool,), pinned = unpack(args)
        except (RemoteProtocolError, TypeError, ValueError):
            return refused("invalid_arguments", "intend(tool, **pinned): one tool name, then "
                           "the arguments' values by name")
        if not isinstance(tool, str) or tool not in self._tools or not isinstance(pinned, dict):
            return refused("unknown_tool", f"no tool named {tool!r} to plan")
        plan = self.flow.plan(tool)
        if plan is None:
            return refused("invalid_arguments", f"{tool} has no [[flow.plan]] in policy "
                           f"{self.flow.policy!r}: it cannot be planned")
        tainted = sorted(self.labels & self.flow.untrusted)
        if tainted:
            return refused(FlowCode.INTEGRITY, "intents are declared before the job reads "
                           f"untrusted data, and this job holds {tainted[0]!r}")
        if len(self.intents) >= MAX_INTENTS:
            return refused("quota_exceeded", f"at most {MAX_INTENTS} intents a job")
        self.intents.append(Intent(tool, plan.pins(pinned, self._tools[tool].parameters or {})))
        self._log(INTEND_TOOL, 0.0, None)
        return Answered(call_id, INTEND_TOOL, pack(len(self.intents)))

    def _planned(self, spec: ToolSpec, args: bytes) -> bool:
        """Does a call of ``spec`` with packed ``args`` match an unused intent (then it is
        used up)? Positional arguments are named by the schema's order; what cannot be told
        matches nothing."""
        if not self.intents:
            return False
        try:
            positional, named = unpack(args)
        except (RemoteProtocolError, TypeError, ValueError):
            return False
        if not isinstance(positional, list) or not isinstance(named, dict):
            return False
        order = list((spec.parameters or {}).get("properties") or ())
        if len(positional) > len(order):
            return False
        given = {**dict(zip(order, positional, strict=False)), **named}
        for intent in self.intents:
            if intent.matches(spec.name, given):
                intent.used = True
                return True
        return False

    def flow_refused(self, sink: ClosedSend, label: str, target: str, code: FlowCode,
                     reason: str = "") -> None:
        """A send the job's labels closed (or sent for approval): for the run's record."""
        if len(self.flow_refusals) < MAX_CALL_RECORDS:
            self.flow_refusals.append({"sink": sink, "label": label, "target": target[:1024],
                                       "code": code, "reason": reason[:1024]})

    def hold(self, labels: Iterable[str]) -> frozenset[str]:
        """Hold ``labels`` from now on (a caller's, ``RunJob.labels``); the ones new to the
        jail. Their values are not here to redact, so a redacting one exhausts redaction:
        ``redact`` withholds (as for a restored state's labels)."""
        added = frozenset(labels) - self.labels
        self.labels |= added
        if added and self.flow.redacting(added):
            self.redaction_exhausted = True
        return added

    def reply_labels(self, name: str, labels: tuple[str, ...] = ()) -> frozenset[str]:
        """The labels a reply of tool ``name`` carries: the policy's, the spec's, its own."""
        spec = self._tools.get(name)
        own = frozenset(spec.labels) if spec is not None else frozenset()
        return self.flow.source_labels(name) | own | frozenset(labels)

    def timeout_s(self, name: str) -> float:
        """A call's timeout: the policy's ``tool_call_timeout_s``, or the tool's if shorter."""
        own = self._tools[name].timeout_s if name in self._tools else None
        limit = self.limits.tool_call_timeout_s
        return limit if own is None else min(limit, own)

    def _refusal(self, name: str, args: bytes) -> tuple[str, str] | None:
        limits = self.limits
        if self.calls_made >= limits.tool_calls:
            return (
                "quota_exceeded",
                f"this job made its {limits.tool_calls} tool calls, refused ones included "
                "(limits.tool_calls)",
            )
        if name not in self._tools:
            available = ", ".join(sorted(self._tools)) or "(none)"
            return ("unknown_tool", f"no tool named {name!r}; available: {available}")
        if len(self.in_flight) >= limits.tool_calls_in_flight:
            return (
                "too_many_calls",
                f"{len(self.in_flight)} tool calls already in flight; the policy allows "
                f"{limits.tool_calls_in_flight} at once",
            )
        if self.tool_bytes + len(args) > limits.tool_bytes:
            return (
                "quota_exceeded",
                f"this job's tool calls moved {self.tool_bytes} bytes; these arguments "
                f"({len(args)}) would pass limits.tool_bytes ({limits.tool_bytes})",
            )
        return self._validators.check_arguments(self._tools[name].parameters, name, args)

    def answer(
        self,
        call_id: int,
        ok: bool,
        value: Any,
        duration_s: float,
        labels: tuple[str, ...] = (),
        *,
        replied: bool = True,
    ) -> Answer | None:
        """The client's reply to an admitted call -- ``(True, packed value)`` or ``(False,
        (error type, message))``, a timeout being ``(False, ("timeout", ...))`` -- checked
        and logged. None if the call is not in flight (already answered or withdrawn).
        ``labels``: the reply's own; with the tool's, the job holds them from now on
        (``replied`` False: no reply came, the daemon answers, nothing is labelled)."""
        entry = self.in_flight.pop(call_id, None)
        if entry is None:
            return None
        name, args_bytes = entry
        added: frozenset[str] = frozenset()
        if replied and (labels or self._labelling):
            carried = self.reply_labels(name, labels)
            added = carried - self.labels
            self.labels |= added
            redacting = self.flow.redacting(carried) if self.flow.sinks else frozenset()
            if redacting:
                self._keep_secrets(ok, value, min(redacting))
        self.tool_time_s += duration_s
        limits = self.limits
        size = len(value) if ok else 0
        if size > limits.tool_payload_bytes:
            ok, value = False, (
                "payload_too_large",
                f"the result of {name} is {size} bytes packed; "
                f"the policy allows {limits.tool_payload_bytes}",
            )
        elif ok:
            self.tool_bytes += size
            if self.tool_bytes > limits.tool_bytes:
                ok, value = False, (
                    "quota_exceeded",
                    f"the result of {name} takes this job's tool traffic past "
                    f"limits.tool_bytes ({limits.tool_bytes})",
                )
        if ok:
            self._log(name, duration_s, None)
            return Answer(call_id, name, True, value=bytes(value), args_bytes=args_bytes,
                          result_bytes=size, labels_added=added)
        error_type, message = str(value[0]), str(value[1])
        self._log(name, duration_s, error_type)
        return Answer(
            call_id, name, False, error_type=error_type, message=message, args_bytes=args_bytes,
            labels_added=added,
        )

    def _keep_secrets(self, ok: bool, value: Any, label: str) -> None:
        """The str and bytes values of a reply whose label redacts: what the job's end
        replaces. One that does not fit the budget exhausts the redaction (fails closed:
        from then on ``redact`` withholds)."""
        if self.redaction_exhausted:
            return
        found: set[str | bytes] = set()
        if ok:
            try:
                fitted = strings_of(unpack(bytes(value)), found, self._secret_budget)
            except RemoteProtocolError:
                return  # undecodable: no strings the jail's runtime could read either
        else:
            fitted = strings_of(str(value[1]), found, self._secret_budget)
        if not fitted:
            self.redaction_exhausted = True
        for secret in found:
            self.secrets.setdefault(secret, label)

    def withdraw(self, call_id: int) -> bool:
        """The job ended with the call in flight: forget it (not logged). True if it was."""
        return self.in_flight.pop(call_id, None) is not None

    def timed_out(self, call_id: int, duration_s: float) -> Answer | None:
        """The call's timeout fired before its reply: it fails with ``timeout``."""
        entry = self.in_flight.get(call_id)
        if entry is None:
            return None
        name = entry[0]
        why = f"{name} did not answer within {self.timeout_s(name):g} s"
        return self.answer(call_id, False, ("timeout", why), duration_s, replied=False)

    def _log(self, name: str, duration_s: float, error_type: str | None) -> None:
        """A call log entry, up to MAX_CALL_RECORDS (then the call is only counted)."""
        if len(self.entries) >= MAX_CALL_RECORDS:
            self.omitted += 1
            return
        entry: dict[str, Any] = {"name": name, "duration_s": round(duration_s, 6), "ok": False}
        if error_type is None:
            entry["ok"] = True
        else:
            entry["error_type"] = error_type
        self.entries.append(entry)


__all__ = [
    "MAX_CALL_RECORDS",
    "REFUSALS",
    "Admitted",
    "Answer",
    "Broker",
    "Refused",
    "Validators",
    "Violation",
    "quick_check",
    "schema_error",
]
