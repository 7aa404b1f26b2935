"""The end-of-run flow decision (jaild/daemon/core/records.py flow_at_end): what a run's
labels withhold and redact from its caller -- a pure function, tested without a jail."""

from __future__ import annotations

from jaild.daemon.core.records import (
    WITHHELD_ERROR,
    FlowEnd,
    flow_at_end,
    flow_sinks,
    withheld_error,
)
from jaild.policy.flow import Disposition
from jaild.policy.schema import flow_rules, load_policy_text

RULES = flow_rules(load_policy_text("""\
[[flow.sink]]
label = "secret"
result = "withhold"
output = "redact"
release_to = ["0"]
[[flow.sink]]
label = "pii"
downloads = "withhold"
""", "/p/f.toml"))


def end(labels: set[str], released: frozenset[str] = frozenset(), *, exhausted: bool = False,
        snapshot: bool = False, refusals: tuple[str, ...] = ()) -> FlowEnd:
    return flow_at_end(RULES, frozenset(labels), released, exhausted=exhausted,
                       refusals=refusals, snapshot=snapshot)


def test_no_label_and_no_refusal_decides_nothing() -> None:
    assert end(set()) == FlowEnd(None)
    assert end(set(), refusals=("egress",)).record == {
        "labels": [], "refusals": ["egress"], "withheld": [], "redacted": []}


def test_labels_withhold_and_redact_what_their_sinks_say() -> None:
    got = end({"secret", "pii"})
    assert got.withheld == {"result", "downloads"} and got.redact == ("output",)
    assert got.record is not None and got.record["labels"] == ["pii", "secret"]
    assert got.record["withheld"] == ["downloads", "result"]
    assert got.record["redacted"] == ["output"]


def test_release_to_spares_its_caller_only() -> None:
    spared = end({"secret"}, frozenset({"secret"}))
    assert spared.withheld == frozenset() and spared.redact == ()
    assert end({"secret"}).withheld == {"result"}  # control: another caller


def test_exhausted_redaction_withholds_what_it_would_have_redacted() -> None:
    got = end({"secret"}, exhausted=True)
    assert got.withheld == {"result", "output"} and got.redact == ()
    assert got.record is not None and got.record["redaction"] == "exhausted"
    assert flow_sinks(RULES, frozenset({"secret"}), frozenset(), True, Disposition.REDACT) == {}


def test_a_snapshot_keeps_its_result_in_the_daemon() -> None:
    got = end({"secret"}, snapshot=True)
    assert "result" not in got.withheld and got.redact == ("output",)


def test_an_error_is_output_too() -> None:
    error = {"type": "ValueError", "message": "the secret is 42", "traceback": "..."}
    assert withheld_error(error, frozenset({"result"})) == {
        "type": "ValueError", "message": WITHHELD_ERROR, "traceback": ""}
    assert withheld_error(error, frozenset({"downloads"})) is error  # control
    assert withheld_error(None, frozenset({"result"})) is None
