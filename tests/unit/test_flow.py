"""Information-flow rules without a jail: the policy's [flow], the broker's labels and tool
sinks, the withholding, each with its control."""

from __future__ import annotations

import pytest

from jaild.daemon.core.broker import Admitted, Broker, Refused
from jaild.errors import PolicyError
from jaild.policy.flow import ClosedSend, Delivery, Disposition, FlowCode, OnUntrusted
from jaild.policy.schema import Limits, flow_rules, load_policy_text
from jaild.protocol import pack
from jaild.protocol.messages import ClientToolReturned, ToolSpec

POLICY = """\
[network]
mode = "egress"
[egress]
allow = ["a.example", "b.example"]
[flow]
protect = ["send_*"]
[[flow.source]]
tool = "read_*"
labels = ["private", "user:alice"]
[[flow.sink]]
label = "private"
egress = ["a.example"]
deny_tools = ["post"]
approve_tools = ["share"]
[[flow.sink]]
label = "secret"
result = "withhold"
release_to = ["0"]
"""
ARGS = pack([[], {}])
TOOLS = (ToolSpec(name="read_mail"), ToolSpec(name="post"), ToolSpec(name="share"),
         ToolSpec(name="send_email"), ToolSpec(name="fetch", labels=("untrusted",)),
         ToolSpec(name="transfer", protected=True), ToolSpec(name="plain"))


def broker() -> Broker:
    policy = load_policy_text(POLICY, "/p/mail.toml")
    b = Broker(TOOLS, Limits())
    b.set_job(TOOLS, Limits(), flow=flow_rules(policy))
    return b


def call(b: Broker, call_id: int, name: str, labels: tuple[str, ...] = ()) -> object:
    verdict = b.admit(call_id, name, ARGS)
    if isinstance(verdict, Admitted):
        b.answer(call_id, True, pack("x"), 0.0, labels)
    return verdict


def test_a_tools_reply_labels_the_job_before_and_not_after() -> None:
    b = broker()
    assert isinstance(call(b, 1, "post"), Admitted)  # the control: nothing read yet
    assert isinstance(call(b, 2, "share"), Admitted) and not b.labels
    verdict = b.admit(3, "read_mail", ARGS)
    assert isinstance(verdict, Admitted)
    answer = b.answer(3, True, pack("mail"), 0.0)
    assert answer is not None and answer.labels_added == {"private", "user:alice"}
    refused = b.admit(4, "post", ARGS)
    assert isinstance(refused, Refused) and refused.error_type == "flow_denied"
    assert "label 'private'" in refused.message and "deny_tools" in refused.message
    share = b.admit(5, "share", ARGS)
    assert isinstance(share, Admitted) and share.needs_approval
    assert [r["code"] for r in b.flow_refusals] == ["flow_denied", "flow_approval"]


def test_labels_accumulate_across_runs_and_only_through_replies() -> None:
    b = broker()
    call(b, 1, "plain", ("tenant:acme",))  # the reply's own labels
    call(b, 2, "fetch")  # the spec's
    b.new_run()  # a session's next run keeps them
    assert b.labels == {"tenant:acme", "untrusted"} and b.flow_refusals == []
    timed = b.admit(3, "read_mail", ARGS)
    assert isinstance(timed, Admitted)
    b.timed_out(3, 1.0)  # no reply came: nothing read, nothing labelled
    assert "private" not in b.labels


def test_integrity_refuses_protected_tools_once_untrusted_data_is_held() -> None:
    b = broker()
    assert isinstance(call(b, 1, "send_email"), Admitted)  # the control
    call(b, 2, "fetch")
    for n, name in enumerate(("send_email", "transfer"), 3):  # policy glob; spec's own
        refused = b.admit(n, name, ARGS)
        assert isinstance(refused, Refused) and refused.error_type == "integrity"
    assert isinstance(b.admit(9, "plain", ARGS), Admitted)


def test_the_approve_variant_sends_the_call_for_approval() -> None:
    policy = load_policy_text(POLICY.replace('[flow]\n', '[flow]\non_untrusted = "approve"\n'),
                              "/p/mail.toml")
    b = Broker(TOOLS, Limits())
    b.set_job(TOOLS, Limits(), flow=flow_rules(policy))
    call(b, 1, "fetch")
    verdict = b.admit(2, "send_email", ARGS)
    assert isinstance(verdict, Admitted) and verdict.needs_approval


def test_egress_and_withholding_rules() -> None:
    rules = flow_rules(load_policy_text(POLICY, "/p/mail.toml"))

    def allowed(patterns: tuple[str, ...], host: str, port: int) -> bool:
        return host in patterns

    assert rules.egress_refusal(frozenset(), "b.example", 443, allowed) is None
    label, why = rules.egress_refusal(frozenset({"private"}), "b.example", 443, allowed) or ("", "")
    assert label == "private" and "still open to it: a.example" in why
    assert rules.egress_refusal(frozenset({"private"}), "a.example", 443, allowed) is None
    assert rules.withheld(frozenset({"secret"}), lambda label: False) == {"result": "secret"}
    assert rules.withheld(frozenset({"secret"}), lambda label: True) == {}  # release_to
    assert rules.withheld(frozenset({"private"}), lambda label: False) == {}


@pytest.mark.parametrize(("text", "key"), [
    ('[[flow.sink]]\nlabel = "Private"\n', "flow.sink[0].label"),
    ('[[flow.sink]]\nlabel = "p"\noutput = "scramble"\n', "flow.sink[0].output"),
    ('[[flow.sink]]\nlabel = "p"\ndownloads = "redact"\n', "flow.sink[0].downloads"),
    ('[[flow.sink]]\nlabel = "p"\nbogus = 1\n', "flow.sink[0].bogus"),
    ('[[flow.source]]\ntool = "t"\nlabels = []\n', "flow.source[0].labels"),
    ('[[flow.sink]]\nlabel = "p"\negress = ["x.example"]\n', "flow.sink[0].egress"),
    ('[flow]\non_untrusted = "maybe"\n', "flow.on_untrusted"),
    ('[flow]\nuntrusted = ["UPPER"]\n', "flow.untrusted"),
])
def test_a_bad_flow_rule_names_its_key(text: str, key: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "/p/x.toml")
    assert f"/p/x.toml: {key}:" in str(info.value), str(info.value)


def test_labels_on_the_wire_are_checked() -> None:
    ClientToolReturned(job_id="job-1", call_id=1, value=b"", labels=("private", "user:a@b"))
    for bad in (("Private",), ("x" * 65,), tuple(f"l{i}" for i in range(17))):
        with pytest.raises(Exception, match="labels"):
            ClientToolReturned(job_id="job-1", call_id=1, value=b"", labels=bad)


def test_redaction_replaces_the_values_a_labelled_reply_held() -> None:
    from jaild.policy.flow import strings_of
    from jaild.policy.redact import Budget, RedactionFailed, Redactor

    found: set[str | bytes] = set()
    budget = [100, 1 << 20]
    assert strings_of({"name": "Alice Smith", "tags": ["vip", "north-east"], "n": 3,
                       "raw": b"\x00\x01bin"}, found, budget)
    # values (str and bytes); not keys; not "vip" (too short)
    assert found == {"Alice Smith", "north-east", b"\x00\x01bin"}
    redactor = Redactor(dict.fromkeys(found, "pii"))
    assert redactor.value({"to": "Alice Smith, north-east", "x": [1, "ok"]}, Budget()) == \
        {"to": "[redacted:pii], [redacted:pii]", "x": [1, "ok"]}
    deep: object = "Alice Smith"
    for _ in range(100):
        deep = [deep]
    with pytest.raises(RedactionFailed):
        redactor.value(deep, Budget())  # the caller withholds what it cannot redact
    budget = [1, 1 << 20]
    found = set()
    assert not strings_of(["aaaa", "bbbb"], found, budget)  # bounded, and it says so
    assert len(found) == 1 and budget == [0, 0]


# --------------------------------------------------------------------------- typed words


def test_the_rules_words_are_typed_and_unchanged() -> None:
    """Dispositions, deliveries, codes, sends and on_untrusted are StrEnums: each member is
    the word a policy, a record and the wire carry."""
    assert [str(d) for d in Disposition] == ["allow", "withhold", "redact"]
    assert [str(d) for d in Delivery] == ["result", "output", "downloads"]
    assert [str(c) for c in FlowCode] == [
        "flow_denied", "flow_approval", "integrity", "flow_egress", "flow_cut"]
    assert [str(s) for s in ClosedSend] == ["egress", "tool", "approval"]
    assert [str(o) for o in OnUntrusted] == ["refuse", "approve"]
    # the last sink (label "secret") redacts the output too
    rules = flow_rules(load_policy_text(POLICY + 'output = "redact"\n', "/p/mail.toml"))
    (secret,) = rules.sinks["secret"]
    assert secret.result is Disposition.WITHHOLD and secret.output is Disposition.REDACT
    assert secret.downloads is Disposition.ALLOW
    assert rules.on_untrusted is OnUntrusted.REFUSE
    denied = rules.tool_verdict(frozenset({"private"}), "post")
    assert denied is not None and denied.code is FlowCode.FLOW_DENIED
    held = rules.withheld(frozenset({"secret"}), lambda label: False)
    assert held == {"result": "secret"} and list(held) == [Delivery.RESULT]
    assert rules.withheld(frozenset({"secret"}), lambda label: False, "redact") == {
        "output": "secret"}  # the word still does, for callers not typed yet
    with pytest.raises(ValueError, match="'hide'"):
        rules.withheld(frozenset({"secret"}), lambda label: False, "hide")


@pytest.mark.parametrize(("text", "message"), [
    ('[[flow.sink]]\nlabel = "p"\noutput = "scramble"\n',
     "flow.sink[0].output: must be one of allow, withhold, redact, got 'scramble'"),
    ('[[flow.sink]]\nlabel = "p"\ndownloads = "redact"\n',
     "flow.sink[0].downloads: must be one of allow, withhold, got 'redact'"),
    ('[[flow.sink]]\nlabel = "p"\nresult = ["withhold"]\n',
     "flow.sink[0].result: must be one of allow, withhold, redact, got ['withhold']"),
    ('[flow]\non_untrusted = "maybe"\n',
     "flow.on_untrusted: must be one of refuse, approve; got 'maybe'"),
])
def test_an_unknown_word_is_the_same_clear_error(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "/p/x.toml")
    assert message in str(info.value), str(info.value)


def test_the_broker_records_a_refusal_in_the_typed_words() -> None:
    b = broker()
    call(b, 1, "read_mail")
    assert isinstance(call(b, 2, "post"), Refused)
    (refusal,) = b.flow_refusals
    assert refusal["sink"] is ClosedSend.TOOL and refusal["code"] is FlowCode.FLOW_DENIED
    assert refusal["sink"] == "tool" and refusal["code"] == "flow_denied"
