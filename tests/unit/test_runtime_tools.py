"""The value-vs-awaitable rule of tool calls (jaild/runtime/tools.py): ``await tools.f()``
always works; with no event loop running a call returns its value; with one running it
returns an AwaitableToolCall, already sent, that refuses every use as a value with a
TypeError saying to write ``await``, and is named on stderr if never awaited."""

from __future__ import annotations

import asyncio
import builtins
import io
import json
from typing import Any

import pytest

from jaild.errors import ToolError
from jaild.protocol import pack, unpack
from jaild.protocol.messages import JailCallTool, ToolSpec
from jaild.runtime import tools as tools_module
from jaild.runtime.execute import run
from jaild.runtime.tools import AwaitableToolCall, Tools, refuse_awaitable_result, report_unawaited


class FakeWaiter:
    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.future: asyncio.Future[Any] | None = loop.create_future() if loop else None


class FakeHost:
    """The channel's two calls the tools proxy makes, answered by a dict of handlers. A
    call made with a loop is answered on the loop's next turn (the reply comes later, as
    over the socket); ``sent`` records each request the moment it is sent."""

    def __init__(self, **handlers: Any) -> None:
        self.handlers = handlers
        self.sent: list[str] = []
        self.outstanding: list[tuple[str, Any]] = []

    def _answer(self, name: str, payload: bytes) -> tuple[bool, Any]:
        args, kwargs = unpack(payload)
        try:
            return True, pack(self.handlers[name](*args, **kwargs))
        except Exception as exc:
            return False, (type(exc).__name__, str(exc))

    def begin_call(self, make_msg: Any, loop: asyncio.AbstractEventLoop | None) -> FakeWaiter:
        msg = make_msg(len(self.sent) + 1)
        assert isinstance(msg, JailCallTool)
        self.sent.append(msg.name)
        waiter = FakeWaiter(loop)
        waiter.outcome = self._answer(msg.name, msg.args)  # type: ignore[attr-defined]
        if loop is not None:
            assert waiter.future is not None
            self.outstanding.append((msg.name, waiter.future))
            loop.call_soon(self._reply, waiter)
        return waiter

    def _reply(self, waiter: FakeWaiter) -> None:
        assert waiter.future is not None
        self.outstanding = [(n, f) for n, f in self.outstanding if f is not waiter.future]
        waiter.future.set_result(waiter.outcome)  # type: ignore[attr-defined]

    def wait(self, waiter: FakeWaiter) -> tuple[bool, Any]:
        return waiter.outcome  # type: ignore[attr-defined,no-any-return]


def boom() -> None:
    raise ValueError("no")


def make_tools(host: FakeHost | None = None) -> tuple[Tools, FakeHost]:
    host = host or FakeHost(f=lambda k="v": {"k": k}, g=lambda: 2, boom=boom,
                            **{"fetch-page": lambda: "page", "gh.search": lambda: ["hit"]})
    specs = tuple(ToolSpec(name=n, description=f"{n} does things") for n in host.handlers)
    return Tools(specs, host, 1 << 16), host  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _forget_unawaited() -> Any:
    yield
    tools_module._unawaited.clear()


def test_with_no_loop_running_a_call_returns_its_value() -> None:
    tools, _ = make_tools()
    assert tools.f() == {"k": "v"}
    assert tools.discover()[0] == {"name": "boom", "description": "boom does things"}
    assert tools.schema("g")["name"] == "g"
    assert report_unawaited(io.StringIO()) == []


def test_await_gives_the_value_and_raises_the_tool_error() -> None:
    tools, _ = make_tools()

    async def job() -> Any:
        with pytest.raises(ToolError, match="no"):
            await tools.boom()
        return (await tools.f("x"), await tools["fetch-page"](), await tools.gh.search(),
                await tools.discover(), await tools.search("fetch"))

    f, page, hits, found, searched = asyncio.run(job())
    assert (f, page, hits) == ({"k": "x"}, "page", ["hit"])
    assert len(found) == 5 and [t["name"] for t in searched] == ["fetch-page"]
    assert report_unawaited(io.StringIO()) == []


def test_a_call_in_a_loop_is_sent_at_once_and_gathers_concurrently() -> None:
    tools, host = make_tools()

    async def job() -> Any:
        a, b = tools.f(), tools.g()
        assert isinstance(a, AwaitableToolCall) and host.sent == ["f", "g"]  # both sent...
        assert [n for n, _ in host.outstanding] == ["f", "g"]  # ...and both in flight
        return await asyncio.gather(a, b, tools.f("z"))

    assert asyncio.run(job()) == [{"k": "v"}, 2, {"k": "z"}]


def test_asyncio_takes_it_as_a_coroutine() -> None:
    tools, _ = make_tools()

    async def job() -> Any:
        task = asyncio.create_task(tools.f("t"))
        waited = await asyncio.wait_for(tools.g(), 30)
        call = tools.f()
        assert "await tools.f(...)" in repr(call)
        return await task, waited, await call, await call  # awaited twice: the same value

    assert asyncio.run(job()) == ({"k": "t"}, 2, {"k": "v"}, {"k": "v"})


USES = {
    "subscripted (['k'])": lambda x: x["k"],
    "asked for its attribute 'items'": lambda x: x.items(),
    "iterated": lambda x: list(x),
    "tested for truth": lambda x: bool(x),
    "asked for its len()": lambda x: len(x),
    "made a str (printed or formatted)": lambda x: str(x),
    "formatted": lambda x: f"{x}",
    "used in arithmetic": lambda x: x + 1,
    "compared (==)": lambda x: x == {"k": "v"},
    "compared (<)": lambda x: x < 3,
    "searched with `in`": lambda x: "k" in x,
    "made an int": lambda x: int(x),
    "called": lambda x: x(),
}


@pytest.mark.parametrize("how", list(USES))
def test_every_use_as_a_value_is_a_type_error_that_says_await(how: str) -> None:
    tools, _ = make_tools()

    async def job() -> None:
        call = tools.f()
        try:
            with pytest.raises(TypeError) as raised:
                USES[how](call)
        finally:
            await call
        assert str(raised.value) == (
            "tools.f(...) returned an awaitable, not its value, because this job runs in an "
            f"event loop (it awaits somewhere), and the awaitable was {how}: write "
            "`await tools.f(...)`"
        )

    asyncio.run(job())


def test_the_message_spells_the_call_as_the_job_wrote_it() -> None:
    tools, _ = make_tools()

    async def job() -> list[str]:
        calls = [tools["fetch-page"](), tools.gh.search(), tools.discover(), tools.schema("f")]
        messages = []
        for call in calls:
            with pytest.raises(TypeError) as raised:
                call["x"]
            messages.append(str(raised.value).split("(...)")[0])
            await call
        return messages

    assert asyncio.run(job()) == ["tools['fetch-page']", "tools.gh.search", "tools.discover",
                                  "tools.schema"]


def test_json_of_it_is_a_type_error_too() -> None:
    tools, _ = make_tools()

    async def job() -> None:
        call = tools.f()
        with pytest.raises(TypeError, match="AwaitableToolCall is not JSON serializable"):
            json.dumps({"x": call})
        await call

    asyncio.run(job())


def test_a_call_never_awaited_is_named_on_stderr() -> None:
    tools, _ = make_tools()
    out = io.StringIO()

    async def job() -> None:
        tools.f()  # dropped on the floor
        x = tools["fetch-page"]()
        await tools.g()
        del x

    asyncio.run(job())
    assert report_unawaited(out) == ["tools.f", "tools['fetch-page']"]
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "jaild: tools.f(...) was called but never awaited: this job runs in an event loop "
        "(it awaits somewhere), so the call returned an awaitable; write `await tools.f(...)`"
    )
    assert len(lines) == 2 and "tools['fetch-page'](...)" in lines[1]
    assert report_unawaited(io.StringIO()) == []  # reported once


def test_a_result_holding_an_awaitable_is_refused() -> None:
    tools, _ = make_tools()

    async def job() -> None:
        call = tools.f()
        for result in (call, [1, call], {"a": (call,)}, {call: 1}):
            with pytest.raises(TypeError, match="returned as the job's result: write `await"):
                refuse_awaitable_result(result)
        refuse_awaitable_result([1, {"a": (2, "x")}])  # the control: plain values pass
        await call

    asyncio.run(job())


def namespace(tools: Tools) -> dict[str, Any]:
    return {"__name__": "__main__", "__builtins__": builtins, "tools": tools}


def test_a_job_that_awaits_elsewhere_fails_with_the_type_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The trap end to end in the runtime's executor: the top level runs in a loop because
    of the ``await`` on its last line, so ``x`` is an awaitable, and ``x["k"]`` says so."""
    tools, _ = make_tools()
    code = 'x = tools.f()\nprint(x["k"])\ny = await tools.g()\n'
    out = run(code, "<job>", namespace(tools), 1 << 16)
    assert not out.ok and out.error is not None and out.error.type == "TypeError"
    assert "write `await tools.f(...)`" in out.error.message and out.error.lineno == 2
    assert "tools.f(...) was called but never awaited" in capsys.readouterr().err


def test_a_job_returning_an_awaitable_fails_and_one_that_awaits_succeeds() -> None:
    tools, _ = make_tools()
    for code in ("y = await tools.g()\nx = tools.f()\nx\n",
                 "async def main():\n    return [tools.f()]\n"):
        out = run(code, "<job>", namespace(tools), 1 << 16)
        assert not out.ok and out.error is not None, code
        assert "returned as the job's result" in out.error.message
    # the controls: awaited, and no loop at all
    out = run("await tools.g()\nawait tools.f()\n", "<job>", namespace(tools), 1 << 16)
    assert out.ok and out.result is not None and unpack(out.result) == {"k": "v"}
    out = run('x = tools.f()\nx["k"]\n', "<job>", namespace(tools), 1 << 16)
    assert out.ok and out.result is not None and unpack(out.result) == "v"


def test_a_closed_stderr_does_not_break_the_report() -> None:
    tools, _ = make_tools()

    async def job() -> None:
        tools.f()

    asyncio.run(job())
    closed = io.StringIO()
    closed.close()
    assert report_unawaited(closed) == ["tools.f"]


def test_a_result_is_walked_only_while_a_call_is_unawaited() -> None:
    tools, _ = make_tools()

    async def job() -> Any:
        call = tools.f()
        await call
        return call

    awaited = asyncio.run(job())
    refuse_awaitable_result([awaited])  # every call awaited: not walked
    with pytest.raises(TypeError, match="returned as the job's result"):
        refuse_awaitable_result(awaited)  # itself: always refused
