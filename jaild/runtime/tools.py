"""The ``tools`` object jailed code sees.

``await tools.search(query="x")``, ``await tools["fetch-page"](url)``,
``asyncio.gather(tools.a(), tools.b())`` -- and, from plain synchronous code
with no event loop running, ``tools.search("x")`` simply returns the value.

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

from jaild.protocol import pack, unpack
from jaild.protocol.messages import JailCallTool, ToolSpec
from jaild.runtime.channel import Channel


class ToolError(Exception):
    """A tool call failed on the host side (or was refused by the daemon).

    Attributes: ``tool`` (name), ``error_type`` (the host exception's type name,
    or a jaild reason such as ``payload_too_large``), ``message``.
    """

    def __init__(self, tool: str, error_type: str, message: str) -> None:
        super().__init__(f"{tool}: {error_type}: {message}")
        self.tool = tool
        self.error_type = error_type
        self.message = message


class UnknownToolError(ToolError, AttributeError, KeyError):
    """No tool of that name. Also an AttributeError/KeyError, so hasattr/`in` work."""

    def __str__(self) -> str:
        return str(self.args[0])


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


class Tools:
    """``tools``: attribute or item access by name; iterable; ``help(tools.x)`` shows a schema."""

    def __init__(self, specs: tuple[ToolSpec, ...], channel: Channel, payload_limit: int) -> None:
        self._tools = {s.name: Tool(s, channel, payload_limit) for s in specs}

    def _unknown(self, name: str) -> UnknownToolError:
        available = ", ".join(sorted(self._tools)) or "(none)"
        return UnknownToolError(
            name, "unknown_tool", f"no tool named {name!r}; available: {available}"
        )

    def __getattr__(self, name: str) -> Tool:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self._tools[name]
        except KeyError:
            raise self._unknown(name) from None

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
        return sorted(n for n in self._tools if n.isidentifier())

    def __repr__(self) -> str:
        return f"<tools: {', '.join(sorted(self._tools)) or '(none)'}>"
