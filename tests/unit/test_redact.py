"""Redaction (:mod:`jaild.policy.redact`): one automaton over every form of every secret,
leftmost-longest, str and bytes alike, in work linear in the text; and failing closed --
a budget run out, a value too deep, the broker's secret budget exhausted: withheld, never
passed. The job-level tests run the real daemon core and broker with
:mod:`jaild.testing`'s fake jails (no root); tests/integration/test_flow.py has the same in
real jails."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from jaild import Labeled
from jaild.client import AsyncClient
from jaild.daemon.core.broker import Broker
from jaild.daemon.jails import job as job_module
from jaild.policy.flow import MAX_SECRETS, FlowSink, compile_flow, strings_of
from jaild.policy.redact import Budget, RedactionFailed, Redactor, forms
from jaild.policy.schema import Limits
from jaild.protocol.messages import ToolSpec, pack
from jaild.testing import daemon_pair
from tests.conftest import guard

DOC = "Dear Alice,\n\tthe 'merger' closes on \"Friday\" \\ for £3m \x07 ok\u2028"
"""A multi-line secret with every character a repr, an ascii or a JSON dump escapes."""


def redact(text: Any, secrets: dict[Any, str], budget: Budget | None = None) -> Any:
    return Redactor(secrets).value(text, budget or Budget())


# ----------------------------------------------------------------------------- the engine


def test_a_plain_secret_is_replaced_in_str_and_in_bytes() -> None:
    secrets = {"Alice Smith": "pii", b"\x00\xffkey-bytes": "key"}
    assert redact("to Alice Smith.", secrets) == "to [redacted:pii]."
    assert redact(b"to Alice Smith.", secrets) == b"to [redacted:pii]."
    assert redact(b"k=\x00\xffkey-bytes;", secrets) == b"k=[redacted:key];"
    assert redact("k=" + repr(b"\x00\xffkey-bytes"), secrets) == "k=b'[redacted:key]'"
    assert redact({"Alice Smith": [b"Alice Smith", ("Alice Smith",)]}, secrets) == \
        {"[redacted:pii]": [b"[redacted:pii]", ("[redacted:pii]",)]}
    # the control: what is not a secret is left alone, as the same object
    text = "to Alice Smyth."
    assert redact(text, secrets) is text


@pytest.mark.parametrize("dump", [
    pytest.param(lambda d: str([d]), id="print([doc])"),
    pytest.param(repr, id="repr"),
    pytest.param(ascii, id="ascii"),
    pytest.param(lambda d: repr(d + '"'), id="repr-other-quote"),
    pytest.param(lambda d: repr(d.encode()), id="repr-bytes"),
    pytest.param(json.dumps, id="json"),
    pytest.param(lambda d: json.dumps(d, ensure_ascii=False), id="json-utf8"),
    pytest.param(lambda d: json.dumps({"doc": d, "n": [d]}), id="json-nested"),
])
def test_escaped_forms_of_a_multi_line_secret_are_replaced(dump: Callable[[str], str]) -> None:
    text = "before " + dump(DOC) + " after"
    assert DOC not in text  # the exact secret does not occur: the old redaction passed it
    out = redact(text, {DOC: "mail"})
    assert "[redacted:mail]" in out and "Alice" not in out and "merger" not in out
    assert out.startswith("before ") and out.endswith(" after")
    # the same text as the bytes a job returns or prints
    assert b"Alice" not in redact(text.encode(), {DOC: "mail"})


def test_the_forms_are_the_escapes_python_and_json_make() -> None:
    assert forms("abcd") == [b"abcd"]  # nothing to escape: one pattern
    # the line itself; repr's, ascii's and JSON's \n; repr's other quoting escapes the '
    assert set(forms("a\nb'c")) == {b"a\nb'c", b"a\\nb'c", b"a\\nb\\'c"}
    assert set(forms("caf\u00e9")) == {"caf\u00e9".encode(), b"caf\\xe9", b"caf\\u00e9",
                                        b"caf\\xc3\\xa9"}
    assert set(forms(b"\xff\xfe12")) == {b"\xff\xfe12", b"\\xff\\xfe12"}  # not UTF-8


def test_overlapping_secrets_are_replaced_leftmost_longest_without_overlap() -> None:
    secrets = {"abcd": "a", "abcdef": "b", "cdefgh": "c", "efgh": "d", "ghij": "e"}
    # leftmost first: "abcdef" (longest from 0) beats "abcd"; then "ghij" after it
    assert redact("abcdefghij", secrets) == "[redacted:b][redacted:e]"
    assert redact("xxcdefghxx", secrets) == "xx[redacted:c]xx"
    assert redact("abcdxefgh", secrets) == "[redacted:a]x[redacted:d]"


def test_leftmost_longest_agrees_with_the_definition_across_window_edges(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Random secrets over a small alphabet, in windows of 8 bytes: every match across a
    window's edge found once, against a plain reading of leftmost-longest."""
    import jaild.policy.redact as redact_module

    monkeypatch.setattr(redact_module, "WINDOW_BYTES", 8)
    rng = random.Random(41)

    def reference(text: str, secrets: dict[str, str]) -> str:
        out, i = [], 0
        while i < len(text):
            hit = max((s for s in secrets if text.startswith(s, i)), key=len, default=None)
            out.append(f"[redacted:{secrets[hit]}]" if hit else text[i])
            i += len(hit) if hit else 1
        return "".join(out)

    for _ in range(3000):
        secrets: dict[str, str] = {}
        for _ in range(rng.randint(1, 6)):
            secrets.setdefault("".join(rng.choice("ab") for _ in range(rng.randint(4, 9))),
                               str(len(secrets)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 80)))
        assert redact(text, secrets) == reference(text, secrets), (secrets, text)


def test_the_work_is_linear_in_the_text_whatever_the_number_of_secrets() -> None:
    """50,000 secrets over 2 MB: bytes scanned and matches examined are counted -- not
    timed -- and stay within a constant of the text's size and the matches in it, the same
    for 50 secrets as for 50,000 (the old sort per string did work in their product)."""
    rng = random.Random(7)
    tails = ("line", "two\nlines")
    many = {f"tok-{i:08d}-{tails[i % 7 == 0]}": f"l{i % 3}" for i in range(50_000)}
    planted = rng.sample(sorted(many), 2000)
    filler = "the quick brown fox jumps over the lazy dog; " * 20
    parts = []
    for secret in planted:
        parts.append(filler[: rng.randint(100, 900)])
        parts.append(secret if rng.random() < 0.5 else json.dumps(secret))
    text = "".join(parts)
    text += "x" * (2_000_000 - len(text))
    assert len(text) >= 2_000_000

    def work(secrets: dict[str, str]) -> tuple[Budget, str]:
        budget = Budget()
        out = Redactor(secrets).text(text, budget)
        return budget, out

    budget, out = work(many)
    assert out.count("[redacted:") == len(planted)
    assert budget.scanned <= 1.01 * len(text)  # windows overlap by the longest pattern only
    assert budget.matched == len(planted)  # no overlapping or repeated matches examined
    few = {s: many[s] for s in planted[:50]}
    budget_few, out_few = work(few)
    assert out_few.count("[redacted:") == 50
    assert budget_few.scanned == budget.scanned  # the same scan for 50 secrets as 50,000


def test_a_budget_run_out_fails_and_the_caller_withholds() -> None:
    secrets = {"Alice Smith": "pii"}
    text = "Alice Smith " * 1000
    with pytest.raises(RedactionFailed, match="scan"):
        redact(text, secrets, Budget(scan_bytes=len(text) - 1))
    with pytest.raises(RedactionFailed, match="matches"):
        redact(text, secrets, Budget(matches=999))
    with pytest.raises(RedactionFailed, match="time"):  # the clock is read once a window
        redact(text, secrets, Budget(deadline=1.0, clock=lambda: 5.0))
    # the controls: within each budget, redacted
    assert redact(text, secrets, Budget(scan_bytes=len(text), matches=1000)) == \
        "[redacted:pii] " * 1000
    assert redact(text, secrets, Budget(deadline=1.0, clock=lambda: 0.0)).count("[r") == 1000


# ----------------------------------------------------------------------------- the broker


def _broker() -> Broker:
    rules = compile_flow("p", (), (FlowSink("pii", result="redact", output="redact"),),
                         ("untrusted",), (), "refuse")
    return Broker((ToolSpec(name="read"),), Limits(tool_payload_bytes=16 << 20,
                                                  tool_bytes=64 << 20), flow=rules)


def _reply(broker: Broker, value: Any, call_id: int = 1) -> None:
    """A call of ``read``, answered with ``value`` labelled ``pii``."""
    assert broker.admit(call_id, "read", pack([[], {}]))
    assert broker.answer(call_id, True, pack(value), 0.0, ("pii",)) is not None


def test_a_reply_past_the_secret_budget_exhausts_the_redaction() -> None:
    broker = _broker()
    _reply(broker, [f"value-{i:05d}" for i in range(MAX_SECRETS)])
    assert not broker.redaction_exhausted and len(broker.secrets) == MAX_SECRETS  # fits
    _reply(broker, ["one-more-value"], 2)
    assert broker.redaction_exhausted
    broker = _broker()
    _reply(broker, {"k": b"\x00" * (4 << 20) + b"!"})  # bytes count too
    assert broker.redaction_exhausted
    broker = _broker()  # the control: bytes within the budget are kept, to be redacted
    _reply(broker, {"k": b"\x00\x01bytes"})
    assert not broker.redaction_exhausted and broker.secrets == {b"\x00\x01bytes": "pii"}
    # a restored state's redacting labels come without their values: exhausted from the start
    rules = compile_flow("p", (), (FlowSink("pii", result="redact"),), ("untrusted",), (),
                         "refuse")
    assert Broker((), Limits(), flow=rules, labels=("pii",)).redaction_exhausted
    assert not Broker((), Limits(), flow=rules, labels=("other",)).redaction_exhausted


def test_strings_of_reports_what_does_not_fit() -> None:
    found: set[str | bytes] = set()
    assert strings_of(["abcd", b"efgh"], found, [2, 8])
    assert not strings_of(["ijkl"], found, [0, 100])
    assert not strings_of(["ijklm"], set(), [5, 4])


# ----------------------------------------------------------------------------- on a daemon

POLICY = """
[limits]
wall_time_s = 60
tool_call_timeout_s = 30
[[flow.source]]
tool = "read_*"
labels = ["pii"]
[[flow.sink]]
label = "pii"
result = "redact"
output = "redact"
"""


def read_doc() -> Labeled:
    return Labeled({"doc": DOC, "key": b"\x00\x01key-bytes"}, "pii")


def read_many(n: int) -> list[str]:
    return [f"value-{i:06d}" for i in range(n)]


TOOLS: dict[str, Callable[..., Any]] = {"read_doc": read_doc, "read_many": read_many}


def on_daemon(test: Callable[[AsyncClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with asyncio.timeout(guard(120)), daemon_pair({"default": POLICY}) as client:
            await test(client)

    asyncio.run(main())


def test_a_job_past_the_budget_has_redact_withheld_and_the_record_says_so() -> None:
    code = ("vals = await tools.read_many(n={n})\nprint(vals[-1])\n"
            "{{'last': vals[-1], 'own': 'nothing secret'}}")

    async def test(client: AsyncClient) -> None:
        under = await client.run(code.format(n=100), tools=TOOLS)
        assert under.status == "ok", under.error
        assert under.result == {"last": "[redacted:pii]", "own": "nothing secret"}
        assert under.stdout == "[redacted:pii]\n"
        assert under.record.flow.redaction is None and list(under.record.flow.redacted) == [
            "output", "result"]
        over = await client.run(code.format(n=MAX_SECRETS + 1), tools=TOOLS)
        assert over.status == "ok", over.error
        assert over.result is None and over.stdout == ""
        flow = over.record.flow
        assert flow.redaction == "exhausted"
        assert list(flow.withheld) == ["output", "result"] and not flow.redacted

    on_daemon(test)


def test_bytes_and_escaped_forms_are_redacted_in_result_and_output() -> None:
    code = ("r = await tools.read_doc()\nprint([r['doc']])\nprint(r['key'])\n"
            "import json\n[r['doc'].encode(), json.dumps(r['doc']), r['key']]")

    async def test(client: AsyncClient) -> None:
        r = await client.run(code, tools=TOOLS)
        assert r.status == "ok", r.error
        assert r.result == [b"[redacted:pii]", '"[redacted:pii]"', b"[redacted:pii]"]
        assert r.stdout == "['[redacted:pii]']\nb'[redacted:pii]'\n"
        assert list(r.record.flow.redacted) == ["output", "result"]

    on_daemon(test)


def test_a_redaction_that_fails_withholds(monkeypatch: pytest.MonkeyPatch) -> None:
    code = "r = await tools.read_doc()\nprint(r['doc'])\nr['doc']"

    def fails(*_: Any) -> Any:
        raise RedactionFailed("redaction ran out of time")

    async def test(client: AsyncClient) -> None:
        control = await client.run(code, tools=TOOLS)
        assert control.result == "[redacted:pii]" and control.stdout == "[redacted:pii]\n"
        monkeypatch.setattr(job_module, "_redact_run", fails)
        r = await client.run(code, tools=TOOLS)
        assert r.status == "ok" and r.result is None and r.stdout == ""
        assert r.record.flow.redaction == "failed"
        assert list(r.record.flow.withheld) == ["output", "result"]

    on_daemon(test)
