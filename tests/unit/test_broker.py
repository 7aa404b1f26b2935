"""The tool broker's rules, without a jail: quotas, schemas, approvals, payload limits, the log."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaild.daemon.core.broker import (
    MAX_CALL_RECORDS,
    Admitted,
    Answer,
    Broker,
    Refused,
    Validators,
    Violation,
    quick_check,
)
from jaild.policy.schema import Limits
from jaild.protocol import pack
from jaild.protocol.messages import ToolSpec
from jaild.toolspec import tool_from_function

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
TOOLS = (
    ToolSpec(name="weather", parameters=SCHEMA),
    ToolSpec(name="free"),
    ToolSpec(name="quick", timeout_s=0.5),
    ToolSpec(name="asks", approval=True),
)
ARGS = pack([[], {}])


def broker(**limits: Any) -> Broker:
    return Broker(TOOLS, dataclasses.replace(Limits(), **limits))


def test_admitted_call_carries_approval_and_timeout() -> None:
    b = Broker(TOOLS, Limits(tool_call_timeout_s=2.0), lambda name: name == "free")
    assert b.admit(1, "free", ARGS) == Admitted(1, "free", ARGS, True, 2.0)
    assert b.admit(2, "quick", ARGS) == Admitted(2, "quick", ARGS, False, 0.5)
    assert b.admit(3, "asks", ARGS) == Admitted(3, "asks", ARGS, True, 2.0)
    n = len(ARGS)
    assert b.in_flight == {1: ("free", n), 2: ("quick", n), 3: ("asks", n)}
    assert b.calls_made == 3 and b.tool_bytes == 3 * len(ARGS)
    assert b.entries == []  # logged when answered


def test_reused_call_id_is_a_violation() -> None:
    b = broker()
    assert isinstance(b.admit(7, "free", ARGS), Admitted)
    verdict = b.admit(7, "free", ARGS)
    assert isinstance(verdict, Violation) and "reused call id 7" in verdict.message
    b.answer(7, True, b"\xc0", 0.1)
    assert isinstance(b.admit(7, "free", ARGS), Admitted)  # free again once answered


def test_unknown_tool_names_the_available_ones() -> None:
    verdict = broker().admit(1, "nope", ARGS)
    assert isinstance(verdict, Refused) and verdict.error_type == "unknown_tool"
    assert "asks, free, quick, weather" in verdict.message
    # the jail hears its own word back; the record, audit and metrics never get it
    assert Broker((), Limits()).admit(1, "x", ARGS) == Refused(
        1, "(unknown)", "unknown_tool", "no tool named 'x'; available: (none)"
    )


def test_in_flight_cap() -> None:
    b = broker(tool_calls_in_flight=2)
    assert isinstance(b.admit(1, "free", ARGS), Admitted)
    assert isinstance(b.admit(2, "free", ARGS), Admitted)
    verdict = b.admit(3, "free", ARGS)
    assert isinstance(verdict, Refused) and verdict.error_type == "too_many_calls"
    b.answer(1, True, b"\xc0", 0.0)
    assert isinstance(b.admit(3, "free", ARGS), Admitted)


def test_call_quota_counts_every_call_refused_ones_too() -> None:
    b = broker(tool_calls=3)
    assert isinstance(b.admit(1, "nope", ARGS), Refused)  # refused, and counted
    for call_id in (2, 3):
        assert isinstance(b.admit(call_id, "free", ARGS), Admitted)
        b.answer(call_id, True, b"\xc0", 0.0)
    verdict = b.admit(4, "free", ARGS)
    assert isinstance(verdict, Refused) and verdict.error_type == "quota_exceeded"
    assert "limits.tool_calls" in verdict.message


def test_a_job_spinning_on_an_unknown_tool_uses_up_its_quota() -> None:
    b = broker(tool_calls=5)
    kinds = [b.admit(i, "nope", ARGS) for i in range(1, 9)]
    assert [v.error_type for v in kinds if isinstance(v, Refused)] == (
        ["unknown_tool"] * 5 + ["quota_exceeded"] * 3
    )
    assert b.calls_made == 8 and b.calls_logged == 8
    # positive control: within the quota a known tool is still admitted
    assert isinstance(broker(tool_calls=5).admit(1, "free", ARGS), Admitted)


def test_traffic_quota_on_arguments_and_results() -> None:
    b = broker(tool_bytes=100)
    big = pack([["x" * 120], {}])
    verdict = b.admit(1, "free", big)
    assert isinstance(verdict, Refused) and verdict.error_type == "quota_exceeded"
    assert isinstance(b.admit(2, "free", ARGS), Admitted)
    answer = b.answer(2, True, b"y" * 99, 0.0)
    assert answer is not None and not answer.ok and answer.error_type == "quota_exceeded"
    assert "past limits.tool_bytes (100)" in answer.message


def test_payload_limit_on_results() -> None:
    b = broker(tool_payload_bytes=64)
    assert isinstance(b.admit(1, "free", ARGS), Admitted)
    answer = b.answer(1, True, b"z" * 65, 0.25)
    assert answer == Answer(
        1,
        "free",
        False,
        error_type="payload_too_large",
        message="the result of free is 65 bytes packed; the policy allows 64",
        args_bytes=len(ARGS),
    )
    assert b.entries == [
        {"name": "free", "duration_s": 0.25, "ok": False, "error_type": "payload_too_large"}
    ]


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (pack([["Oslo"], {"days": 0}]), "argument 'days': 0 is less than the minimum of 1"),
        (pack([[], {"days": 2}]), "'city' is a required property"),
        (pack([["Oslo", 2, 3], {}]), "takes at most 2 positional argument(s) (city, days); got 3"),
        (pack([["Oslo"], {"city": "Rome"}]), "argument 'city' given twice"),
        (pack({"city": "Oslo"}), "arguments must be [args, kwargs]"),
        (b"\xc1", "undecodable arguments"),
    ],
)
def test_schema_checks_name_the_argument(args: bytes, why: str) -> None:
    verdict = broker().admit(1, "weather", args)
    assert isinstance(verdict, Refused) and verdict.error_type == "invalid_arguments"
    assert why in verdict.message and verdict.message.startswith("weather")


def test_fitting_arguments_pass_the_schema() -> None:
    assert isinstance(broker().admit(1, "weather", pack([["Oslo"], {"days": 3}])), Admitted)


def test_answers_and_log() -> None:
    b = broker()
    b.admit(1, "free", ARGS)
    b.admit(2, "free", ARGS)
    b.admit(3, "nope", ARGS)
    assert b.answer(2, False, ("ValueError", "bad"), 0.5) == Answer(
        2, "free", False, error_type="ValueError", message="bad", args_bytes=len(ARGS)
    )
    ok = b.answer(1, True, b"\x01", 1.25)
    assert ok == Answer(1, "free", True, value=b"\x01", args_bytes=len(ARGS), result_bytes=1)
    assert ok.outcome == "ok"
    assert b.answer(1, True, b"\x01", 1.0) is None  # answered once only
    assert b.entries == [
        {"name": "(unknown)", "duration_s": 0.0, "ok": False, "error_type": "unknown_tool"},
        {"name": "free", "duration_s": 0.5, "ok": False, "error_type": "ValueError"},
        {"name": "free", "duration_s": 1.25, "ok": True},
    ]
    assert b.tool_time_s == 1.75 and b.calls_logged == 3


def test_timeout_and_withdrawal() -> None:
    b = broker()
    b.admit(1, "quick", ARGS)
    b.admit(2, "free", ARGS)
    answer = b.timed_out(1, 0.5)
    assert answer is not None and answer.error_type == "timeout"
    assert answer.message == "quick did not answer within 0.5 s"
    assert b.timed_out(1, 0.6) is None and b.answer(1, True, b"", 0.7) is None
    assert b.withdraw(2) and not b.withdraw(2)
    assert b.answer(2, True, b"", 0.1) is None
    assert [e["name"] for e in b.entries] == ["quick"]  # a withdrawn call is not logged


def test_log_is_capped_then_counted() -> None:
    b = broker()
    for call_id in range(MAX_CALL_RECORDS + 5):
        b.admit(call_id, "nope", ARGS)
    assert len(b.entries) == MAX_CALL_RECORDS and b.omitted == 5
    assert b.calls_logged == MAX_CALL_RECORDS + 5


def test_new_run_and_new_job() -> None:
    b = broker(tool_calls=1)
    b.admit(1, "free", ARGS)
    b.answer(1, True, b"", 0.1)
    b.new_run()
    assert (b.entries, b.omitted, b.calls_made, b.tool_bytes, b.tool_time_s) == ([], 0, 0, 0, 0.0)
    b.set_job((ToolSpec(name="other"),), Limits(), lambda _: True)
    assert b.admit(2, "other", ARGS) == Admitted(2, "other", ARGS, True, 60.0)
    assert isinstance(b.admit(3, "free", ARGS), Refused)


def test_validators_are_compiled_once_per_schema() -> None:
    cache = Validators()
    first = cache.validator(SCHEMA)
    assert cache.validator(dict(SCHEMA)) is first
    assert cache.check_arguments({}, "t", b"\xc1") is None  # no schema: anything goes
    from jsonschema.exceptions import SchemaError

    with pytest.raises(SchemaError):
        cache.validator({"type": 12})


# -- the plain-Python shortcut for signature schemas, against jsonschema itself

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3)
    | st.binary(max_size=2),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=2), inner,
                                                                 max_size=2),
    max_leaves=4,
)
_NAMES = st.sampled_from(["a", "b", "c"])
_PROPERTY = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["string", "integer", "number", "boolean", "null", "array", "object"]
        ),
        "description": st.text(max_size=3),
        "default": st.integers(),
    },
)
_SIGNATURE_SCHEMA = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(_NAMES, _PROPERTY, max_size=3)},
    optional={
        "required": st.lists(_NAMES, max_size=3, unique=True),
        "additionalProperties": st.booleans(),
        "title": st.text(max_size=3),
    },
)


@settings(max_examples=400, deadline=None)
@given(schema=_SIGNATURE_SCHEMA, instance=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                                                         _JSON, max_size=4))
def test_the_shortcut_passes_only_what_jsonschema_passes(
    schema: dict[str, Any], instance: dict[str, Any]
) -> None:
    """Every schema a tool signature makes gets the shortcut; whatever it lets through,
    jsonschema lets through too (where it says no, jsonschema decides)."""
    from jsonschema import validators

    check = quick_check(schema)
    assert check is not None
    if check(instance):
        assert validators.validator_for(schema)(schema).is_valid(instance), (schema, instance)


@settings(max_examples=200, deadline=None)
@given(instance=st.dictionaries(st.sampled_from(["value", "other"]), _JSON, max_size=2))
def test_the_shortcut_says_yes_to_most_valid_calls(instance: dict[str, Any]) -> None:
    """Positive control: the shortcut is not a shortcut that never fires -- it answers
    every call jsonschema passes here, except an integral float given as an integer."""
    from jsonschema import validators

    schema = tool_from_function(_echo).parameters
    check = quick_check(schema)
    assert check is not None
    valid = validators.validator_for(schema)(schema).is_valid(instance)
    if valid and type(instance.get("value")) is not float:
        assert check(instance)
    if not valid:
        assert not check(instance)


def _echo(value: int) -> int:
    return value


@pytest.mark.parametrize(
    "schema",
    [
        SCHEMA,  # "minimum": a keyword the shortcut does not know
        {"type": "object", "properties": {"x": {"type": ["string", "null"]}}},
        {"type": "object", "properties": {"x": {"anyOf": [{"type": "string"}]}}},
        {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "string"}}}},
        {"type": "object", "additionalProperties": {"type": "string"}},
        {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object"},
        {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
    ],
)
def test_other_schemas_are_left_to_jsonschema(schema: dict[str, Any]) -> None:
    assert quick_check(schema) is None


def test_the_shortcut_does_not_change_what_the_broker_answers() -> None:
    tools = (ToolSpec(name="echo", parameters=tool_from_function(_echo).parameters),)
    b = Broker(tools, Limits())
    assert isinstance(b.admit(1, "echo", pack([[1], {}])), Admitted)
    for args, why in [
        (pack([["x"], {}]), "argument 'value': 'x' is not of type 'integer'"),
        (pack([[], {}]), "'value' is a required property"),
        (pack([[1], {"extra": 2}]), "Additional properties are not allowed ('extra' was"),
        (pack([[True], {}]), "argument 'value': True is not of type 'integer'"),
    ]:
        verdict = b.admit(2, "echo", args)
        assert isinstance(verdict, Refused) and verdict.error_type == "invalid_arguments"
        assert why in verdict.message, verdict.message
    assert isinstance(b.admit(3, "echo", pack([[1.0], {}])), Admitted)  # jsonschema's call
