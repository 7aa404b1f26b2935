"""Host-side tools: a Python function becomes a tool with a name, a description and a JSON schema.

The schema comes from the signature and type hints (``str`` -> string, ``int``
-> integer, ``list[str]`` -> array of strings, ``X | None`` -> nullable,
``Literal[...]`` -> enum, ...); the description is the docstring.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaild.protocol.messages import TOOL_NAME, ToolSpec


@dataclass(frozen=True)
class HostTool:
    """A tool as the client holds it: its spec plus the handler that runs on the host."""

    name: str
    description: str
    parameters: dict[str, Any]
    handler: Callable[..., Any]
    timeout_s: float | None = None
    """This tool's call timeout (the daemon caps it at the policy's ``tool_call_timeout_s``)."""
    approval: bool = False
    """Every call waits for the client's ``approve`` callback before the handler runs."""
    labels: tuple[str, ...] = ()
    """Information-flow labels every result carries (docs/using/flow.md)."""
    protected: bool = False
    """Its arguments must not depend on untrusted data (docs/using/flow.md)."""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.handler)

    def spec(self) -> ToolSpec:
        return ToolSpec(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            timeout_s=self.timeout_s,
            approval=self.approval,
            labels=self.labels,
            protected=self.protected,
        )


@dataclass(frozen=True)
class Labeled:
    """A tool's result with labels of its own: ``return Labeled(rows, "user:alice")``.

    The daemon adds ``labels`` (beside the tool's and the policy's) to the labels of the job
    before the jail sees ``value`` (docs/using/flow.md)."""

    value: Any
    labels: tuple[str, ...]

    def __init__(self, value: Any, *labels: str) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "labels", tuple(labels))


_OPTIONS = "__jaild_tool__"


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    timeout_s: float | None = None,
    approval: bool = False,
    labels: Iterable[str] = (),
    protected: bool = False,
) -> Any:
    """Mark a function as a tool with options: ``@tool(approval=True, timeout_s=5)``.

    ``approval``: each call first asks the client's ``approve`` callback (a denial surfaces
    in the jail as ``ToolError`` with ``error_type == "denied"``). ``timeout_s``: this tool's
    call timeout. ``labels``: information-flow labels every result carries (``private``,
    ``untrusted``); ``protected``: its arguments must not depend on untrusted data
    (docs/using/flow.md). The function itself is returned unchanged."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _OPTIONS, {"name": name, "timeout_s": timeout_s, "approval": approval,
                              "labels": tuple(labels), "protected": protected})
        return f

    return mark(fn) if fn is not None else mark


_SIMPLE: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    bytes: {"type": "string", "contentEncoding": "binary"},
    type(None): {"type": "null"},
    dict: {"type": "object"},
    list: {"type": "array"},
    tuple: {"type": "array"},
    Any: {},
}


def type_schema(tp: Any) -> dict[str, Any]:
    """JSON schema of a type hint (best effort; unknown types accept anything)."""
    if tp in _SIMPLE:
        return dict(_SIMPLE[tp])
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [type_schema(a) for a in args]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, set, frozenset, Iterable, typing.Sequence) or (
        origin is tuple and len(args) == 2 and args[1] is Ellipsis
    ):
        return {"type": "array", "items": type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        return {"type": "array", "prefixItems": [type_schema(a) for a in args]}
    if origin in (dict, Mapping):
        return (
            {"type": "object", "additionalProperties": type_schema(args[1])}
            if args
            else {"type": "object"}
        )
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        return {
            "type": "object",
            "properties": {
                f.name: type_schema(hints.get(f.name, Any)) for f in dataclasses.fields(tp)
            },
        }
    return {}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> HostTool:
    """Describe ``fn`` as a tool called ``name`` (default: its ``__name__``)."""
    import re

    options = getattr(fn, _OPTIONS, {})
    tool_name: str = name or options.get("name") or str(getattr(fn, "__name__", ""))
    if not re.fullmatch(TOOL_NAME, tool_name or ""):
        raise ValueError(f"tool name {tool_name!r} must match {TOOL_NAME}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    extra = False
    if sig is not None:
        for p in sig.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                extra = True
                continue
            if p.kind is p.VAR_POSITIONAL:
                continue
            schema = type_schema(hints.get(p.name, Any))
            if p.default is p.empty:
                required.append(p.name)
            elif _jsonable(p.default):
                schema["default"] = p.default
            properties[p.name] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    if not extra:
        parameters["additionalProperties"] = False
    description = inspect.cleandoc(fn.__doc__) if fn.__doc__ else ""
    return HostTool(
        tool_name,
        description,
        parameters,
        fn,
        timeout_s=options.get("timeout_s"),
        approval=bool(options.get("approval")),
        labels=tuple(options.get("labels", ())),
        protected=bool(options.get("protected")),
    )


def normalize_tools(tools: Mapping[str, Any] | Iterable[Any] | None) -> dict[str, HostTool]:
    """Accept ``{"name": fn}``, ``[fn, ...]`` or HostTool objects."""
    if tools is None:
        return {}
    out: dict[str, HostTool] = {}
    items: Iterable[tuple[str | None, Any]] = (
        tools.items() if isinstance(tools, Mapping) else ((None, t) for t in tools)
    )
    for name, value in items:
        if isinstance(value, HostTool):
            tool = value if name in (None, value.name) else dataclasses.replace(value, name=name)
        elif callable(value):
            tool = tool_from_function(value, name)
        else:
            raise TypeError(f"tool {name!r} is not callable")
        if tool.name in out:
            raise ValueError(f"two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


def load_tools_file(path: str) -> dict[str, HostTool]:
    """The public functions defined in a Python file, as tools (``jaild run --tools FILE``)."""
    file = Path(path).resolve()
    module_name = f"jaild_tools_{abs(hash(str(file)))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load tools from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    functions = [
        obj
        for attr, obj in vars(module).items()
        if not attr.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module_name
    ]
    return normalize_tools(functions)


def describe_flow(flow: Iterable[str]) -> list[str]:
    """A policy's information-flow rules (``PolicyEntry.flow``), as a model's prompt says
    them: what closes once the program has read labelled data (docs/using/flow.md)."""
    rules = list(flow)
    if not rules:
        return []
    return [
        "Information flow (enforced outside the sandbox, whatever the code does): tool "
        "results carry labels, and once the program has read labelled data some ways out "
        "close for the rest of the run (and of the session):",
        *(f"- {rule}" for rule in rules),
        "A closed send fails: a tool call raises ToolError (error_type flow_denied or "
        "integrity), an HTTP request gets 403 naming the label. Make such sends before "
        "reading the labelled data, or leave them to the user.",
    ]


def describe_network(mode: str, egress: Iterable[str] = ()) -> str:
    """What a policy's network is, in words a model acts on (the MCP ``run_python``
    description, the code-mode prompt). ``mode`` and ``egress`` are a ``PolicyEntry``'s."""
    if mode == "egress":
        hosts = ", ".join(
            f"{h} (any name below {h[2:]})" if h.startswith("*.") else h for h in egress
        )
        return (
            f"The jail can make HTTP(S) requests to these hosts only: {hosts}. urllib, "
            "requests, httpx and pip already use the proxy that enforces this (do not set "
            "proxies or turn off certificate checks). Any other host is refused with HTTP 403 "
            "and the reason; there is no other network access."
        )
    if mode == "loopback":
        return "The jail has no network but its own loopback (127.0.0.1)."
    if mode == "host":
        return "The jail shares the host's network."
    return (
        "The jail has no network: opening an internet socket or looking up a name raises "
        "PermissionError, and the program goes on."
    )
