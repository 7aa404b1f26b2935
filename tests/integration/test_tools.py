"""Tool calls from jailed code to host handlers: sync, async, concurrent, failing, unknown, oversize."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaild.client import Client
from jaild.errors import ConnectionLost, PermissionDenied
from tests.conftest import DaemonHandle, guard

pytestmark = pytest.mark.integration


def search(query: str, limit: int = 2) -> list[str]:
    """Search something."""
    return [f"{query}:{i}" for i in range(limit)]


async def fetch_page(url: str) -> dict[str, object]:
    await asyncio.sleep(0.01)
    return {"url": url, "ok": True}


TOOLS = {"search": search, "fetch-page": fetch_page}


def test_sync_handler_with_keyword_arguments(client: Client) -> None:
    r = client.run("await tools.search(query='x', limit=3)", tools=TOOLS)
    assert (r.status, r.result) == ("ok", ["x:0", "x:1", "x:2"])
    assert r.tool_calls and r.tool_calls[0]["name"] == "search" and r.tool_calls[0]["ok"] is True


def test_async_handler_and_item_access_for_non_identifier_names(client: Client) -> None:
    r = client.run("await tools['fetch-page']('http://example')", tools=TOOLS)
    assert r.result == {"url": "http://example", "ok": True}


def test_blocking_call_from_plain_synchronous_code(client: Client) -> None:
    r = client.run("def helper():\n    return tools.search('y')\nhelper()", tools=TOOLS)
    assert (r.status, r.result) == ("ok", ["y:0", "y:1"])


def test_blocking_call_from_a_worker_thread_inside_async_code(client: Client) -> None:
    code = (
        "import asyncio\n"
        "async def main():\n"
        "    loop = asyncio.get_running_loop()\n"
        "    return await loop.run_in_executor(None, lambda: tools.search('t', 1))\n"
    )
    assert client.run(code, tools=TOOLS).result == ["t:0"]


def test_gathered_calls_are_in_flight_together_on_the_host(client: Client) -> None:
    barrier = threading.Barrier(3, timeout=guard(10))

    def meet(i: int) -> int:
        barrier.wait()  # only returns once all three calls are running at the same time
        return i

    r = client.run("import asyncio\nawait asyncio.gather(*(tools.meet(i) for i in range(3)))",
                   tools={"meet": meet})
    assert (r.status, r.result) == ("ok", [0, 1, 2])


def test_async_handlers_run_concurrently(client: Client) -> None:
    # Each call waits until all six are in their handler at once: proof that the async
    # handlers run concurrently (one after the other, the first would wait in vain).
    in_handler = 0
    peak = 0
    all_in = asyncio.Event()

    async def slow(i: int) -> int:
        nonlocal in_handler, peak
        in_handler += 1
        peak = max(peak, in_handler)
        if in_handler == 6:
            all_in.set()
        try:
            await asyncio.wait_for(all_in.wait(), guard(60))
        finally:
            in_handler -= 1
        return i

    r = client.run("import asyncio\nawait asyncio.gather(*(tools.slow(i) for i in range(6)))",
                   tools={"slow": slow})
    assert (r.status, r.result) == ("ok", list(range(6))), r.error
    assert peak == 6


def test_failing_handler_is_a_tool_error_without_host_traceback(client: Client) -> None:
    def broken(x: int) -> int:
        secret_local = "host-secret"  # noqa: F841 -- must not leak
        raise KeyError(f"no such thing: {x}")

    code = (
        "try:\n"
        "    await tools.broken(5)\n"
        "except ToolError as e:\n"
        "    result = (e.tool, e.error_type, e.message, str(e))\n"
        "result"
    )
    r = client.run(code, tools={"broken": broken})
    assert r.result == ["broken", "KeyError", "'no such thing: 5'", "broken: KeyError: 'no such thing: 5'"]
    assert r.tool_calls[0]["ok"] is False
    assert r.tool_calls[0]["error_type"] == "KeyError"


def test_uncaught_tool_error_fails_the_job(client: Client) -> None:
    def broken() -> None:
        raise RuntimeError("nope")

    r = client.run("x = 1\nawait tools.broken()", tools={"broken": broken})
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "ToolError"
    assert "host-secret" not in (r.error["traceback"] or "")
    # the user's frames only: their line, none of the runtime's (the tools proxy) below it
    tb = r.error["traceback"]
    assert 'line 2, in <module>' in tb and "await tools.broken()" in tb, tb
    assert "/opt/jaild" not in tb and "jaild/runtime" not in tb, tb


def test_unknown_tool_lists_the_available_ones(client: Client) -> None:
    r = client.run("await tools.nope()", tools=TOOLS)
    assert r.status == "error"
    assert r.error is not None
    assert "no tool named 'nope'; available: fetch-page, search" in r.error["message"]
    r = client.run("'nope' in tools, hasattr(tools, 'nope'), sorted(tools)", tools=TOOLS)
    assert r.result == [False, False, ["fetch-page", "search"]]


def test_forged_call_to_an_unregistered_tool_is_refused_by_the_daemon(client: Client) -> None:
    # Bypass the runtime: write a CallTool frame for a tool the client never registered.
    code = (
        "import os, msgpack, struct, time\n"
        "frame = msgpack.packb({'type': 'CallTool', 'call_id': 999, 'name': 'steal',"
        " 'args': msgpack.packb([[], {}])})\n"
        "os.write(3, struct.pack('>I', len(frame)) + frame)\n"
        "time.sleep(0.5)\n"
        "'sent'"
    )
    calls: list[str] = []
    r = client.run(code, tools={"search": lambda q: calls.append(q)})
    assert (r.status, r.result) == ("ok", "sent")
    assert calls == []
    assert r.tool_calls == [{"name": "(unknown)", "duration_s": 0.0, "ok": False, "error_type": "unknown_tool"}]


def test_oversize_arguments_are_refused_in_the_jail(daemon: DaemonHandle) -> None:
    code = (
        "try:\n"
        "    await tools.echo('x' * 10000)\n"
        "except ToolError as e:\n"
        "    result = e.error_type\n"
        "result"
    )
    r = daemon.run(code, policy="tiny", tools={"echo": lambda s: s})  # tiny: 4096-byte payloads
    assert (r.status, r.result) == ("ok", "payload_too_large")


def test_oversize_result_is_refused_not_hung(daemon: DaemonHandle) -> None:
    code = (
        "try:\n"
        "    await tools.big()\n"
        "except ToolError as e:\n"
        "    result = (e.error_type, 'bytes' in e.message)\n"
        "result"
    )
    r = daemon.run(code, policy="tiny", tools={"big": lambda: "y" * 10000})
    assert (r.status, r.result) == ("ok", ["payload_too_large", True])


def test_forged_oversize_frame_on_the_channel_ends_the_job(daemon: DaemonHandle) -> None:
    code = "import os, struct\nos.write(3, struct.pack('>I', 1 << 30))\nimport time\ntime.sleep(5)"
    r = daemon.run(code, policy="tiny")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "ChannelError"
    assert "frame announces" in r.error["message"]
    daemon.assert_serving()


def test_calls_beyond_the_in_flight_cap_fail_clearly(daemon: DaemonHandle) -> None:
    # The two calls let in stay in flight until the daemon has refused the other two (its
    # audit log says so): the refusals cannot come from calls that had already ended.
    def refused() -> int:
        return sum("event=tool_call" in line and "tool=slow" in line
                   and "outcome=too_many_calls" in line for line in daemon.log().splitlines())

    before = refused()

    async def slow() -> str:
        deadline = time.monotonic() + guard(60)
        while refused() < before + 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return "done"

    code = (
        "import asyncio\n"
        "outs = await asyncio.gather(*(tools.slow() for _ in range(4)), return_exceptions=True)\n"
        "[o if isinstance(o, str) else o.error_type for o in outs]"
    )
    r = daemon.run(code, policy="tiny", tools={"slow": slow})  # tiny: 2 in flight
    assert r.status == "ok", r.error
    assert sorted(r.result) == ["done", "done", "too_many_calls", "too_many_calls"]


def test_reused_call_id_is_channel_abuse(daemon: DaemonHandle) -> None:
    async def slow() -> None:
        await asyncio.sleep(2)

    code = (
        "import os, msgpack, struct, time\n"
        "frame = msgpack.packb({'type': 'CallTool', 'call_id': 7, 'name': 'slow', 'args': msgpack.packb([[], {}])})\n"
        "os.write(3, (struct.pack('>I', len(frame)) + frame) * 2)\n"
        "time.sleep(5)"
    )
    r = daemon.run(code, tools={"slow": slow})
    assert r.status == "error"
    assert r.error is not None and "reused call id 7" in r.error["message"]


def test_tool_arguments_that_msgpack_cannot_carry_arrive_as_repr(client: Client) -> None:
    got: list[object] = []
    r = client.run("import datetime\nawait tools.keep(datetime.date(2026, 1, 2))",
                   tools={"keep": lambda d: got.append(d)})
    assert r.status == "ok"
    assert got == ["datetime.date(2026, 1, 2)"]


def test_help_shows_the_tool_schema(client: Client) -> None:
    r = client.run("tools.search.__doc__", tools=TOOLS)
    assert r.result.startswith("Search something.")
    assert '"query"' in r.result and '"limit"' in r.result


def test_policy_tool_grants(daemon: DaemonHandle) -> None:
    with Client(daemon.socket) as c:
        ok = c.run("await tools.allowed_echo(1)", policy="limited-tools",
                   tools={"allowed_echo": lambda x: x})
        assert ok.result == 1
        with pytest.raises(PermissionDenied, match="does not allow tool"):
            c.run("1", policy="limited-tools", tools={"search": search})


def test_client_disconnect_during_a_tool_call_cancels_the_job(daemon: DaemonHandle) -> None:
    from jaild.client import AsyncClient

    entered = threading.Event()

    def hang() -> None:
        entered.set()
        time.sleep(3)

    async def scenario() -> None:
        c = AsyncClient(daemon.socket)
        await c.connect()
        job = await c.submit("await tools.hang()", tools={"hang": hang})
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        await c.close()
        with pytest.raises(ConnectionLost):
            await job.result()

    asyncio.run(scenario())
    deadline = time.monotonic() + guard(10)
    while time.monotonic() < deadline and "client disconnected" not in daemon.log():
        time.sleep(0.05)
    assert "status=cancelled" in daemon.log()
    daemon.assert_serving()


def test_handler_error_with_unencodable_text_still_answers(client: Client) -> None:
    def weird() -> None:
        raise ValueError("lone \udc80 surrogate")

    code = "try:\n    await tools.weird()\nexcept ToolError as e:\n    result = e.message\nresult"
    r = client.run(code, tools={"weird": weird}, timeout=10)
    assert (r.status, r.result) == ("ok", "lone \\udc80 surrogate")


# -- the value-vs-awaitable rule: `await tools.f()` always works; with no loop, a call is its
# value; in a job that awaits elsewhere, a call used as a value says to write `await`


def lookup() -> dict[str, str]:
    return {"k": "v"}


def test_a_call_used_as_a_value_in_a_job_that_awaits_says_to_write_await(client: Client) -> None:
    code = 'x = tools.lookup()\nprint(x["k"])\ny = await tools.lookup()\n'
    r = client.run(code, tools={"lookup": lookup})
    assert r.status == "error" and r.error is not None and r.error["type"] == "TypeError"
    assert r.error["message"] == (
        "tools.lookup(...) returned an awaitable, not its value, because this job runs in an "
        "event loop (it awaits somewhere), and the awaitable was subscripted (['k']): write "
        "`await tools.lookup(...)`"
    )
    assert "line 2" in r.error["traceback"], r.error["traceback"]
    # the call went out, never awaited: named on the job's stderr
    assert "jaild: tools.lookup(...) was called but never awaited" in r.stderr, r.stderr


def test_awaited_the_same_call_gives_its_value(client: Client) -> None:
    code = 'x = await tools.lookup()\nprint(x["k"])\nawait tools.lookup()\n'
    r = client.run(code, tools={"lookup": lookup})
    assert (r.status, r.result, r.stdout, r.stderr) == ("ok", {"k": "v"}, "v\n", "")


def test_a_job_that_never_awaits_gets_values(client: Client) -> None:
    code = 'x = tools.lookup()\nprint(x["k"])\n[t["name"] for t in tools.discover()]'
    r = client.run(code, tools={"lookup": lookup})
    assert (r.status, r.result, r.stdout, r.stderr) == ("ok", ["lookup"], "v\n", "")


def test_a_dropped_call_and_an_awaitable_result_are_loud(client: Client) -> None:
    r = client.run("tools.lookup()\ny = await tools.lookup()\ny\n", tools={"lookup": lookup})
    assert r.status == "ok" and r.result == {"k": "v"}
    assert r.stderr.count("never awaited") == 1 and "tools.lookup(...)" in r.stderr, r.stderr
    r = client.run("async def main():\n    return {'x': tools.lookup()}\n", tools={"lookup": lookup})
    assert r.status == "error" and r.error is not None and r.error["type"] == "TypeError"
    assert "returned as the job's result: write `await tools.lookup(...)`" in r.error["message"]


def test_gathered_calls_are_concurrent_and_tasks_take_them(client: Client) -> None:
    barrier = threading.Barrier(2, timeout=guard(10))

    def meet(i: int) -> int:
        barrier.wait()  # both calls in their handlers at once, or this times out
        return i

    code = ("import asyncio\n"
            "task = asyncio.create_task(tools.meet(0))\n"
            "both = await asyncio.gather(task, tools.meet(1))\n"
            "both\n")
    r = client.run(code, tools={"meet": meet})
    assert (r.status, r.result) == ("ok", [0, 1]), r.error
