"""Governance at the broker, and discovery inside the jail, through the real daemon.

Every check here happens in the daemon before any handler runs: JSON-schema validation of
the arguments, per-job quotas, per-tool timeouts, approvals; each call is audited.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild import tool
from jaild.client import Client
from jaild.errors import BadRequest
from jaild.toolspec import HostTool
from tests.conftest import DaemonHandle, guard, policy_texts, start_daemon, sweep_cgroups
from tests.integration.test_faults import write_config

pytestmark = pytest.mark.integration

POLICIES = {
    "quota": "[limits]\ntool_calls = 3\ntool_bytes = 4096\n",
    "guarded": '[access]\napprove = ["danger*"]\n',
}


@pytest.fixture(scope="module")
def gd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    directory = tmp_path_factory.mktemp("governance")
    audit = directory / "audit.jsonl"
    config = write_config(directory, f'[daemon]\naudit_log = "{audit}"\n')
    handle = start_daemon(directory, {**policy_texts("default"), **POLICIES},
                          with_repo_policies=False, args=("--config", config))
    handle.audit_path = audit  # type: ignore[attr-defined]
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
    sweep_cgroups(handle)


def failure(code: str) -> str:
    """Code that calls a tool and returns (error_type, message) of its ToolError."""
    return f"try:\n    await {code}\n    out = 'no error'\nexcept ToolError as e:\n    out = (e.error_type, e.message)\nout"


def test_arguments_are_checked_against_the_schema_before_the_handler(gd: DaemonHandle) -> None:
    ran: list[tuple[int, int]] = []

    def add(a: int, b: int = 0) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    with Client(gd.socket) as c:
        r = c.run(failure("tools.add(a='x', b=2)"), tools=[add])
        assert r.result[0] == "invalid_arguments" and "'a'" in r.result[1], r.result
        assert "is not of type 'integer'" in r.result[1]
        r = c.run(failure("tools.add(b=2)"), tools=[add])
        assert r.result[0] == "invalid_arguments" and "'a' is a required property" in r.result[1]
        r = c.run(failure("tools.add(1, 2, 3)"), tools=[add])
        assert r.result[0] == "invalid_arguments" and "at most 2 positional" in r.result[1]
        r = c.run(failure("tools.add(a=1, c=5)"), tools=[add])
        assert r.result[0] == "invalid_arguments" and "'c'" in r.result[1], r.result
        assert ran == []  # no handler ran for any of them
        # positive control: right arguments, positional or by name, reach the handler
        r = c.run("[await tools.add(1, 2), await tools.add(a=3, b=4), await tools.add(5)]",
                  tools=[add])
        assert r.result == [3, 7, 5] and ran == [(1, 2), (3, 4), (5, 0)]
        calls = [call["error_type"] for call in r.tool_calls if not call["ok"]]
        assert calls == []


def test_nested_argument_errors_name_the_path(gd: DaemonHandle) -> None:
    spec = HostTool(
        "create", "Create events.",
        {"type": "object", "properties": {"events": {"type": "array", "items": {
            "type": "object", "properties": {"when": {"type": "string", "format": "date"}},
            "required": ["when"]}}}, "required": ["events"]},
        lambda events: len(events),
    )
    with Client(gd.socket) as c:
        r = c.run(failure("tools.create(events=[{'when': 'x'}, {'at': 1}])"), tools=[spec])
    assert r.result[0] == "invalid_arguments" and "events[1]" in r.result[1], r.result


def test_an_invalid_schema_is_refused_at_submit(gd: DaemonHandle) -> None:
    bad = HostTool("t", "", {"type": "nonsense"}, lambda: 1)
    with Client(gd.socket) as c, pytest.raises(BadRequest, match=r"tool 't'.*not a valid JSON schema"):
        c.run("1", tools=[bad])


def test_per_job_quotas(gd: DaemonHandle) -> None:
    with Client(gd.socket) as c:
        r = c.run(
            "results = []\nfor i in range(5):\n    try:\n"
            "        results.append(await tools.echo(i))\n    except ToolError as e:\n"
            "        results.append(e.error_type)\nresults",
            policy="quota", tools={"echo": lambda v: v})
        assert r.result == [0, 1, 2, "quota_exceeded", "quota_exceeded"], r.result
        r = c.run(failure("tools.echo('x' * 5000)"), policy="quota", tools={"echo": lambda v: v})
        assert r.result[0] == "quota_exceeded" and "tool_bytes" in r.result[1]
        r = c.run(failure("tools.big()"), policy="quota", tools={"big": lambda: "y" * 5000})
        assert r.result[0] == "quota_exceeded" and "tool_bytes" in r.result[1]
        # positive control: the same calls under the default policy
        r = c.run("[await tools.echo(i) for i in range(5)]", tools={"echo": lambda v: v})
        assert r.result == [0, 1, 2, 3, 4]


def test_per_tool_timeouts(gd: DaemonHandle) -> None:
    gate = threading.Event()
    answered: list[str] = []

    @tool(timeout_s=0.3)
    def slow() -> str:
        gate.wait(guard(60))  # answers only once the job is over: the 0.3 s timeout must cut it
        answered.append("slow")
        return "late"

    def patient() -> str:  # slower than slow's timeout, within the policy's own
        time.sleep(0.5)
        return "in time"

    with Client(gd.socket) as c:
        r = c.run(failure("tools.slow()") + "\n(out, await tools.patient())",
                  tools=[slow, patient])
        assert answered == []  # the job ended while slow's handler still ran
        gate.set()
    assert r.status == "ok", r.error
    assert r.result[0][0] == "timeout" and "0.3 s" in r.result[0][1], r.result
    assert r.result[1] == "in time"


def test_approval_allow_and_deny(gd: DaemonHandle) -> None:
    ran: list[str] = []
    asked: list[tuple[str, list[object], dict[str, object]]] = []

    @tool(approval=True)
    def delete(path: str) -> str:
        """Delete a file on the host."""
        ran.append(path)
        return f"deleted {path}"

    def approve(name: str, args: list[object], kwargs: dict[str, object]) -> object:
        asked.append((name, args, kwargs))
        return (False, "not in /etc") if str(kwargs.get("path", "")).startswith("/etc") else True

    with Client(gd.socket, approve=approve) as c:
        r = c.run("await tools.delete(path='/tmp/x')", tools=[delete])
        assert (r.status, r.result) == ("ok", "deleted /tmp/x")
        r = c.run(failure("tools.delete(path='/etc/passwd')"), tools=[delete])
        assert r.result == ["denied", "not in /etc"], r.result
        assert ran == ["/tmp/x"]  # the denied call never reached the handler
        assert asked == [("delete", [], {"path": "/tmp/x"}), ("delete", [], {"path": "/etc/passwd"})]
        # a per-job approver overrides the client's
        r = c.run("await tools.delete(path='/etc/passwd')", tools=[delete],
                  approve=lambda *_: True)
        assert r.result == "deleted /etc/passwd"
    with Client(gd.socket) as c:  # no approver at all: denied
        r = c.run(failure("tools.delete(path='/tmp/y')"), tools=[delete])
        assert r.result[0] == "denied" and "no approve callback" in r.result[1]


def test_the_policy_can_require_approval(gd: DaemonHandle) -> None:
    asked: list[str] = []

    async def approve(name: str, args: list[object], kwargs: dict[str, object]) -> bool:
        asked.append(name)
        return False

    with Client(gd.socket, approve=approve) as c:
        tools = {"danger_zone": lambda: "boom", "safe": lambda: "fine"}
        r = c.run(failure("tools.danger_zone()") + "\n(out, await tools.safe())",
                  policy="guarded", tools=tools)
    assert r.result[0][0] == "denied" and r.result[1] == "fine"
    assert asked == ["danger_zone"]  # the client marked nothing: the policy did


def test_every_tool_call_is_audited(gd: DaemonHandle) -> None:
    with Client(gd.socket) as c:
        r = c.run("await tools.ok()\n" + failure("tools.ok(1)"), tools={"ok": lambda: 1})
    records = [json.loads(line) for line in Path(gd.audit_path).read_text().splitlines()]  # type: ignore[attr-defined]
    calls = [x for x in records if x["event"] == "tool_call" and x["job"] == r.job_id]
    assert [(x["tool"], x["outcome"]) for x in calls] == [("ok", "ok"), ("ok", "invalid_arguments")]
    assert all(x["uid"] == 0 and x["duration_s"] >= 0 for x in calls)


def test_discovery_inside_the_jail(gd: DaemonHandle) -> None:
    def add(a: int, b: int) -> int:
        """Add two integers.

        More detail here."""
        return a + b

    def search_repositories(query: str) -> list[str]:
        """Search repositories by keyword."""
        return [query]

    tools = {"math.add": add, "github.search_repositories": search_repositories,
             "cal.list-events": lambda: ["e1"]}
    code = (
        "d = await tools.discover()\n"
        "s = await tools.schema('math.add')\n"
        "found = await tools.search('repos')\n"
        "alias = await _discover()\n"
        "grouped = await tools.math.add(a=1, b=2)\n"
        "hyphen = await tools.cal.list_events()\n"
        "by_name = await tools['github.search_repositories'](query='q')\n"
        "import io, contextlib\nbuf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n    help(tools.math.add)\n"
        "{'d': d, 's': s, 'found': found, 'alias': alias == d, 'grouped': grouped,"
        " 'hyphen': hyphen, 'by_name': by_name, 'help': 'integer' in buf.getvalue(),"
        " 'dir': dir(tools)}"
    )
    with Client(gd.socket) as c:
        r = c.run(code, tools=tools)
    assert r.status == "ok", r.error
    out = r.result
    assert out["d"] == [
        {"name": "cal.list-events", "description": ""},
        {"name": "github.search_repositories", "description": "Search repositories by keyword."},
        {"name": "math.add", "description": "Add two integers."},
    ]
    assert out["s"]["parameters"]["required"] == ["a", "b"]
    assert [f["name"] for f in out["found"]] == ["github.search_repositories"]
    assert out["alias"] and out["grouped"] == 3 and out["hyphen"] == ["e1"]
    assert out["by_name"] == ["q"] and out["help"]
    assert {"cal", "github", "math", "discover", "schema", "search"} <= set(out["dir"])


def test_a_host_tool_named_search_wins_and_discovery_stays_reachable(gd: DaemonHandle) -> None:
    with Client(gd.socket) as c:
        r = c.run("(await tools.search(query='x'), [t['name'] for t in await _search('sea')],"
                  " await tools.discover())", tools={"search": lambda query: f"found {query}"})
        sync = c.run("[t['name'] for t in tools.discover()]", tools={"x": lambda: 1})
    assert r.status == "ok", r.error
    assert r.result[0] == "found x" and r.result[1] == ["search"]
    assert r.result[2] == [{"name": "search", "description": ""}]
    assert sync.result == ["x"]  # no event loop running: the value itself


def test_approval_from_another_thread_does_not_block_other_jobs(gd: DaemonHandle) -> None:
    gate = threading.Event()

    @tool(approval=True)
    def act() -> str:
        return "acted"

    asked = threading.Event()
    answered: list[bool] = []

    def approve(name: str, args: list[object], kwargs: dict[str, object]) -> bool:
        asked.set()
        answered.append(gate.wait(guard(60)))  # a human thinking it over
        return answered[-1]

    with Client(gd.socket, approve=approve) as c:
        waiting = c.submit("await tools.act()", tools=[act])
        assert asked.wait(guard(60))
        assert c.run("'meanwhile'").result == "meanwhile"
        assert answered == []  # served while the approval was still pending
        gate.set()
        assert waiting.result(guard(60)).result == "acted"
