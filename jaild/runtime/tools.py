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

A call made while an event loop runs in the calling thread returns an awaitable
and is *already sent* (like a task), so gathered calls are in flight together
on the host. A failing host handler surfaces as :class:`ToolError` carrying the
host's exception type and message (never its traceback).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

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
        return self._await(waiter.future)

    async def _await(self, future: asyncio.Future[Any]) -> Any:
        return self._outcome(await future)

    def _outcome(self, outcome: tuple[bool, Any]) -> Any:
        ok, value = outcome
        if ok:
            return unpack(value)
        error_type, message = value
        raise ToolError(self.name, error_type, message)


def _answer(value: Any) -> Any:
    """A discovery result: awaitable when an event loop runs in this thread (like a tool
    call), the value itself otherwise."""
    if _running_loop() is None:
        return value

    async def ready() -> Any:
        return value

    return ready()


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
        return _answer([_summary(self._tools[n]) for n in sorted(self._tools)])

    def _schema(self, name: str) -> Any:
        """One tool in full: ``{"name", "description", "parameters"}`` (a JSON schema)."""
        tool = self._tools.get(name) or self._tools.get(self._aliases.get(name, ""))
        if tool is None:
            raise self._unknown(name)
        return _answer(
            {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
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
        return _answer([_summary(self._tools[n]) for _, n in sorted(hits)])

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
