"""``jaild mcp`` end to end: the SDK's own MCP client drives ``jaild mcp`` (a subprocess),
which runs the code in a real daemon's jails and answers the jailed code's tool calls by
calling a real small MCP server (``mcp_fixtures/demo_server.py``, stdio) it started itself."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from jaild.client import Client
from tests.conftest import REPO, DaemonHandle, guard

pytestmark = pytest.mark.integration

DEMO_SERVER = Path(__file__).resolve().parent / "mcp_fixtures" / "demo_server.py"
SECRET = f"demo-secret-{uuid.uuid4().hex}"
FINGERPRINT = "user-" + hashlib.sha256(SECRET.encode()).hexdigest()[:8]
T = TypeVar("T")


@pytest.fixture(scope="module")
def md(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    from tests.conftest import policy_texts, start_daemon, sweep_cgroups

    handle = start_daemon(tmp_path_factory.mktemp("mcp"), {
        **policy_texts("default", "web"),
        "guarded": '[access]\napprove = ["demo.add"]\n',
        # search results are untrusted text; add is protected from it
        "flowed": '[flow]\nprotect = ["demo.add"]\n[[flow.source]]\n'
                  'tool = "demo.search_repositories"\nlabels = ["untrusted"]\n',
    }, with_repo_policies=False)
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
    sweep_cgroups(handle)


@pytest.fixture(scope="module")
def servers_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mcpServers file naming the demo server, with its secret in its env."""
    path = tmp_path_factory.mktemp("mcp-config") / "servers.json"
    path.write_text(json.dumps({"mcpServers": {"demo": {
        "command": sys.executable, "args": [str(DEMO_SERVER)], "env": {"DEMO_SECRET": SECRET},
    }}}))
    return path


def _jaild_mcp(sock: str, *args: str) -> list[str]:
    # the MCP servers' start is a liveness guard here (a Python process importing the SDK:
    # over 30 s under TCG on a loaded host), so it scales like the others
    return [sys.executable, "-m", "jaild", "mcp", "--socket", sock,
            "--connect-timeout", str(guard(30)), *args]


def _drive(
    argv: list[str], log_path: Path, body: Callable[[Any], Awaitable[T]], timeout: float = 60,
    elicit: Any = None, env: dict[str, str] | None = None,
) -> T:
    """Start ``argv`` (a ``jaild mcp`` over stdio) with the SDK's stdio client, initialize,
    and run ``body(session)``."""
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(REPO), env=env)

    async def main() -> T:
        with open(log_path, "a") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write), \
                    ClientSession(read, write, elicitation_callback=elicit) as session:
                await session.initialize()
                return await asyncio.wait_for(body(session), guard(timeout))

    try:
        return asyncio.run(main())
    except BaseException:
        print("jaild mcp stderr:\n" + log_path.read_text(errors="replace")[-4000:])
        raise


async def _run(session: Any, code: str) -> Any:
    return await session.call_tool("run_python", {"code": code})


def _text(result: Any) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


# --------------------------------------------------------------------------- stdio


def test_run_python_is_listed_with_the_servers_tools(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    async def body(session: Any) -> Any:
        return (await session.list_tools()).tools

    tools = _drive(_jaild_mcp(md.socket, "--tools", str(servers_json)), tmp_path / "log", body)
    assert [t.name for t in tools] == ["run_python"]
    tool = tools[0]
    assert tool.input_schema["required"] == ["code"]
    assert tool.output_schema is not None and "status" in tool.output_schema["properties"]
    d = tool.description
    # every tool with its one-line description, and how to call and discover them
    assert "- demo.add(a, b): Add two integers." in d
    assert "- demo.search_repositories(query, limit=…): Search code repositories by keyword." in d
    assert "returns name and stars" not in d.lower()  # one line only
    assert "demo.whoami" in d and "demo.fail" in d
    assert "The jail has no network: " in d  # the default policy's
    for hint in ("await tools.<server>.<tool>(", 'tools["<name>"]', "await tools.discover()",
                 'tools.schema("name")', 'tools.search("keyword")', "final expression", "print"):
        assert hint in d, hint
    assert SECRET not in d


def test_a_module_given_alone_is_at_the_top_as_in_jaild_run(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    """The --tools naming rule of every front end (jaild.providers.module_sources): a
    module given alone is tools.f (as jaild run names it), an MCP server's tools
    tools.SERVER.f beside it."""
    module = tmp_path / "mytools.py"
    module.write_text("def double(x: int) -> int:\n    'Twice x.'\n    return 2 * x\n")

    async def body(session: Any) -> Any:
        return await _run(session, "[await tools.double(x=4), await tools.demo.add(a=1, b=2)]")

    r = _drive(_jaild_mcp(md.socket, "--tools", str(module), "--tools", str(servers_json)),
               tmp_path / "log", body)
    assert r.is_error is False, _text(r)
    assert r.structured_content["result"] == [8, 3]


def test_run_python_names_the_hosts_an_egress_policy_may_reach(
    md: DaemonHandle, tmp_path: Path
) -> None:
    async def body(session: Any) -> Any:
        return (await session.list_tools()).tools[0].description

    d = _drive(_jaild_mcp(md.socket, "--policy", "web"), tmp_path / "log", body)
    assert ("The jail can make HTTP(S) requests to these hosts only: pypi.org, "
            "files.pythonhosted.org, api.github.com, *.githubusercontent.com (any name below "
            "githubusercontent.com).") in d
    assert "The jail has no network" not in d


def test_jailed_code_calls_the_mcp_servers_tools(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    code = (
        "import asyncio\n"
        "hits = await tools['demo.search_repositories'](query='jail', limit=2)\n"
        "c, d = await asyncio.gather(tools['demo.add'](a=1, b=1), tools['demo.add'](40, 2))\n"
        "print('found', len(hits))\n"
        "{'hits': hits, 'c': c, 'd': d}\n"
    )

    async def body(session: Any) -> Any:
        return await _run(session, code), await _run(session, "x = 1"), await _run(session, "x")

    ok, _, fresh = _drive(_jaild_mcp(md.socket, "--tools", str(servers_json)),
                          tmp_path / "log", body)
    assert ok.is_error is False, _text(ok)
    record = ok.structured_content
    assert record["status"] == "ok" and record["error"] is None
    assert record["result"] == {"hits": [{"name": "jail-0", "stars": 0},
                                         {"name": "jail-1", "stars": 10}], "c": 2, "d": 42}
    assert record["stdout"] == "found 2\n" and record["stderr"] == ""
    assert [c["name"] for c in record["tool_calls"]].count("demo.add") == 2
    assert all(c["ok"] for c in record["tool_calls"]) and len(record["tool_calls"]) == 3
    assert record["usage"]["tool_calls"] == 3 and record["job_id"].startswith("job-")
    text = _text(ok)
    assert text.startswith("status: ok") and '"d": 42' in text and "found 2" in text
    # without --persistent each call is a fresh jail
    assert fresh.is_error is True and fresh.structured_content["error"]["type"] == "NameError"


def test_grouped_access_and_discovery_in_the_jail(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    code = (
        "total = await tools.demo.add(a=2, b=3)\n"
        "found = await tools.search('repositories')\n"
        "schema = await tools.schema('demo.add')\n"
        "listed = await tools.discover()\n"
        "aliases = await _discover()\n"
        "{'total': total, 'found': [t['name'] for t in found], 'schema': schema['parameters'],\n"
        " 'listed': [t['name'] for t in listed], 'same': aliases == listed}\n"
    )

    async def body(session: Any) -> Any:
        return await _run(session, code)

    r = _drive(_jaild_mcp(md.socket, "--tools", str(servers_json)), tmp_path / "log", body)
    assert r.is_error is False, _text(r)
    result = r.structured_content["result"]
    assert result["total"] == 5
    assert result["found"] == ["demo.search_repositories"]
    assert result["schema"]["properties"]["a"]["type"] == "integer"
    assert result["listed"] == ["demo.add", "demo.fail", "demo.search_repositories", "demo.slow",
                                "demo.whoami"]
    assert result["same"] is True


def test_credentials_stay_on_the_host(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    probe = (
        "import os\n"
        f"needle = {SECRET[-12:]!r}\n"
        "leaked = [k for k, v in os.environ.items() if needle in v or needle in k]\n"
    )
    code = probe + "{'who': await tools['demo.whoami'](), 'leaked': leaked, " \
                   "'has_var': 'DEMO_SECRET' in os.environ}\n"
    # positive control: the same probe finds the secret once it is in the jail's environment
    control = f"import os\nos.environ['PLANTED'] = {SECRET!r}\n" + probe + "leaked\n"

    async def body(session: Any) -> Any:
        return await _run(session, code), await _run(session, control)

    r, c = _drive(_jaild_mcp(md.socket, "--tools", str(servers_json)), tmp_path / "log", body)
    assert c.structured_content["result"] == ["PLANTED"], _text(c)
    assert r.is_error is False, _text(r)
    # the server used its secret (the fingerprint proves it had it), the jail got only that
    assert r.structured_content["result"] == {"who": FINGERPRINT, "leaked": [], "has_var": False}
    assert SECRET not in json.dumps(r.structured_content) and SECRET not in _text(r)
    # nor did the daemon see it (tool specs, calls and results all pass through it)
    assert SECRET not in md.log()


def test_failures_are_tool_results_with_is_error(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    async def body(session: Any) -> Any:
        return (
            await _run(session, "values = [1, 2]\nvalues[0] / 0"),
            await _run(session, "def broken(:\n    pass"),
            await _run(session, "try:\n    await tools.demo.fail(reason='x')\n"
                                "except ToolError as e:\n    out = (e.tool, e.error_type, e.message)\n"
                                "out"),
            await _run(session, "await tools['demo.fail'](reason='uncaught')"),
            await session.call_tool("run_python", {"source": "1"}),
        )

    div, syntax, caught, uncaught, bad = _drive(
        _jaild_mcp(md.socket, "--tools", str(servers_json)), tmp_path / "log", body)
    assert div.is_error is True
    assert div.structured_content["status"] == "error"
    assert div.structured_content["error"]["type"] == "ZeroDivisionError"
    assert div.structured_content["error"]["lineno"] == 2
    assert "status: error" in _text(div) and "ZeroDivisionError" in _text(div)
    assert syntax.is_error is True and syntax.structured_content["error"]["type"] == "SyntaxError"
    # an MCP tool's isError arrives in the jail as ToolError with the tool's own text
    assert caught.is_error is False, _text(caught)
    tool, error_type, message = caught.structured_content["result"]
    assert (tool, error_type) == ("demo.fail", "McpToolError")
    assert message.endswith("failed on purpose: x")  # the SDK server prefixes its own words
    assert uncaught.is_error is True and "failed on purpose: uncaught" in _text(uncaught)
    assert uncaught.structured_content["tool_calls"][0]["ok"] is False
    # a malformed call is a tool error naming the problem, not a protocol error
    assert bad.is_error is True and "unknown argument 'source'" in _text(bad)


def test_persistent_mode_shares_one_jaild_session(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    # Every run gets --timeout: the first ones must finish within it (a tool call through
    # the MCP servers: well over a second under TCG), the late one must run past it. So it is
    # the liveness guard's length (within the default policy's 30 s, or the daemon refuses
    # it as looser), and the late run sleeps far beyond it.
    timeout = min(guard(5), 25)

    async def body(session: Any) -> Any:
        first = await _run(session, "import math\nhits = await tools.demo.search_repositories("
                                    "query='a', limit=1)\nx = 41")
        second = await _run(session, "hits.append(await tools.demo.add(a=x, b=1))\nhits")
        with Client(md.socket) as c:
            open_sessions = [row for row in c.jobs() if row["id"].startswith("ses-")]
        # a run that hits a limit ends the jaild session; the next call gets a new one
        late = await _run(session, f"import time\ntime.sleep({timeout + 60})")
        fresh = await _run(session, "'x' in globals()")
        return first, second, open_sessions, late, fresh

    first, second, open_sessions, late, fresh = _drive(
        _jaild_mcp(md.socket, "--tools", str(servers_json), "--persistent", "--timeout",
                   str(timeout)),
        tmp_path / "log", body, timeout=60 + 4 * timeout)
    assert first.is_error is False, _text(first)
    assert second.structured_content["result"] == [{"name": "a-0", "stars": 0}, 42]
    s1, s2 = first.structured_content["session"], second.structured_content["session"]
    assert s1["id"] == s2["id"] and (s1["run"], s2["run"]) == (1, 2)
    assert s1["id"] in {row["id"] for row in open_sessions}
    assert late.is_error is True and late.structured_content["status"] == "timeout"
    assert late.structured_content["session"]["closed"] == "timeout"
    assert "the session ended (timeout)" in _text(late)
    assert fresh.structured_content["result"] is False
    assert fresh.structured_content["session"]["id"] != s1["id"]
    assert "note: the previous jaild session ended (timeout)" in _text(fresh)
    # the MCP session ended: so did the jaild session
    last = fresh.structured_content["session"]["id"]
    deadline = time.monotonic() + guard(10)
    with Client(md.socket) as c:
        while last in {row["id"] for row in c.jobs()} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert last not in {row["id"] for row in c.jobs()}


def test_with_no_socket_named_and_none_listening_it_serves_with_a_private_daemon(
    servers_json: Path, tmp_path: Path
) -> None:
    """The rule of every front end (jaild run, session, codemode): a named socket is used
    as it is (below, in test_startup_errors_name_the_culprit: 69 when nothing answers);
    with none named, the default one if a daemon listens there, else a private daemon for
    this server, stopped with it."""
    assert not os.path.exists("/run/jaild/jaild.sock"), "a system daemon runs here; test needs none"
    argv = [sys.executable, "-m", "jaild", "mcp", "--connect-timeout", str(guard(30)),
            "--tools", str(servers_json)]
    env = {"PATH": os.environ["PATH"], "JAILD_POLICIES": str(REPO / "policies")}

    async def body(session: Any) -> Any:
        return await _run(session, "await tools.demo.add(a=2, b=3)")

    log = tmp_path / "log"
    result = _drive(argv, log, body, env=env)
    assert result.is_error is not True, _text(result)
    assert result.structured_content["result"] == 5
    assert "no daemon at /run/jaild/jaild.sock; serving with a private daemon" in log.read_text()


def test_startup_errors_name_the_culprit(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"mcpServers": {"demo": {"command": "x", "argz": []}}}')
    r = subprocess.run(_jaild_mcp(md.socket, "--tools", str(bad)), capture_output=True,
                       text=True, timeout=guard(30), cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert f"{bad}: mcpServers.demo.argz: unknown key" in r.stderr

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"mcpServers": {"gone": {"command": str(tmp_path / "nope")}}}))
    r = subprocess.run(_jaild_mcp(md.socket, "--tools", str(broken)), capture_output=True,
                       text=True, timeout=guard(30), cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    assert f"MCP server 'gone' (from {broken}) failed to start" in r.stderr

    r = subprocess.run(_jaild_mcp(str(tmp_path / "no.sock")), capture_output=True, text=True,
                       timeout=guard(30), cwd=REPO, stdin=subprocess.DEVNULL)
    assert r.returncode == 69 and "no jaild daemon" in r.stderr

    # --skip-failed serves the rest
    async def body(session: Any) -> Any:
        return (await session.list_tools()).tools[0].description

    description = _drive(
        _jaild_mcp(md.socket, "--tools", str(broken), "--tools", str(servers_json),
                   "--skip-failed"), tmp_path / "log", body)
    assert "demo.add" in description and "gone." not in description


def test_providers_call_timeout_and_positional_arguments(servers_json: Path, tmp_path: Path) -> None:
    """The providers on their own (no daemon): what the jail's calls turn into."""
    from jaild.providers import McpToolError, ToolProviders

    async def main() -> None:
        with open(tmp_path / "err", "w") as errlog:
            async with ToolProviders.load([servers_json], call_timeout_s=0.5, errlog=errlog) as p:
                tools = p.host_tools()
                assert await tools["demo.add"].handler(2, b=3) == 5
                with pytest.raises(TypeError, match="at most 2 positional arguments"):
                    await tools["demo.add"].handler(1, 2, 3)
                with pytest.raises(TypeError, match="two values for argument 'a'"):
                    await tools["demo.add"].handler(1, a=2)
                with pytest.raises(McpToolError, match="failed on purpose: r"):
                    await tools["demo.fail"].handler(reason="r")
                with pytest.raises(TimeoutError, match=r"^demo.slow: no answer within 0.5 s$"):
                    await tools["demo.slow"].handler(seconds=5)
                assert await tools["demo.slow"].handler(0) == "done"  # still connected

    asyncio.run(main())


# --------------------------------------------------------------------------- HTTP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_streamable_http(md: DaemonHandle, servers_json: Path, tmp_path: Path) -> None:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    port = _free_port()
    log_path = tmp_path / "http.log"
    token_file = tmp_path / "token"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _jaild_mcp(md.socket, "--tools", str(servers_json), "--persistent",
                       "--http", f"127.0.0.1:{port}", "--token-file", str(token_file)),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
        )
    try:
        deadline = time.monotonic() + guard(30)
        while True:
            assert proc.poll() is None, log_path.read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "jaild mcp --http did not listen"
            time.sleep(0.05)

        token = token_file.read_text().strip()  # made (0600) by jaild mcp
        assert token_file.stat().st_mode & 0o777 == 0o600

        async def one_session(code: list[str]) -> list[Any]:
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
            async with http, streamable_http_client(f"http://127.0.0.1:{port}/mcp",
                                                    http_client=http) as (r, w), \
                    ClientSession(r, w) as session:
                await session.initialize()
                tools = (await session.list_tools()).tools
                assert "demo.search_repositories" in tools[0].description
                return [await _run(session, c) for c in code]

        async def main() -> tuple[list[Any], list[Any]]:
            a = await one_session(["y = await tools.demo.add(a=20, b=1)", "y * 2"])
            b = await one_session(["y"])
            return a, b

        (set_y, read_y), (other,) = asyncio.run(asyncio.wait_for(main(), guard(60)))
        assert set_y.is_error is False, _text(set_y)
        assert read_y.structured_content["result"] == 42
        assert read_y.structured_content["session"]["run"] == 2
        # another MCP session: another jaild session
        assert other.is_error is True and other.structured_content["error"]["type"] == "NameError"
        assert other.structured_content["session"]["id"] != read_y.structured_content["session"]["id"]
        # each MCP session's end (the client's DELETE) closed its jaild session
        ended = {read_y.structured_content["session"]["id"], other.structured_content["session"]["id"]}
        deadline = time.monotonic() + guard(10)
        with Client(md.socket) as c:
            while ended & {row["id"] for row in c.jobs()} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not ended & {row["id"] for row in c.jobs()}
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=guard(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0, log_path.read_text()[-3000:]
    assert os.path.exists(md.socket)


def test_approvals_are_asked_of_the_mcp_client(
    md: DaemonHandle, servers_json: Path, tmp_path: Path
) -> None:
    """The policy 'guarded' needs approval for demo.add: jaild mcp asks the MCP client's user
    (an elicitation); only an accepted form with allow=true lets the call run."""
    from mcp import types

    asked: list[str] = []
    answers = iter([True, False])

    async def elicit(context: Any, params: Any) -> Any:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"allow": next(answers)})

    code = ("out = []\nfor n in (1, 2):\n    try:\n"
            "        out.append(await tools.demo.add(a=n, b=1))\n"
            "    except ToolError as e:\n        out.append(e.error_type)\nout")

    async def body(session: Any) -> Any:
        return await _run(session, code)

    argv = _jaild_mcp(md.socket, "--tools", str(servers_json), "--policy", "guarded")
    result = _drive(argv, tmp_path / "approve.log", body, elicit=elicit)
    assert not result.is_error, _text(result)
    assert result.structured_content["result"] == [2, "denied"]
    assert len(asked) == 2 and "demo.add" in asked[0] and '"a": 1' in asked[0]

    async def no_elicitation(session: Any) -> Any:  # a client that cannot be asked: denied
        return await _run(session, code)

    result = _drive(argv, tmp_path / "approve2.log", no_elicitation)
    assert result.structured_content["result"] == ["denied", "denied"]


ADD = ("try:\n    out = await tools.demo.add(a=1, b=2)\n"
       "except ToolError as e:\n    out = e.error_type\nout")


@pytest.mark.parametrize("persistent", [False, True])
def test_what_the_model_read_holds_in_its_later_runs(
    md: DaemonHandle, servers_json: Path, tmp_path: Path, persistent: bool
) -> None:
    """Prompt injection across calls: the MCP client's model reads an untrusted result, then
    writes the next run_python. That run holds the label from its start, so the protected
    tool is refused (``integrity``); in a new MCP session, nothing read, it runs (the
    control). One-shot and persistent alike (the persistent one's jaild session could end
    and be reopened: it is opened holding them too)."""
    extra = ("--persistent",) if persistent else ()

    async def read_then_add(session: Any) -> Any:
        before = await _run(session, ADD)
        read = await _run(session, "await tools.demo.search_repositories(query='a', limit=1)")
        after = await _run(session, ADD)
        return before, read, after

    before, read, after = _drive(
        _jaild_mcp(md.socket, "--tools", str(servers_json), "--policy", "flowed", *extra),
        tmp_path / "log", read_then_add)
    assert before.structured_content["result"] == 3, _text(before)  # the control
    assert read.structured_content["flow"]["labels"] == ["untrusted"], _text(read)
    assert after.structured_content["result"] == "integrity", _text(after)
    assert after.structured_content["flow"]["labels"] == ["untrusted"]

    async def add_only(session: Any) -> Any:
        return await _run(session, ADD)

    fresh = _drive(_jaild_mcp(md.socket, "--tools", str(servers_json), "--policy", "flowed",
                              *extra), tmp_path / "log2", add_only)
    assert fresh.structured_content["result"] == 3, _text(fresh)
