"""Host-side tool providers: MCP servers and Python modules whose tools jailed code may call.

Any jaild client can use them (``jaild mcp``, the codemode loop, scripts)::

    async with ToolProviders.load(["~/MCPs", "tools.py"]) as providers:
        r = await client.run(code, tools=providers.host_tools())

Sources:

* **MCP servers** in the common ``mcpServers`` JSON format (Claude Desktop, Cursor,
  ``.mcp.json``), one file or every ``*.json`` in a directory::

      {"mcpServers": {
         "github": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-github"],
                    "env": {"GITHUB_TOKEN": "${GITHUB_TOKEN}"}},
         "calendar": {"type": "sse", "url": "http://localhost:3001/sse"},
         "search": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer …"}}}}

  ``command`` starts a stdio server (with ``args``, ``env``, ``cwd``); ``url`` connects over
  streamable HTTP, or SSE with ``"type": "sse"``. ``${VAR}`` and ``${VAR:-default}`` are
  expanded from the host's environment in every string. ``"disabled": true`` skips a server.
* **Python modules** (``path.py``): their public functions, named by :func:`module_sources`'
  rule, the one of every ``--tools`` flag (``jaild run``, ``jaild session``, ``jaild mcp``,
  ``jaild codemode``): a module given alone is at the top (``tools.f``); several given
  without a group are each under their file's stem (``tools.STEM.f``); ``GROUP=path.py``
  puts one under ``tools.GROUP``, ``=path.py`` at the top.

Each MCP tool becomes the jaild host tool ``<server>.<tool>`` whose arguments schema is the
tool's ``inputSchema``; calling it calls the MCP tool and returns plain values (see
:func:`result_value`). Names are made to fit jaild's tool names: in the server part every
character other than ``A-Z a-z 0-9 _ -`` becomes ``_`` (a dot too: the first dot separates the
server from the tool), in the tool part every character other than those and ``.``; a part
that would start with a digit or ``-`` gets a leading ``_``.

Credentials stay on the host: a stdio server's ``env`` goes to that subprocess only (which,
as the MCP SDK does, inherits only a few safe variables such as ``PATH`` and ``HOME`` from
this process), headers go to that HTTP connection only; jaild and the jail see tool names,
descriptions, argument schemas and results, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from jaild.errors import ConfigError, McpServerError, McpToolError, ProviderError
from jaild.extras import require
from jaild.protocol.messages import MAX_DESCRIPTION_CHARS, MAX_NAME_CHARS, TOOL_NAME
from jaild.toolspec import HostTool, load_tools_file

log = logging.getLogger("jaild.providers")

DEFAULT_CONNECT_TIMEOUT_S = 30.0
DEFAULT_CALL_TIMEOUT_S = 120.0
CLOSE_TIMEOUT_S = 10.0

Transport = Literal["stdio", "sse", "streamable-http"]
_TYPES: dict[str, Transport] = {
    "stdio": "stdio",
    "sse": "sse",
    "http": "streamable-http",
    "streamable-http": "streamable-http",
    "streamable_http": "streamable-http",
    "streamableHttp": "streamable-http",
}
_STDIO_KEYS = frozenset({"type", "command", "args", "env", "cwd", "disabled"})
_HTTP_KEYS = frozenset({"type", "url", "headers", "disabled"})
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


# --------------------------------------------------------------------------- errors


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class McpServerConfig:
    """One entry of an ``mcpServers`` file (after ``${VAR}`` expansion)."""

    name: str
    transport: Transport
    source: str
    """The file it came from (for messages)."""
    command: str = ""
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # never show env values or headers (credentials)
        target = self.url if self.transport != "stdio" else " ".join([self.command, *self.args])
        return f"<McpServerConfig {self.name} {self.transport} {target!r} from {self.source}>"


@dataclass(frozen=True)
class ModuleSource:
    """A Python module of host functions; ``group`` is the name prefix ("" for none)."""

    path: str
    group: str


def _no_duplicate_keys(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(source, key, "this key appears twice in one object")
            out[key] = value
        return out

    return hook


def _expand(value: str, source: str, key: str, environ: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ConfigError(
            source, key, f"${{{name}}} is not set in the environment (use ${{{name}:-default}} "
            "for a default)"
        )

    return _VAR.sub(one, value)


def _string(value: Any, source: str, key: str, environ: Mapping[str, str]) -> str:
    if not isinstance(value, str):
        raise ConfigError(source, key, f"must be a string, got {type(value).__name__}")
    return _expand(value, source, key, environ)


def _string_map(
    value: Any, source: str, key: str, environ: Mapping[str, str]
) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(source, key, f"must be an object of strings, got {type(value).__name__}")
    return {k: _string(v, source, f"{key}.{k}", environ) for k, v in value.items()}


def parse_mcp_servers(
    data: Any, source: str, environ: Mapping[str, str] | None = None
) -> list[McpServerConfig]:
    """Validate a decoded ``{"mcpServers": {...}}`` document.

    Args:
        data: the decoded JSON.
        source: where it came from, for messages (a file name).
        environ: for ``${VAR}`` expansion (default: ``os.environ``).

    Returns:
        The enabled servers, in file order.

    Raises:
        ConfigError: naming the source, the key path and the problem.
    """
    env = os.environ if environ is None else environ
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"mcpServers"})
    if unknown:
        raise ConfigError(source, unknown[0], "unknown key (a server file has only 'mcpServers')")
    servers = data.get("mcpServers")
    if not isinstance(servers, dict):
        raise ConfigError(source, "mcpServers", "missing, or not an object of servers by name")
    out: list[McpServerConfig] = []
    for name, entry in servers.items():
        prefix = f"mcpServers.{name}"
        if not name.strip():
            raise ConfigError(source, prefix, "a server name must not be empty")
        if not isinstance(entry, dict):
            raise ConfigError(source, prefix, f"must be an object, got {type(entry).__name__}")
        disabled = entry.get("disabled", False)
        if not isinstance(disabled, bool):
            raise ConfigError(source, f"{prefix}.disabled", "must be true or false")
        kind = entry.get("type")
        if kind is not None and kind not in _TYPES:
            raise ConfigError(
                source, f"{prefix}.type",
                f"unknown type {kind!r}; use one of {', '.join(repr(t) for t in _TYPES)}",
            )
        if "command" in entry and "url" in entry:
            raise ConfigError(
                source, prefix, "give either 'command' (stdio) or 'url' (SSE or streamable "
                "HTTP), not both"
            )
        if "command" not in entry and "url" not in entry:
            raise ConfigError(
                source, prefix, "needs 'command' (a stdio server) or 'url' (SSE or streamable HTTP)"
            )
        transport: Transport = _TYPES[kind] if kind else (
            "stdio" if "command" in entry else "streamable-http"
        )
        allowed = _STDIO_KEYS if transport == "stdio" else _HTTP_KEYS
        for key in entry:
            if key not in allowed:
                hint = ("" if key not in (_STDIO_KEYS | _HTTP_KEYS)
                        else f" for a {transport} server")
                raise ConfigError(
                    source, f"{prefix}.{key}",
                    f"unknown key{hint}; allowed: {', '.join(sorted(allowed))}",
                )
        if disabled:
            continue
        if transport == "stdio":
            if "command" not in entry:
                raise ConfigError(source, prefix, "a stdio server needs 'command'")
            command = _string(entry["command"], source, f"{prefix}.command", env)
            if not command.strip():
                raise ConfigError(source, f"{prefix}.command", "must not be empty")
            args = entry.get("args", [])
            if not isinstance(args, list):
                raise ConfigError(source, f"{prefix}.args",
                                  f"must be a list of strings, got {type(args).__name__}")
            cwd = entry.get("cwd")
            out.append(McpServerConfig(
                name=name, transport="stdio", source=source, command=command,
                args=tuple(_string(a, source, f"{prefix}.args[{i}]", env)
                           for i, a in enumerate(args)),
                env=_string_map(entry.get("env", {}), source, f"{prefix}.env", env),
                cwd=None if cwd is None else _string(cwd, source, f"{prefix}.cwd", env),
            ))
        else:
            if "url" not in entry:
                raise ConfigError(source, prefix, f"a {transport} server needs 'url'")
            url = _string(entry["url"], source, f"{prefix}.url", env)
            if not re.match(r"https?://[^/\s]+", url):
                raise ConfigError(source, f"{prefix}.url", f"must be an http:// or https:// URL, "
                                  f"got {url!r}")
            out.append(McpServerConfig(
                name=name, transport=transport, source=source, url=url,
                headers=_string_map(entry.get("headers", {}), source, f"{prefix}.headers", env),
            ))
    return out


def load_mcp_servers(
    path: str | Path, environ: Mapping[str, str] | None = None
) -> list[McpServerConfig]:
    """Read one ``mcpServers`` JSON file, or every ``*.json`` file of a directory (sorted).

    Raises:
        ConfigError: unreadable file, bad JSON (with line and column), invalid content, or
            the same server name in two files.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.glob("*.json") if f.is_file())
        if not files:
            raise ConfigError(str(p), "", "no *.json files in this directory")
    else:
        files = [p]
    seen: dict[str, str] = {}
    out: list[McpServerConfig] = []
    for f in files:
        source = str(f)
        try:
            text = f.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(source, "", f"cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(source, "", f"not UTF-8 text: {exc}") from None
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys(source))
        except json.JSONDecodeError as exc:
            raise ConfigError(
                source, "", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
        for server in parse_mcp_servers(data, source, environ):
            if server.name in seen:
                raise ConfigError(
                    source, f"mcpServers.{server.name}",
                    f"a server of this name is also defined in {seen[server.name]}",
                )
            seen[server.name] = source
            out.append(server)
    return out


# --------------------------------------------------------------------------- names


def sanitize_group(name: str) -> str:
    """A server or module name as the first part of a tool name (see the module docstring)."""
    out = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    return out if re.match(r"[A-Za-z_]", out) else f"_{out}"


def tool_name(group: str, tool: str) -> str:
    """``<group>.<tool>``, both parts made to fit jaild's tool names."""
    part = re.sub(r"[^A-Za-z0-9_.-]", "_", tool) or "_"
    if not re.match(r"[A-Za-z_]", part):
        part = f"_{part}"
    return f"{sanitize_group(group)}.{part}" if group else part


def one_line(description: str, limit: int = 160) -> str:
    """The first non-empty line of a description, cut at ``limit`` characters."""
    for line in description.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
    return ""


# --------------------------------------------------------------------------- results


def _jsonish(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_wrapped_output(schema: Mapping[str, Any] | None) -> bool:
    """An outputSchema of the ``{"result": ...}`` shape SDK servers use for non-object
    return types (FastMCP / MCPServer ``-> int``, ``-> list[...]``)."""
    if not schema:
        return False
    if schema.get("x-fastmcp-wrap-result"):
        return True
    props = schema.get("properties")
    return isinstance(props, dict) and set(props) == {"result"}


def result_value(result: Any, output_schema: Mapping[str, Any] | None = None) -> Any:
    """An MCP ``CallToolResult`` as plain values.

    ``structuredContent`` when present (unwrapped from ``{"result": x}`` when the tool's
    outputSchema is that wrapper); else the text content, JSON-decoded when it parses (one
    block: its value; several: a list); other content blocks as their JSON form.

    Raises:
        McpToolError: the result has ``isError``; the message is its text.
    """
    blocks = list(getattr(result, "content", None) or [])
    texts = [str(b.text) for b in blocks if getattr(b, "type", None) == "text"]
    if getattr(result, "is_error", False):
        raise McpToolError("\n".join(texts).strip() or "the tool reported an error")
    structured = getattr(result, "structured_content", None)
    if structured is not None:
        if (
            _is_wrapped_output(output_schema)
            and isinstance(structured, dict)
            and set(structured) == {"result"}
        ):
            return structured["result"]
        return structured
    values: list[Any] = []
    for block in blocks:
        if getattr(block, "type", None) == "text":
            values.append(_jsonish(str(block.text)))
        else:
            values.append(block.model_dump(mode="json", by_alias=True, exclude_none=True))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    exc = _root_cause(exc)
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        message = f"{exc.strerror}" + (f": {exc.filename!r}" if exc.filename else "")
    return f"{type(exc).__name__}: {message}"


# --------------------------------------------------------------------------- connections


@dataclass(frozen=True)
class McpTool:
    """A tool an MCP server listed."""

    name: str
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None


class McpConnection:
    """One MCP server, connected in a task of its own (the SDK's transports are anyio
    contexts that must be entered and left in the same task), so it may be started and
    closed from any task. Its tools are called with :meth:`call`."""

    def __init__(
        self,
        config: McpServerConfig,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        errlog: TextIO | None = None,
    ) -> None:
        self.config = config
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self._errlog = errlog
        self.tools: list[McpTool] = []
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._ended: str | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def _where(self) -> str:
        return f"MCP server {self.name!r} (from {self.config.source})"

    def _transport(self) -> contextlib.AbstractAsyncContextManager[Any]:
        c = self.config
        if c.transport == "stdio":
            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(
                command=c.command, args=list(c.args), env=dict(c.env) or None, cwd=c.cwd
            )
            return stdio_client(params, errlog=self._errlog or sys.stderr)
        if c.transport == "sse":
            from mcp.client.sse import sse_client

            return sse_client(c.url, headers=dict(c.headers) or None,
                              timeout=self.connect_timeout_s,
                              sse_read_timeout=max(300.0, self.call_timeout_s))
        return self._streamable_http()

    @contextlib.asynccontextmanager
    async def _streamable_http(self) -> Any:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        timeout = httpx2.Timeout(self.connect_timeout_s, read=max(300.0, self.call_timeout_s))
        async with (
            httpx2.AsyncClient(headers=dict(self.config.headers), timeout=timeout) as http,
            streamable_http_client(self.config.url, http_client=http) as streams,
        ):
            yield streams

    async def start(self) -> None:
        """Connect, initialize and list the tools.

        Raises:
            ProviderError: naming the server: it could not be started or reached, failed
                the MCP handshake, or did not finish within ``connect_timeout_s``.
            MissingExtra: the MCP SDK is not installed (``jaild[mcp]``).
        """
        require("mcp", self._where())
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._task = loop.create_task(self._serve(ready), name=f"jaild-mcp-{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.connect_timeout_s)
        except TimeoutError:
            await self.close()
            raise ProviderError(
                f"{self._where()} did not connect and list its tools within "
                f"{self.connect_timeout_s:g} s"
            ) from None
        except ProviderError:
            await self.close()
            raise

    async def _serve(self, ready: asyncio.Future[None]) -> None:
        from mcp import ClientSession

        try:
            async with self._transport() as streams, ClientSession(streams[0], streams[1]) as s:
                await s.initialize()
                self.tools = await self._list_tools(s)
                self._session = s
                ready.set_result(None)
                await self._stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(ProviderError(f"{self._where()}: start cancelled"))
            raise
        except BaseException as exc:
            reason = _describe(exc)
            if not ready.done():
                ready.set_exception(ProviderError(f"{self._where()} failed to start: {reason}"))
            elif not self._stop.is_set():
                log.warning("%s stopped: %s", self._where(), reason)
            self._ended = reason
            if not isinstance(exc, Exception):
                raise
        finally:
            self._session = None
            self._ended = self._ended or "closed"
            if ready.done() and not ready.cancelled():
                ready.exception()  # retrieved: a late failure is never "unretrieved"

    async def _list_tools(self, session: Any) -> list[McpTool]:
        from mcp_types import PaginatedRequestParams

        tools: list[McpTool] = []
        cursor: str | None = None
        while True:
            params = PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            for t in page.tools:
                tools.append(McpTool(
                    name=t.name,
                    description=(t.description or t.title or "").strip(),
                    input_schema=dict(t.input_schema or {"type": "object"}),
                    output_schema=dict(t.output_schema) if t.output_schema else None,
                ))
            cursor = page.next_cursor
            if not cursor:
                return tools

    async def call(self, tool: McpTool, arguments: dict[str, Any]) -> Any:
        """Call ``tool`` with ``arguments``; returns :func:`result_value` of its result.

        Raises:
            McpToolError: the tool answered with ``isError``.
            TimeoutError: no answer within ``call_timeout_s`` (the server is told to cancel).
            McpServerError: the server is not connected or the call failed in the protocol.
        """
        from mcp import MCPError
        from mcp_types import REQUEST_TIMEOUT

        session = self._session
        if session is None:
            raise McpServerError(
                f"{self._where()} is not connected ({self._ended or 'not started'})"
            )
        try:
            result = await session.call_tool(
                tool.name, arguments, read_timeout_seconds=self.call_timeout_s
            )
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise TimeoutError(
                    f"{self.name}.{tool.name}: no answer within {self.call_timeout_s:g} s"
                ) from None
            raise McpServerError(f"{self.name}.{tool.name}: {exc.message}") from None
        except (RuntimeError, ValueError) as exc:  # output-schema mismatch, closed streams
            raise McpServerError(f"{self.name}.{tool.name}: {exc}") from None
        return result_value(result, tool.output_schema)

    async def close(self) -> None:
        """Disconnect (a stdio server's stdin is closed, then it is terminated). Idempotent."""
        self._stop.set()
        task, self._task = self._task, None
        if task is None:
            return
        if self._session is None:  # still starting: nothing to wind down gracefully
            task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
        if not done:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


# --------------------------------------------------------------------------- providers


TOOLS_FLAG_HELP = (
    "a Python module whose public functions become tools: a module given alone is tools.f, "
    "several are tools.STEM.f each, GROUP=FILE.py puts one under tools.GROUP"
)
"""What every front end's ``--tools`` says of the modules it takes (:func:`module_sources`)."""


def module_sources(specs: Iterable[str | Path | ModuleSource]) -> list[ModuleSource]:
    """The Python modules named by ``specs``, each with the group its functions go under:
    the naming rule of every ``--tools`` flag (``jaild run``, ``jaild session``, ``jaild
    mcp``, ``jaild codemode``), so that one flag names a tool alike in each.

    * ``GROUP=FILE.py``: under ``tools.GROUP`` (``tools.GROUP.f``); ``=FILE.py``: at the top.
    * ``FILE.py`` with no ``GROUP=``: at the top (``tools.f``) if it is the only module
      given so; if several are, each under its file's stem (``tools.STEM.f``), so that two
      modules' functions of one name stay apart.

    A :class:`ModuleSource` is taken as it is (its ``group`` given).
    """
    named: list[tuple[str, str | None]] = []
    for spec in specs:
        if isinstance(spec, ModuleSource):
            named.append((spec.path, spec.group))
            continue
        text = str(spec)
        group, sep, path = text.partition("=")
        if sep and path.endswith(".py") and "/" not in group:
            named.append((str(Path(path).expanduser()), group))
        else:
            named.append((str(Path(text).expanduser()), None))
    alone = sum(group is None for _, group in named) == 1
    return [
        ModuleSource(path, group if group is not None else "" if alone else Path(path).stem)
        for path, group in named
    ]


def module_tools(module: ModuleSource) -> list[HostTool]:
    """The public functions of one module, as tools named under its group.

    Raises:
        ProviderError: the module could not be loaded (naming it and why).
    """
    try:
        found = load_tools_file(module.path)
    except Exception as exc:
        raise ProviderError(f"cannot load tools from {module.path}: {_describe(exc)}") from exc
    if not module.group:
        return list(found.values())
    return [dataclasses.replace(t, name=tool_name(module.group, t.name))
            for t in found.values()]


def add_tools(into: dict[str, HostTool], tools: Iterable[HostTool], source: str) -> None:
    """Add ``tools`` to ``into``; a name taken already, or a name that is also a group
    (``tools.util`` a function and ``tools.util.f`` another), is a ConfigError."""
    for t in tools:
        if t.name in into:
            raise ConfigError(source, t.name, "two tools end up with this name")
        clash = next((n for n in into if n.startswith(t.name + ".")
                      or t.name.startswith(n + ".")), None)
        if clash is not None:
            raise ConfigError(source, t.name, f"a tool and a group of tools ({clash}) would "
                              "share a name; name the module's group with GROUP=FILE.py")
        into[t.name] = t


def load_modules(specs: Iterable[str | Path | ModuleSource]) -> dict[str, HostTool]:
    """The tools of the Python modules ``specs`` names, by :func:`module_sources`' rule
    (``jaild run``, ``jaild session`` and ``jaild codemode``'s ``--tools``; ``jaild mcp``
    loads them with its MCP servers, through :class:`ToolProviders`).

    Raises:
        ProviderError: a module could not be loaded; ConfigError: two tools end up with
            one name.
    """
    tools: dict[str, HostTool] = {}
    for m in module_sources(specs):
        add_tools(tools, module_tools(m), m.path)
    return tools


def _mcp_handler(conn: McpConnection, tool: McpTool, public: str) -> Callable[..., Any]:
    order = list((tool.input_schema.get("properties") or {}).keys())

    async def handler(*args: Any, **kwargs: Any) -> Any:
        if args:  # positional arguments fill the schema's properties in order
            if len(args) > len(order):
                raise TypeError(f"{public} takes at most {len(order)} positional arguments "
                                f"({', '.join(order) or 'none'}); {len(args)} given")
            for key, value in zip(order, args, strict=False):
                if key in kwargs:
                    raise TypeError(f"{public} got two values for argument {key!r}")
                kwargs[key] = value
        return await conn.call(tool, kwargs)

    handler.__name__ = public.replace(".", "_").replace("-", "_")
    handler.__qualname__ = handler.__name__
    return handler


class ToolProviders:
    """MCP servers and Python modules, as jaild host tools.

    ::

        async with ToolProviders.load(["servers.json", "mytools.py"]) as providers:
            tools = providers.host_tools()          # {"github.search_repositories": HostTool}
            providers.catalog()                     # [(name, one-line description), ...]
            await client.run(code, tools=tools)

    Use :meth:`load` to build one; entering it connects every MCP server (in parallel),
    leaving it disconnects them and stops the stdio servers.
    """

    def __init__(
        self,
        servers: Sequence[McpServerConfig] = (),
        modules: Sequence[ModuleSource] = (),
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        skip_failed: bool = False,
        errlog: TextIO | None = None,
    ) -> None:
        self.servers = list(servers)
        self.modules = list(modules)
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self.skip_failed = skip_failed
        self.errlog = errlog
        self.failed: dict[str, str] = {}
        """Servers skipped because they failed to start (``skip_failed``): name -> reason."""
        self.connections: dict[str, McpConnection] = {}
        self._tools: dict[str, HostTool] = {}
        self._check_groups()

    @classmethod
    def load(
        cls,
        sources: Iterable[str | Path | ModuleSource],
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        skip_failed: bool = False,
        errlog: TextIO | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ToolProviders:
        """Read provider sources (nothing is started yet).

        Args:
            sources: ``.py`` files (named by :func:`module_sources`: ``group=path.py``
                to name the group, ``=path.py`` for none), ``mcpServers`` JSON files, or
                directories of such JSON files.
            connect_timeout_s: per MCP server, to start, handshake and list its tools.
            call_timeout_s: per tool call.
            skip_failed: a server that fails to start is left out with a warning (and listed
                in :attr:`failed`) instead of failing the whole start.
            errlog: where stdio servers' stderr goes (default: this process's stderr).
            environ: for ``${VAR}`` expansion (default: ``os.environ``).

        Raises:
            ConfigError: an invalid source, naming the file, the server and the problem.
        """
        servers: list[McpServerConfig] = []
        module_specs: list[str | Path | ModuleSource] = []
        seen: dict[str, str] = {}
        for spec in sources:
            if isinstance(spec, ModuleSource) or str(spec).endswith(".py"):
                module_specs.append(spec)
                continue
            path = Path(spec).expanduser()
            if not path.exists():
                raise ConfigError(str(path), "", "no such file or directory")
            for server in load_mcp_servers(path, environ):
                if server.name in seen:
                    raise ConfigError(
                        server.source, f"mcpServers.{server.name}",
                        f"a server of this name is also defined in {seen[server.name]}",
                    )
                seen[server.name] = server.source
                servers.append(server)
        return cls(servers, module_sources(module_specs), connect_timeout_s=connect_timeout_s,
                   call_timeout_s=call_timeout_s, skip_failed=skip_failed, errlog=errlog)

    def _check_groups(self) -> None:
        groups: dict[str, str] = {}
        for s in self.servers:
            g = sanitize_group(s.name)
            if g in groups:
                raise ConfigError(s.source, f"mcpServers.{s.name}",
                                  f"its tools would be named {g}.*, as those of {groups[g]}")
            groups[g] = f"server {s.name!r} ({s.source})"
        for m in self.modules:
            if not m.group:
                continue
            g = sanitize_group(m.group)
            if g in groups:
                raise ConfigError(m.path, "", f"its tools would be named {g}.*, as those of "
                                  f"{groups[g]}; name the group with GROUP={m.path}")
            groups[g] = f"module {m.path}"

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> ToolProviders:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Import the modules and connect every MCP server (in parallel).

        Raises:
            ProviderError: a module could not be imported, or a server failed to start
                (unless ``skip_failed``), naming it.
            ConfigError: two tools end up with the same name.
        """
        tools: dict[str, HostTool] = {}
        for m in self.modules:
            add_tools(tools, module_tools(m), m.path)
        conns = [
            McpConnection(s, connect_timeout_s=self.connect_timeout_s,
                          call_timeout_s=self.call_timeout_s, errlog=self.errlog)
            for s in self.servers
        ]
        outcomes = await asyncio.gather(*(c.start() for c in conns), return_exceptions=True)
        problems: list[str] = []
        for conn, outcome in zip(conns, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if isinstance(outcome, asyncio.CancelledError):
                    await self._close_all(conns)
                    raise outcome
                message = str(outcome) if isinstance(outcome, ProviderError) else (
                    f"MCP server {conn.name!r} failed to start: {_describe(outcome)}")
                if self.skip_failed:
                    log.warning("%s; skipping it", message)
                    self.failed[conn.name] = message
                else:
                    problems.append(message)
            else:
                self.connections[conn.name] = conn
        if problems:
            await self._close_all(list(self.connections.values()))
            self.connections.clear()
            raise ProviderError("; ".join(problems))
        try:
            for conn in self.connections.values():
                add_tools(tools, self._server_tools(conn), conn.config.source)
        except BaseException:
            await self.aclose()
            raise
        self._tools = tools

    async def _close_all(self, conns: Iterable[McpConnection]) -> None:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)

    async def aclose(self) -> None:
        """Disconnect every server. Idempotent."""
        conns = list(self.connections.values())
        self.connections.clear()
        self._tools = {}
        await self._close_all(conns)

    # ------------------------------------------------------------------ tools

    def _server_tools(self, conn: McpConnection) -> list[HostTool]:
        out: list[HostTool] = []
        for t in conn.tools:
            public = tool_name(conn.name, t.name)
            if len(public) > MAX_NAME_CHARS or not re.fullmatch(TOOL_NAME, public):
                log.warning("MCP server %r: tool %r left out: its name %r is longer than %d "
                            "characters", conn.name, t.name, public, MAX_NAME_CHARS)
                continue
            description = t.description
            if len(description) > MAX_DESCRIPTION_CHARS:
                description = description[: MAX_DESCRIPTION_CHARS - 1] + "…"
            out.append(HostTool(public, description, t.input_schema,
                                _mcp_handler(conn, t, public)))
        return out

    def host_tools(self) -> dict[str, HostTool]:
        """``{name: HostTool}``, as ``AsyncClient.run(tools=...)`` takes it."""
        return dict(self._tools)

    def catalog(self) -> list[tuple[str, str]]:
        """``(name, one-line description)`` of every tool, sorted by name (for prompts)."""
        return [(name, one_line(t.description)) for name, t in sorted(self._tools.items())]

    def __len__(self) -> int:
        return len(self._tools)
