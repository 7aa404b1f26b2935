"""``jaild mcp``: an MCP server whose one tool, ``run_python``, runs code in jaild.

Built on the official MCP SDK's low-level ``Server``, over stdio (default) or streamable
HTTP (``--http HOST:PORT``, endpoint ``/mcp``). The model sends Python; the code runs in a
fresh jail of the jaild daemon at ``--socket`` under ``--policy``; the jailed code's calls
to ``tools.<server>.<tool>(...)`` are answered here, by the tool providers loaded with
``--tools`` (MCP servers from ``mcpServers`` JSON files, Python modules): see
:mod:`jaild.providers`. Their credentials never leave this process.

The answer is the job's result record as structured output (``status``, ``result``,
``stdout``, ``stderr``, ``error``, ``tool_calls``, ``usage``, ...) plus a text summary; a
job that does not end ``ok`` (or that the daemon refuses) is a tool result with ``isError``,
never a protocol error.

With ``--persistent``, the ``run_python`` calls of one MCP client session share one jaild
session (variables, imports and files persist); it is closed when the MCP session ends.
Over stdio the process serves exactly one MCP session; over streamable HTTP each
``Mcp-Session-Id`` gets its own. A request without an MCP session (stateless HTTP, the
2026-07-28 per-request protocol over HTTP) runs in a fresh jail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jaild.address import socket_from_env
from jaild.client import Approver, AsyncClient, AsyncSession, JobResult
from jaild.errors import (
    ConfigError,
    ConnectionLost,
    JaildError,
    ProviderError,
    error_line,
    exit_code_for,
)
from jaild.protocol.records import STATUSES
from jaild.providers import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    ToolProviders,
    one_line,
)
from jaild.toolspec import HostTool

log = logging.getLogger("jaild.mcp")

TOOL = "run_python"
TEXT_LIMIT = 8000
"""Characters of result, stdout and stderr each in the text summary (all of it is in the
structured output)."""

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {
            "type": "string",
            "description": "Python 3 source. Top-level await works; the value of the final "
                           "expression is the result.",
        }
    },
    "required": ["code"],
    "additionalProperties": False,
}

OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "job_id": {"type": "string"},
        "status": {
            "type": "string",
            "enum": [*STATUSES, "refused"],
            "description": "how the job ended; refused: no job ran (the daemon or this "
                           "server refused the call)",
        },
        "result": {"description": "the value of the final expression (null unless ok)"},
        "stdout": {"type": "string"},
        "stderr": {"type": "string"},
        "error": {
            "type": ["object", "null"],
            "description": "type, message, traceback, lineno (and signal, syscall, limit)",
        },
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "duration_s": {"type": "number"},
        "usage": {"type": "object"},
        "policy": {"type": "string"},
        "session": {"type": ["object", "null"]},
    },
    "required": ["status", "result", "stdout", "stderr", "error", "tool_calls"],
}


# --------------------------------------------------------------------------- descriptions


def _signature(tool: HostTool) -> str:
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    names = [p if p in required else f"{p}=…" for p in props]
    return f"{tool.name}({', '.join(names)})"


def describe_run_python(tools: dict[str, HostTool], persistent: bool) -> str:
    """The ``run_python`` description: how to write code for jaild, and every tool."""
    lines = [
        "Run Python code in an isolated jail (jaild) and return its result record. Write "
        "code instead of many separate tool calls: call the host tools below from Python, "
        "loop, filter and combine, and return only what you need.",
        "",
        "How to write the code:",
        "- Top-level `await` works. The value of the final expression is the result "
        "(or define `main()`, sync or async, and its return value is). Use print() for "
        "output; stdout and stderr come back.",
        "- Call a tool with keyword arguments as in its schema: "
        "`await tools.<server>.<tool>(arg=...)`, or `await tools[\"<name>\"](arg=...)` for "
        "any name (a `-` in a name may be written `_` in attribute access). Run calls in "
        "parallel with `await asyncio.gather(...)`.",
        "- A failing tool raises `ToolError` (attributes `tool`, `error_type`, `message`).",
        "- Discover tools from the code: `await tools.discover()` lists names and "
        "descriptions, `await tools.schema(\"name\")` gives a tool's argument schema, "
        "`await tools.search(\"keyword\")` finds tools; `help(tools.<name>)` too.",
        "- The jail is isolated (under the default policy: no network, no host files); "
        "the tools are its way out.",
        (
            "- Variables, functions, imports and files persist between run_python calls of "
            "this conversation (one jail); a call that hits a limit ends it and the next "
            "call starts fresh."
            if persistent
            else "- Each call runs in a fresh jail: nothing persists between calls."
        ),
        "",
    ]
    if tools:
        lines.append(f"Available tools ({len(tools)}):")
        for name in sorted(tools):
            t = tools[name]
            summary = one_line(t.description)
            lines.append(f"- {_signature(t)}" + (f": {summary}" if summary else ""))
    else:
        lines.append("No host tools are configured.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- results


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` with only JSON types: keys become strings, tuples lists, bytes text
    (UTF-8, else their repr), NaN and infinities strings; anything else its repr."""
    if depth > 100:
        return repr(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return repr(bytes(value))
    if isinstance(value, dict):
        return {
            (k if isinstance(k, str) else json.dumps(json_safe(k, depth + 1))):
                json_safe(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    return repr(value)


def refused_record(code: str, message: str) -> dict[str, Any]:
    """The tool's answer when no job ran (the daemon answered ``Error``, or a bad call).

    Not a job record: ``refused`` is a status of this tool's output only, never of a job
    (the daemon's records have :data:`~jaild.protocol.records.STATUSES`); the fields the
    output schema requires are empty, and there is no ``job_id``."""
    return {
        "status": "refused",
        "result": None,
        "stdout": "",
        "stderr": "",
        "error": {"type": code, "message": message},
        "tool_calls": [],
    }


def _cut(text: str, what: str) -> str:
    if len(text) <= TEXT_LIMIT:
        return text
    return (text[:TEXT_LIMIT] + f"\n… ({len(text) - TEXT_LIMIT} more characters of {what} "
            "in the structured result)")


def summarize(record: dict[str, Any], note: str = "") -> str:
    """A short text form of a result record, for clients that ignore structured output."""
    calls = len(record.get("tool_calls") or []) + int(record.get("tool_calls_omitted") or 0)
    facts = []
    if "duration_s" in record:
        facts.append(f"{float(record['duration_s']):.2f} s")
    if calls:
        facts.append(f"{calls} tool call{'s' if calls != 1 else ''}")
    session = record.get("session")
    if isinstance(session, dict) and session.get("run"):
        facts.append(f"session run {session['run']}")
    parts = [f"status: {record['status']}" + (f" ({', '.join(facts)})" if facts else "")]
    if note:
        parts.append(f"note: {note}")
    if record["status"] == "ok":
        parts.append("result: " + _cut(json.dumps(record.get("result"), ensure_ascii=False),
                                       "the result"))
    if record.get("stdout"):
        parts.append("stdout:\n" + _cut(str(record["stdout"]), "stdout").rstrip("\n"))
    if record.get("stderr"):
        parts.append("stderr:\n" + _cut(str(record["stderr"]), "stderr").rstrip("\n"))
    error = record.get("error")
    if isinstance(error, dict):
        where = f" (line {error['lineno']})" if error.get("lineno") else ""
        parts.append(f"error: {error.get('type', '')}: {error.get('message', '')}{where}")
        if error.get("traceback"):
            parts.append(_cut(str(error["traceback"]), "the traceback").rstrip("\n"))
    if isinstance(session, dict) and session.get("closed"):
        parts.append(f"the session ended ({session['closed']}); the next call starts a new one")
    return "\n".join(parts)


def record_of(result: JobResult) -> dict[str, Any]:
    record: dict[str, Any] = json_safe(result.to_dict())
    return record


def tool_result(record: dict[str, Any], note: str = "") -> Any:
    """A ``CallToolResult``: the record as structured output, a summary as text."""
    from mcp_types import CallToolResult, TextContent

    return CallToolResult(
        content=[TextContent(text=summarize(record, note))],
        structured_content=record,
        is_error=record["status"] != "ok",
    )


# --------------------------------------------------------------------------- the server


@dataclass
class _McpSession:
    """The jaild session behind one MCP session (``--persistent``)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    jail: AsyncSession | None = None
    client: AsyncClient | None = None
    """The daemon connection the jail's session belongs to."""


class JaildMcpServer:
    """The ``run_python`` MCP server.

    Args:
        socket_path: the jaild daemon's socket.
        providers: the host tools (already started).
        policy: the jaild policy jobs run under.
        timeout_s: wall-clock seconds per run (None: the policy's).
        persistent: one jaild session per MCP session.
    """

    def __init__(
        self,
        socket_path: str,
        providers: ToolProviders | None = None,
        *,
        policy: str = "default",
        timeout_s: float | None = None,
        persistent: bool = False,
    ) -> None:
        self.socket_path = socket_path
        self.tools = providers.host_tools() if providers is not None else {}
        self.policy = policy
        self.timeout_s = timeout_s
        self.persistent = persistent
        self.stdio = False
        self._client: AsyncClient | None = None
        self._connecting = asyncio.Lock()
        self._sessions: dict[Any, _McpSession] = {}

    async def connect(self) -> None:
        """Connect to the daemon. Raises DaemonUnavailable / JaildError."""
        await self._jaild()

    async def _jaild(self) -> AsyncClient:
        async with self._connecting:
            if self._client is None:
                client = AsyncClient(self.socket_path, name="jaild-mcp")
                await client.connect()
                self._client = client
            return self._client

    async def _drop_client(self, client: AsyncClient) -> None:
        if self._client is client:
            self._client = None
            await client.close()

    async def close(self) -> None:
        """Close every jaild session and the daemon connection."""
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for s in sessions:
            if s.jail is not None:
                with contextlib.suppress(Exception):
                    await s.jail.close()
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    # ------------------------------------------------------------------ MCP handlers

    def build(self) -> Any:
        """The SDK ``Server`` with ``tools/list`` and ``tools/call``."""
        import mcp_types as types
        from mcp.server.lowlevel import Server

        from jaild import __version__

        description = describe_run_python(self.tools, self.persistent)
        tool = types.Tool(
            name=TOOL,
            title="Run Python in a jail",
            description=description,
            input_schema=INPUT_SCHEMA,
            output_schema=OUTPUT_SCHEMA,
        )

        async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
            return types.ListToolsResult(tools=[tool])

        async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> Any:
            if params.name != TOOL:
                from mcp import MCPError

                raise MCPError(code=types.INVALID_PARAMS,
                               message=f"unknown tool {params.name!r}; this server has {TOOL}")
            arguments = params.arguments or {}
            code = arguments.get("code")
            extra = sorted(set(arguments) - {"code"})
            if not isinstance(code, str) or extra:
                problem = (f"unknown argument {extra[0]!r}" if extra
                           else "'code' (a string of Python source) is required")
                return tool_result(refused_record("bad_request", f"{TOOL}: {problem}"))
            return await self.run_python(code, ctx)

        return Server(
            "jaild",
            version=__version__,
            instructions="Use run_python to run Python in an isolated jail; the code calls "
                         "the host tools listed in its description.",
            on_list_tools=list_tools,
            on_call_tool=call_tool,
        )

    def _session_key(self, ctx: Any) -> tuple[Any, Any]:
        """(key of the MCP session, its SDK connection when there is one) or (None, None)."""
        if self.stdio:
            return "stdio", None
        request = getattr(ctx, "request", None)
        headers = getattr(request, "headers", None)
        session_id = headers.get("mcp-session-id") if headers is not None else None
        if not session_id:
            return None, None
        # The SDK keeps per-connection teardown on the connection, which handlers reach
        # only through the request's session proxy.
        return session_id, getattr(getattr(ctx, "session", None), "_connection", None)

    async def run_python(self, code: str, ctx: Any = None) -> Any:
        """Run ``code`` (in the MCP session's jaild session when persistent)."""
        key, connection = self._session_key(ctx) if self.persistent else (None, None)
        approve = _approver(ctx)
        try:
            if key is None:
                client = await self._jaild()
                try:
                    result = await client.run(code, self.policy, self.tools,
                                              timeout=self.timeout_s, filename="<run_python>",
                                              approve=approve)
                except ConnectionLost:
                    await self._drop_client(client)
                    raise
                return tool_result(record_of(result))
            return await self._run_in_session(key, connection, code, approve)
        except JaildError as exc:
            return tool_result(refused_record(exc.code, exc.message))

    async def _run_in_session(
        self, key: Any, connection: Any, code: str, approve: Approver | None = None
    ) -> Any:
        state = self._sessions.get(key)
        if state is None:
            state = self._sessions[key] = _McpSession()
            exit_stack = getattr(connection, "exit_stack", None)
            if isinstance(exit_stack, contextlib.AsyncExitStack):
                exit_stack.push_async_callback(self._end_session, key)
        async with state.lock:
            note = ""
            if state.jail is not None and state.jail.closed is not None:
                note = (f"the previous jaild session ended ({state.jail.closed}); this call "
                        "runs in a new one: earlier variables are gone")
                state.jail = None
            if state.jail is None:
                state.client = await self._jaild()
                try:
                    state.jail = await state.client.session(self.policy, self.tools).open()
                except ConnectionLost:
                    await self._drop_client(state.client)
                    raise
            try:
                result = await state.jail.run(code, timeout=self.timeout_s,
                                              filename="<run_python>", approve=approve)
            except ConnectionLost:
                if state.client is not None:
                    await self._drop_client(state.client)
                raise
            return tool_result(record_of(result), note)

    async def _end_session(self, key: Any) -> None:
        state = self._sessions.pop(key, None)
        if state is not None and state.jail is not None:
            log.debug("MCP session %s ended; closing jaild session %s", key, state.jail.id)
            with contextlib.suppress(Exception):
                await state.jail.close()

    # ------------------------------------------------------------------ transports

    async def serve_stdio(self) -> None:
        """Serve one MCP client over stdin/stdout until stdin closes."""
        from mcp.server.stdio import stdio_server

        self.stdio = True
        server = self.build()
        try:
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())
        finally:
            await self._end_session("stdio")

    async def serve_http(self, host: str, port: int) -> None:
        """Serve streamable HTTP at ``http://host:port/mcp`` until SIGINT/SIGTERM."""
        import uvicorn

        class Uvicorn(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                # ours (below): uvicorn's would re-raise the signal after serving, killing
                # the process before the sessions and the providers are closed
                yield

        app = self.build().streamable_http_app(host=host)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                lifespan="on", access_log=False)
        server = Uvicorn(config)

        def stop() -> None:
            server.should_exit = True

        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving MCP on %s:%d without authentication: whoever reaches it runs "
                        "code and calls the host tools with their credentials", host, port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        try:
            await server.serve()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


# --------------------------------------------------------------------------- CLI


APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"allow": {"type": "boolean", "title": "Allow this call"}},
    "required": ["allow"],
}


def _approver(ctx: Any) -> Approver | None:
    """Approvals over MCP: a tool call that needs approval (the tool is marked, or the
    policy's ``access.approve`` matches it) is put to the MCP client's user as an
    elicitation; only an accepted form with ``allow: true`` lets it run."""
    session = getattr(ctx, "session", None)
    if session is None:
        return None
    request_id = getattr(ctx, "request_id", None)

    async def approve(name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[bool, str]:
        shown = json.dumps({"args": json_safe(args), "kwargs": json_safe(kwargs)})
        try:
            answer = await session.elicit_form(
                message=f"The jailed code wants to call the tool {name} with "
                        f"{shown[:2000]}. Allow this call?",
                requested_schema=APPROVAL_SCHEMA,
                related_request_id=request_id,
            )
        except Exception as exc:  # no elicitation support, or the client went away
            return False, f"{name} needs approval and the MCP client could not be asked: {exc}"
        content = getattr(answer, "content", None) or {}
        if getattr(answer, "action", "") == "accept" and content.get("allow") is True:
            return True, "approved by the MCP client"
        return False, f"{name}: not approved by the MCP client ({getattr(answer, 'action', '?')})"

    return approve


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:8765), got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def add_mcp_commands(sub: Any) -> None:
    """Register ``jaild mcp`` on the CLI's subparsers."""
    p = sub.add_parser(
        "mcp",
        help="serve run_python over MCP (stdio or streamable HTTP)",
        description="An MCP server with one tool, run_python, that runs code in jaild; the "
                    "code calls the tools of the providers given with --tools.",
    )
    p.add_argument("--socket", help="the jaild daemon's socket (default: $JAILD_SOCKET or "
                   "/run/jaild/jaild.sock)")
    p.add_argument("--policy", default="default", help="policy the code runs under")
    p.add_argument(
        "--tools", action="append", default=[], metavar="FILE",
        help="tool provider (repeatable): a .py module (GROUP=FILE.py to name its group), an "
             "mcpServers JSON file, or a directory of them",
    )
    p.add_argument("--timeout", type=float, help="wall-clock seconds per run (at most the "
                   "policy's)")
    p.add_argument("--persistent", action="store_true",
                   help="run_python calls of one MCP session share one jaild session")
    p.add_argument("--http", type=_host_port, metavar="HOST:PORT",
                   help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio")
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                   help="seconds for each MCP server to start and list its tools")
    p.add_argument("--call-timeout", type=float, default=DEFAULT_CALL_TIMEOUT_S,
                   help="seconds for each call to an MCP server's tool")
    p.add_argument("--skip-failed", action="store_true",
                   help="leave out (with a warning) MCP servers that fail to start")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_mcp)


def _print_err(message: str) -> None:
    print(f"jaild mcp: {message}", file=sys.stderr, flush=True)


def cmd_mcp(args: argparse.Namespace) -> int:
    """``jaild mcp``: returns the exit status."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        providers = ToolProviders.load(
            args.tools, connect_timeout_s=args.connect_timeout,
            call_timeout_s=args.call_timeout, skip_failed=args.skip_failed,
        )
    except ConfigError as exc:
        _print_err(str(exc))
        return exit_code_for(exc)
    try:
        return asyncio.run(_serve(args, providers))
    except KeyboardInterrupt:
        return 130


async def _serve(args: argparse.Namespace, providers: ToolProviders) -> int:
    socket_path = socket_from_env(args.socket)[0]
    server = JaildMcpServer(socket_path, None, policy=args.policy, timeout_s=args.timeout,
                            persistent=args.persistent)
    try:
        await server.connect()
    except JaildError as exc:
        _print_err(error_line(exc))
        return exit_code_for(exc)
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    try:
        try:
            await providers.start()
        except ProviderError as exc:
            _print_err(str(exc))
            return exit_code_for(exc)
        server.tools = providers.host_tools()
        log.info("serving run_python with %d tools from %d MCP servers and %d modules",
                 len(server.tools), len(providers.connections), len(providers.modules))
        if args.http is None:
            if main is not None:  # SIGTERM: stop serving, close sessions and providers
                loop.add_signal_handler(signal.SIGTERM, main.cancel)
            try:
                await server.serve_stdio()
            except asyncio.CancelledError:
                if main is None or not main.cancelling():
                    raise
                main.uncancel()
            finally:
                loop.remove_signal_handler(signal.SIGTERM)
        else:
            await server.serve_http(*args.http)
        return 0
    finally:
        await server.close()
        await providers.aclose()
