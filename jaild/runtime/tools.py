"""The ``tools`` object jailed code sees.

``await tools.search(query="x")``, ``await tools["fetch-page"](url)``,
``asyncio.gather(tools.a(), tools.b())`` -- and, from plain synchronous code
with no event loop running, ``tools.search("x")`` simply returns the value.

Tools named ``server.tool`` (a tool provider's) are also reached per server:
``tools.github.search_repositories(...)`` (a ``-`` in a name may be written ``_``).
Discovery needs no host round trip -- the jail holds every tool's spec:
``tools.discover()`` (names and one-line descriptions), ``tools.schema(name)``,
``tools.search(keyword)``; like calls, they are awaitable when an event loop runs.
A host tool of the same name wins the attribute (``tools.search`` is then that
tool); the globals ``_discover``, ``_schema`` and ``_search`` (as codemode-lite
names them) always mean discovery.

The rule: write ``await tools.f()``: it always works. In a job that never awaits
(no event loop running), a call also returns its value directly.

A job with a top-level ``await`` anywhere runs its top level in an event loop, so
there ``x = tools.f()`` is not the value. Such a call returns an
:class:`AwaitableToolCall`: the request is *already sent* (like a task), so
gathered calls are in flight together on the host, and ``await`` gives the value.
Used as a value instead -- an attribute, an item, iteration, ``bool``, ``len``,
``str``, formatting, arithmetic, a comparison, or as the job's result -- it
raises a :class:`TypeError` saying to write ``await tools.f(...)``; one never
awaited by the end of a run is named on the job's stderr
(:func:`report_unawaited`). Discovery follows the same rule.

A failing host handler surfaces as :class:`ToolError` carrying the host's
exception type and message (never its traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable, Coroutine, Generator, Iterator
from typing import IO, Any, NoReturn

from jaild.errors import ToolError, UnknownToolError
from jaild.protocol import pack, unpack
from jaild.protocol.messages import JailCallTool, ToolSpec
from jaild.runtime.channel import Channel

_DISCOVERY = ("discover", "schema", "search", "intend")
_INTEND = "@intend"  # jaild.policy.flow.INTEND_TOOL (the runtime imports no policy code)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _spelling(name: str) -> str:
    """How the job writes the call of tool ``name``: ``tools.github.search``,
    ``tools["fetch-page"]``, ``tools.intend``."""
    if name == _INTEND:
        return "tools.intend"
    if all(part.isidentifier() for part in name.split(".")):
        return f"tools.{name}"
    return f"tools[{name!r}]"


_unawaited: dict[int, AwaitableToolCall] = {}
"""The calls of this run not awaited yet, by ``id`` (kept alive until :func:`report_unawaited`,
so a call dropped on the floor is still named)."""

_CORO_ATTRIBUTES = frozenset(
    {"cr_await", "cr_code", "cr_frame", "cr_running", "cr_origin", "cr_suspended",
     "gi_code", "gi_frame", "gi_running", "gi_yieldfrom", "gi_suspended"}
)
"""What asyncio and inspect look up on a coroutine with ``hasattr``/``getattr`` defaults: an
``AttributeError`` for these, not the job's ``TypeError``."""


class AwaitableToolCall(Coroutine[Any, Any, Any]):
    """A tool call made while an event loop runs: already sent; ``await`` it for the value.

    A coroutine as far as asyncio is concerned (``gather``, ``create_task``, ``wait_for``
    take it), and nothing else: every use as a value raises a :class:`TypeError` that says
    to write ``await`` (see the module docstring)."""

    __slots__ = ("_future", "_outcome", "_runner", "_spelled")

    def __init__(
        self, spelled: str, future: asyncio.Future[Any], outcome: Callable[[Any], Any]
    ) -> None:
        self._spelled = spelled
        self._future = future
        self._outcome = outcome
        self._runner: Generator[Any, None, Any] | None = None
        _unawaited[id(self)] = self

    def _wait(self) -> Generator[Any, None, Any]:
        _unawaited.pop(id(self), None)
        return self._outcome((yield from self._future))

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait()

    def send(self, value: Any) -> Any:
        if self._runner is None:
            self._runner = self._wait()
        return self._runner.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._runner is None:
            self._runner = self._wait()
        if val is None and tb is None:
            return self._runner.throw(typ)
        return self._runner.throw(typ, val, tb)  # the 3-argument form asyncio may still use

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()

    def __repr__(self) -> str:
        return f"<awaitable call of {self._spelled}(...): write `await {self._spelled}(...)`>"

    def used_as_value(self, how: str = "used as a value") -> TypeError:
        """The error of a use as a value (``how``: what the job did with it)."""
        return TypeError(
            f"{self._spelled}(...) returned an awaitable, not its value, because this job runs "
            f"in an event loop (it awaits somewhere), and the awaitable was {how}: write "
            f"`await {self._spelled}(...)`"
        )

    def _refuse(self, how: str) -> NoReturn:
        raise self.used_as_value(how)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in _CORO_ATTRIBUTES:  # protocol probes: asyncio's
            raise AttributeError(name)
        self._refuse(f"asked for its attribute {name!r}")

    def __getitem__(self, key: Any) -> NoReturn:
        self._refuse(f"subscripted ([{key!r}])")

    def __setitem__(self, key: Any, value: Any) -> NoReturn:
        self._refuse("assigned an item")

    def __iter__(self) -> NoReturn:
        self._refuse("iterated")

    def __contains__(self, item: Any) -> NoReturn:
        self._refuse("searched with `in`")

    def __len__(self) -> NoReturn:
        self._refuse("asked for its len()")

    def __bool__(self) -> NoReturn:
        self._refuse("tested for truth")

    def __str__(self) -> NoReturn:
        self._refuse("made a str (printed or formatted)")

    def __format__(self, spec: str) -> NoReturn:
        self._refuse("formatted")

    def __bytes__(self) -> NoReturn:
        self._refuse("made bytes")

    def __int__(self) -> NoReturn:
        self._refuse("made an int")

    def __float__(self) -> NoReturn:
        self._refuse("made a float")

    def __index__(self) -> NoReturn:
        self._refuse("used as an index")

    def __eq__(self, other: object) -> NoReturn:
        self._refuse("compared (==)")

    def __ne__(self, other: object) -> NoReturn:
        self._refuse("compared (!=)")

    __hash__ = object.__hash__  # by identity: asyncio.gather keys its awaitables in a dict

    def __lt__(self, other: Any) -> NoReturn:
        self._refuse("compared (<)")

    def __le__(self, other: Any) -> NoReturn:
        self._refuse("compared (<=)")

    def __gt__(self, other: Any) -> NoReturn:
        self._refuse("compared (>)")

    def __ge__(self, other: Any) -> NoReturn:
        self._refuse("compared (>=)")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("called")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self._refuse("pickled")

    def _arithmetic(self, *_: Any) -> NoReturn:
        self._refuse("used in arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arithmetic
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _arithmetic
    __pow__ = __rpow__ = __matmul__ = __rmatmul__ = __divmod__ = __rdivmod__ = _arithmetic
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _arithmetic
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _arithmetic
    __neg__ = __pos__ = __abs__ = __invert__ = __round__ = _arithmetic


def refuse_awaitable_result(value: Any, depth: int = 4) -> None:
    """Raise the :class:`TypeError` of :class:`AwaitableToolCall` if a job's result is one, or
    holds one never awaited in a list, tuple, set or dict (keys and values) ``depth`` levels
    down: packing would turn it into its ``repr`` and the job would silently return no value.
    The walk is skipped while every call was awaited (the common case: a result of any size
    costs nothing more)."""
    if isinstance(value, AwaitableToolCall):
        raise value.used_as_value("returned as the job's result")
    if depth <= 0 or not _unawaited:
        return
    if isinstance(value, dict):
        items: Any = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return
    for item in items:
        refuse_awaitable_result(item, depth - 1)


def report_unawaited(stream: IO[str] | None = None) -> list[str]:
    """At the end of a run: one line on ``stream`` (the job's stderr) per tool call of the run
    never awaited, then forget them. Returns the calls named (their spellings)."""
    calls = list(_unawaited.values())
    _unawaited.clear()
    out = sys.stderr if stream is None else stream
    for call in calls:
        with contextlib.suppress(Exception):  # the job may have closed or replaced stderr
            out.write(
                f"jaild: {call._spelled}(...) was called but never awaited: this job runs in "
                f"an event loop (it awaits somewhere), so the call returned an awaitable; "
                f"write `await {call._spelled}(...)`\n"
            )
    return [call._spelled for call in calls]


class Tool:
    """One host tool. Call it like a function (see the module docstring)."""

    def __init__(self, spec: ToolSpec, channel: Channel, payload_limit: int) -> None:
        self.name = spec.name
        self.description = spec.description
        self.parameters = spec.parameters
        self._channel = channel
        self._payload_limit = payload_limit
        schema = json.dumps(spec.parameters, indent=2, sort_keys=True) if spec.parameters else "{}"
        self.__doc__ = f"{spec.description}\n\nArguments (JSON schema):\n{schema}"

    def __repr__(self) -> str:
        return f"<tool {self.name}: {self.description.splitlines()[0] if self.description else ''}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        payload = pack([list(args), kwargs])
        if len(payload) > self._payload_limit:
            raise ToolError(
                self.name,
                "payload_too_large",
                f"arguments are {len(payload)} bytes packed; the limit is {self._payload_limit}",
            )
        name = self.name
        loop = _running_loop()
        waiter = self._channel.begin_call(
            lambda call_id: JailCallTool(call_id=call_id, name=name, args=payload), loop
        )
        if loop is None:
            return self._outcome(self._channel.wait(waiter))
        return AwaitableToolCall(_spelling(name), waiter.future, self._outcome)

    def _outcome(self, outcome: tuple[bool, Any]) -> Any:
        ok, value = outcome
        if ok:
            return unpack(value)
        error_type, message = value
        raise ToolError(self.name, error_type, message)


def _answer(value: Any, spelled: str) -> Any:
    """A discovery result: an :class:`AwaitableToolCall` when an event loop runs in this
    thread (like a tool call), the value itself otherwise. ``spelled``: how the job wrote
    the call (``tools.discover``)."""
    loop = _running_loop()
    if loop is None:
        return value
    future = loop.create_future()
    future.set_result(value)
    return AwaitableToolCall(spelled, future, lambda answer: answer)


def _summary(tool: Tool) -> dict[str, str]:
    first = tool.description.strip().splitlines()[0] if tool.description.strip() else ""
    return {"name": tool.name, "description": first}


class ToolGroup:
    """``tools.<server>``: the tools named ``<server>.<name>``, by attribute."""

    def __init__(self, tools: Tools, prefix: str) -> None:
        self._owner = tools
        self._prefix = prefix

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._owner._lookup(self._prefix + name)

    def __dir__(self) -> list[str]:
        n = len(self._prefix)
        below = (t[n:] for t in self._owner._tools if t.startswith(self._prefix))
        return sorted({t.split(".")[0].replace("-", "_") for t in below})

    def __repr__(self) -> str:
        return f"<tools of {self._prefix[:-1]}: {', '.join(dir(self))}>"


class Tools:
    """``tools``: attribute or item access by name; iterable; ``help(tools.x)`` shows a schema."""

    def __init__(self, specs: tuple[ToolSpec, ...], channel: Channel, payload_limit: int) -> None:
        self._tools = {s.name: Tool(s, channel, payload_limit) for s in specs}
        self._planner = Tool(ToolSpec(name="intend"), channel, payload_limit)
        self._planner.name = _INTEND  # not a tool name a host can give: the daemon's own
        # attribute spellings: "list-events" may be written list_events
        self._aliases = {n.replace("-", "_"): n for n in self._tools if "-" in n}

    def _unknown(self, name: str) -> UnknownToolError:
        available = ", ".join(sorted(self._tools)) or "(none)"
        return UnknownToolError(
            name, "unknown_tool", f"no tool named {name!r}; available: {available}"
        )

    def _lookup(self, name: str) -> Tool | ToolGroup:
        """A tool by (attribute) name, else the group of tools below that prefix."""
        tool = self._tools.get(name) or self._tools.get(self._aliases.get(name, ""))
        if tool is not None:
            return tool
        prefix = name + "."
        if any(n.startswith(prefix) or n.replace("-", "_").startswith(prefix) for n in self._tools):
            return ToolGroup(self, prefix)
        raise self._unknown(name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _DISCOVERY and name not in self._tools:
            return getattr(self, "_" + name)
        return self._lookup(name)

    # -- planning (docs/using/flow.md, "Plans"): answered by the daemon, no host round trip

    def _intend(self, tool: str, /, **pinned: Any) -> Any:
        """Plan a call of ``tool`` (a protected one, under a policy's ``[[flow.plan]]``)
        before the job reads untrusted data, pinning some of its arguments' values: once
        the job holds untrusted data, one call of ``tool`` with those values may still go
        through. Awaitable inside ``async`` code, like a tool call."""
        if tool not in self._tools:
            raise self._unknown(tool)
        return self._planner(tool, **pinned)

    # -- discovery (no host round trip)

    def _discover(self) -> Any:
        """Every tool: ``[{"name", "description"}]`` (the first line of each description)."""
        return _answer([_summary(self._tools[n]) for n in sorted(self._tools)], "tools.discover")

    def _schema(self, name: str) -> Any:
        """One tool in full: ``{"name", "description", "parameters"}`` (a JSON schema)."""
        tool = self._tools.get(name) or self._tools.get(self._aliases.get(name, ""))
        if tool is None:
            raise self._unknown(name)
        return _answer(
            {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
            "tools.schema",
        )

    def _search(self, keyword: str) -> Any:
        """Tools whose name or description mentions ``keyword`` (case-insensitive), names
        first."""
        word = str(keyword).lower()
        hits = [
            (word not in n.lower(), n)
            for n, t in self._tools.items()
            if word in n.lower() or word in t.description.lower()
        ]
        return _answer([_summary(self._tools[n]) for _, n in sorted(hits)], "tools.search")

    def __getitem__(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise self._unknown(name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._tools))

    def __len__(self) -> int:
        return len(self._tools)

    def __dir__(self) -> list[str]:
        names = {n.split(".")[0].replace("-", "_") for n in self._tools}
        return sorted(n for n in names | set(_DISCOVERY) if n.isidentifier())

    def __repr__(self) -> str:
        return f"<tools: {', '.join(sorted(self._tools)) or '(none)'}>"
