"""``jaild mcp``: an MCP server whose one tool, ``run_python``, runs code in jaild.

Built on the official MCP SDK's low-level ``Server``, over stdio (default) or streamable
HTTP (``--http HOST:PORT``, endpoint ``/mcp``). The model sends Python; the code runs in a
fresh jail of the jaild daemon at ``--socket`` (``$JAILD_SOCKET``, else the default socket if
a daemon listens there, else a private daemon for this server, as with ``jaild run``) under
``--policy``; the jailed code's calls
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

Traces: the MCP SDK makes a span of every request (its OpenTelemetry middleware) in the
trace context the MCP client put in the request's ``_meta``; ``run_python``'s job is sent
from inside that span, so the daemon's spans for the job join the MCP client's trace
(:mod:`jaild.tracing`). ``jaild mcp`` exports its own spans when ``OTEL_TRACES_EXPORTER``
asks (never ``console`` over stdio, whose stdout is the MCP channel).

Who may connect (theory of operation)
-------------------------------------
Whoever reaches this server runs code under its policy and calls the host tools with
this process's credentials -- past the daemon socket's permissions and ``access.users``,
which see only this process. So every transport but stdio (whose peer is the process that
started us) has a gate:

* ``--http HOST:PORT``: a bearer token, always. It is read from ``--token-file`` (a regular
  file of this uid, mode 0600 or stricter: a file others may read or change is refused),
  or generated (``secrets.token_urlsafe``) and written there with ``O_EXCL``, mode 0600,
  when the file does not exist; without ``--token-file`` it is generated and printed once
  on stderr. It is checked by the MCP SDK's own auth hooks: a :class:`BearerToken`
  (the SDK's ``TokenVerifier``, constant-time compare) given to ``streamable_http_app``
  with ``AuthSettings``, which installs the SDK's ``BearerAuthBackend`` and wraps ``/mcp``
  in its ``RequireAuthMiddleware``: no or a wrong token gets ``401`` before any MCP message
  is read.
* ``--unix PATH``: streamable HTTP on a Unix socket, gated by the peer's credentials
  (``SO_PEERCRED``) at accept, before a byte is read: a uid not in ``--allow-user``
  (default: this process's own uid) gets ``403`` and the connection is closed. The socket
  is made here (never uvicorn's 0666 ``uds=``): 0600 when only this uid is allowed, 0666
  when other uids are (the kernel's peer credentials, not the file mode, are then the gate).
  A ``--token-file`` adds the bearer check on top.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import hmac
import json
import logging
import math
import os
import pwd
import secrets
import signal
import socket
import stat
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jaild import tracing
from jaild.address import add_tls_arguments
from jaild.client import Approver, AsyncClient, AsyncSession, JobResult
from jaild.errors import (
    EXIT_USAGE,
    ConfigError,
    ConnectionLost,
    JaildError,
    ProviderError,
    TracingError,
    error_line,
    exit_code_for,
)
from jaild.extras import require
from jaild.protocol.records import STATUSES
from jaild.providers import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    TOOLS_FLAG_HELP,
    ToolProviders,
    one_line,
)
from jaild.toolspec import HostTool, describe_flow, describe_network

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


def describe_run_python(
    tools: dict[str, HostTool], persistent: bool, network: str = "",
    flow: tuple[str, ...] = (),
) -> str:
    """The ``run_python`` description: how to write code for jaild, its network (the
    policy's, in words: :func:`jaild.toolspec.describe_network`), and every tool."""
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
        f"- The jail is isolated (no host files). {network or 'The jail has no network.'} "
        "The tools are its way out.",
        (
            "- Variables, functions, imports and files persist between run_python calls of "
            "this conversation (one jail); a call that hits a limit ends it and the next "
            "call starts fresh."
            if persistent
            else "- Each call runs in a fresh jail: nothing persists between calls."
        ),
        *describe_flow(flow),
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
    refused = int(record.get("network_refused") or 0)
    if refused:
        facts.append(f"{refused} network attempt{'s' if refused != 1 else ''} refused")
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
    """What the server keeps of one MCP session: the labels its model has read, and (with
    ``--persistent``) the jaild session behind it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    jail: AsyncSession | None = None
    client: AsyncClient | None = None
    """The daemon connection the jail's session belongs to."""
    labels: set[str] = field(default_factory=set)
    """Every label of every run whose record went back to this MCP session's client (a
    model read it): each later run holds them from its start (docs/using/flow.md)."""


def _held(state: _McpSession | None) -> tuple[str, ...]:
    return tuple(sorted(state.labels)) if state is not None else ()


def _read(state: _McpSession | None, result: JobResult) -> JobResult:
    """``result`` goes to the MCP client's model: its labels are the session's from now."""
    if state is not None and result.flow:
        state.labels.update(result.flow.get("labels", ()))
    return result


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
        self.network = ""  # the policy's network, in words (read from the daemon at connect)
        self.flow: tuple[str, ...] = ()  # its information-flow rules, in words (likewise)

    async def connect(self) -> None:
        """Connect to the daemon and learn the policy's network (what ``run_python``'s
        description says of it). Raises DaemonUnavailable / JaildError."""
        client = await self._jaild()
        for entry in await client.policies():
            if entry["name"] == self.policy:
                self.network = describe_network(entry["network"], entry.get("egress", ()))
                self.flow = tuple(entry.get("flow", ()))

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

        from jaild.version import __version__

        description = describe_run_python(self.tools, self.persistent, self.network, self.flow)
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
        """Run ``code`` (in the MCP session's jaild session when persistent). Each run holds
        the labels of every earlier run of the same MCP session from its start: the model
        that read those results writes this code (an MCP client without a session -- plain
        stateless HTTP -- is not told apart, and its runs start clean; each record's
        ``flow.labels`` says what it read)."""
        key, connection = self._session_key(ctx)
        state = self._state(key, connection) if key is not None else None
        approve = _approver(ctx)
        try:
            if state is None or not self.persistent:
                client = await self._jaild()
                try:
                    result = await client.run(code, self.policy, self.tools,
                                              timeout=self.timeout_s, filename="<run_python>",
                                              approve=approve, labels=_held(state))
                except ConnectionLost:
                    await self._drop_client(client)
                    raise
                return tool_result(record_of(_read(state, result)))
            return await self._run_in_session(state, code, approve)
        except JaildError as exc:
            return tool_result(refused_record(exc.code, exc.message))

    def _state(self, key: Any, connection: Any) -> _McpSession:
        """The MCP session's state, made at its first call (dropped when it ends)."""
        state = self._sessions.get(key)
        if state is None:
            state = self._sessions[key] = _McpSession()
            exit_stack = getattr(connection, "exit_stack", None)
            if isinstance(exit_stack, contextlib.AsyncExitStack):
                exit_stack.push_async_callback(self._end_session, key)
        return state

    async def _run_in_session(
        self, state: _McpSession, code: str, approve: Approver | None = None
    ) -> Any:
        async with state.lock:
            note = ""
            if state.jail is not None and state.jail.closed is not None:
                note = (f"the previous jaild session ended ({state.jail.closed}); this call "
                        "runs in a new one: earlier variables are gone")
                state.jail = None
            if state.jail is None:
                state.client = await self._jaild()
                try:
                    state.jail = await state.client.session(
                        self.policy, self.tools, labels=_held(state)).open()
                except ConnectionLost:
                    await self._drop_client(state.client)
                    raise
            try:
                result = await state.jail.run(code, timeout=self.timeout_s,
                                              filename="<run_python>", approve=approve,
                                              labels=_held(state))
            except ConnectionLost:
                if state.client is not None:
                    await self._drop_client(state.client)
                raise
            return tool_result(record_of(_read(state, result)), note)

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

    def _app(self, host: str, token: str | None, issuer: str) -> Any:
        """The SDK's streamable HTTP app; behind the SDK's bearer auth when ``token``."""
        server = self.build()
        if token is None:
            return server.streamable_http_app(host=host)
        from mcp.server.auth.settings import AuthSettings

        auth = AuthSettings(issuer_url=issuer, resource_server_url=None)  # type: ignore[arg-type]
        return server.streamable_http_app(host=host, auth=auth, token_verifier=BearerToken(token))

    async def serve_http(self, host: str, port: int, token: str) -> None:
        """Serve streamable HTTP at ``http://host:port/mcp`` until SIGINT/SIGTERM; a request
        without ``Authorization: Bearer <token>`` is refused (401)."""
        import uvicorn

        shown = f"[{host}]" if ":" in host else host
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving MCP on %s:%d over plain HTTP: the bearer token crosses the "
                        "network unencrypted; put a TLS proxy in front, or use loopback or "
                        "--unix", host, port)
        app = self._app(host, token, f"http://{shown}:{port}")
        await _serve_uvicorn(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                            lifespan="on", access_log=False))

    async def serve_unix(self, path: str, allowed_uids: frozenset[int],
                         token: str | None = None) -> None:
        """Serve streamable HTTP on the Unix socket ``path`` (endpoint ``/mcp``) to the
        peers whose uid is in ``allowed_uids`` (others: 403 at accept), until SIGINT/SIGTERM.

        Raises:
            ConfigError: ``path`` is in use, or is not a socket, or cannot be bound.
        """
        import uvicorn

        sock = bind_unix(path, others=bool(allowed_uids - {os.geteuid()}))
        try:
            # not a loopback name: the SDK's DNS-rebinding guard is for TCP ports a browser
            # can reach; no browser reaches a Unix socket (clients send any Host)
            app = self._app("unix", token, "http://localhost")
            config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False,
                                    http=peer_gate(allowed_uids))
            await _serve_uvicorn(config, sock)
        finally:
            sock.close()
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)


async def _serve_uvicorn(config: Any, sock: socket.socket | None = None) -> None:
    """Run uvicorn with ``config`` until SIGINT/SIGTERM (then return, so that the caller
    closes the sessions and the providers)."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # ours (below): uvicorn's would re-raise the signal after serving, killing
            # the process before the sessions and the providers are closed
            yield

    server = Uvicorn(config)

    def stop() -> None:
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


# --------------------------------------------------------------------------- who may connect


MIN_TOKEN_CHARS = 16


class BearerToken:
    """The MCP SDK's ``TokenVerifier`` for one shared secret (compared in constant time).

    Args:
        token: the secret a client must send as ``Authorization: Bearer <token>``.
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def verify_token(self, token: str) -> Any:
        """The SDK's ``AccessToken`` for the right token, else None (the SDK answers 401)."""
        from mcp.server.auth.provider import AccessToken

        if hmac.compare_digest(token.encode(), self._token):
            return AccessToken(token=token, client_id="jaild-mcp", scopes=[])
        return None


def read_token(path: str) -> str:
    """The bearer token in ``path``: a regular file of this uid that no one else may read
    or change (mode 0600 or stricter), holding at least :data:`MIN_TOKEN_CHARS` characters.

    Raises:
        ConfigError: names the file and what is wrong with it, and how to fix it.
        FileNotFoundError: no such file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(path, "", "the token file is not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(path, "", f"the token file is owned by uid {st.st_uid}, not by "
                                        f"this server's uid {os.geteuid()}; use a file of yours")
        if st.st_mode & 0o077:
            raise ConfigError(path, "", f"the token file has mode {stat.S_IMODE(st.st_mode):04o}: "
                                        "other users may read or change the token; "
                                        f"run `chmod 600 {path}` (or remove it to have one made)")
        token = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(path, "", f"the token must be one line of at least {MIN_TOKEN_CHARS} "
                                    "printable characters without spaces")
    return token


def load_or_make_token(path: str) -> tuple[str, bool]:
    """(the token in ``path``, False), or (a new token written there, mode 0600, True)
    when ``path`` does not exist. Raises ConfigError (see :func:`read_token`)."""
    try:
        return read_token(path), False
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(path, "", "the token file is a symlink; name the file itself"
                              ) from exc
        raise ConfigError(path, "", f"cannot read the token file: {exc.strerror}") from exc
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        raise ConfigError(path, "", f"cannot make the token file: {exc.strerror}") from exc
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    return token, True


def bind_unix(path: str, others: bool) -> socket.socket:
    """A listening Unix socket at ``path``: mode 0600, or 0666 when ``others`` (uids other
    than ours are allowed: the peer-credential check is then the gate). A stale socket
    there (nothing listening) is replaced; anything else is refused.

    Raises:
        ConfigError: something listens there, it is not a socket, or it cannot be bound.
    """
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(path, "", "exists and is not a socket; name another path")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(path) == 0:
                raise ConfigError(path, "", "a server already listens on this socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
        os.chmod(path, 0o666 if others else 0o600)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(path, "", f"cannot listen here: {exc.strerror}") from exc
    finally:
        os.umask(old_umask)
    sock.setblocking(False)
    return sock


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def peer_gate(allowed_uids: frozenset[int]) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, refusing (403, then closing) a connection whose peer uid is
    not in ``allowed_uids`` as it is accepted -- before a byte of it is read."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class PeerGate(H11Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            sock = transport.get_extra_info("socket")
            try:
                uid: int | None = peer_uid(sock) if sock is not None else None
            except OSError:
                uid = None
            if uid is not None and uid in allowed_uids:
                return
            body = (f"uid {uid} may not use this MCP server; the allowed uids are "
                    f"{sorted(allowed_uids)} (jaild mcp --allow-user)\n").encode()
            log.warning("refused a connection from uid %s on the MCP socket", uid)
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\n"
                            b"Connection: close\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
            transport.close()

    return PeerGate


def user_uid(text: str) -> int:
    """A uid from a user name or a number (``--allow-user``)."""
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no user {text!r} (give a name or a uid)") from None


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
                   "/run/jaild/jaild.sock; a private daemon if none runs), or tls://HOST:PORT")
    add_tls_arguments(p)
    p.add_argument("--policy", default="default", help="policy the code runs under")
    p.add_argument(
        "--tools", action="append", default=[], metavar="FILE",
        help="tool provider (repeatable): an mcpServers JSON file (its tools are "
             "tools.SERVER.f), a directory of them, or " + TOOLS_FLAG_HELP,
    )
    p.add_argument("--timeout", type=float, help="wall-clock seconds per run (at most the "
                   "policy's)")
    p.add_argument("--persistent", action="store_true",
                   help="run_python calls of one MCP session share one jaild session")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--http", type=_host_port, metavar="HOST:PORT",
                       help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio; "
                            "clients must send the bearer token (see --token-file)")
    where.add_argument("--unix", metavar="PATH",
                       help="serve streamable HTTP (endpoint /mcp) on the Unix socket PATH "
                            "instead of stdio, to the uids of --allow-user only")
    p.add_argument("--token-file", metavar="FILE",
                   help="the bearer token: read from FILE (yours, mode 0600), or generated "
                        "into FILE if it does not exist. With --http and no --token-file a "
                        "token is generated and printed on stderr. With --unix: optional, "
                        "checked besides the peer's uid")
    p.add_argument("--allow-user", action="append", type=user_uid, default=[],
                   metavar="USER", help="with --unix: a user (name or uid) who may connect "
                   "(repeatable; default: the user running jaild mcp)")
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                   help="seconds for each MCP server to start and list its tools")
    p.add_argument("--call-timeout", type=float, default=DEFAULT_CALL_TIMEOUT_S,
                   help="seconds for each call to an MCP server's tool")
    p.add_argument("--skip-failed", action="store_true",
                   help="leave out (with a warning) MCP servers that fail to start")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"],
                   help="what the server logs to stderr (default: warning)")
    p.set_defaults(func=cmd_mcp)


def _print_err(message: str) -> None:
    print(f"jaild mcp: {message}", file=sys.stderr, flush=True)


def cmd_mcp(args: argparse.Namespace) -> int:
    """``jaild mcp``: returns the exit status (1 with a line saying so without
    ``jaild[mcp]``)."""
    require("mcp", "jaild mcp")
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
    if (args.http is None and args.unix is None
            and "console" in tracing.requested_exporters(os.environ)):
        _print_err("OTEL_TRACES_EXPORTER=console writes spans to stdout, which is this "
                   "server's MCP channel over stdio: export with otlp, or serve --http/--unix")
        return EXIT_USAGE
    try:
        with tracing.exporting("jaild-mcp"):  # when OTEL_TRACES_EXPORTER asks
            return asyncio.run(_serve(args, providers))
    except TracingError as exc:
        _print_err(exc.message)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token the transport requires (None: stdio, or --unix without a file).
    Raises ConfigError."""
    if args.token_file is not None and args.http is None and args.unix is None:
        raise ConfigError("--token-file", "", "is for --http or --unix")
    if args.allow_user and args.unix is None:
        raise ConfigError("--allow-user", "", "is for --unix")
    if args.token_file is not None:
        token, made = load_or_make_token(args.token_file)
        if made:
            _print_err(f"wrote a new bearer token to {args.token_file} (mode 0600); clients "
                       "send it as 'Authorization: Bearer <token>'")
        return token
    if args.http is None:
        return None
    token = secrets.token_urlsafe(32)
    _print_err(f"bearer token for this run: {token}\n(clients send 'Authorization: Bearer "
               "<token>'; use --token-file FILE to keep it in a 0600 file instead)")
    return token


async def _serve(args: argparse.Namespace, providers: ToolProviders) -> int:
    """Serve with the daemon at the named socket (``--socket``, ``$JAILD_SOCKET``), else
    the default one if a daemon listens there, else a private daemon started for this
    server and stopped with it: the rule of every front end (``jaild run``, ``session``,
    ``codemode``; :func:`jaild.daemon.private.daemon_socket`)."""
    from jaild.daemon.config import DaemonConfig
    from jaild.daemon.private import daemon_socket

    def announce(path: str) -> None:
        _print_err(f"no daemon at {path}; serving with a private daemon")

    try:
        async with daemon_socket(args.socket, DaemonConfig.from_sources, args.policy,
                                 announce) as socket_path:
            return await _serve_on(args, providers, socket_path)
    except JaildError as exc:  # a private daemon was needed and could not start (or its
        _print_err(error_line(exc))  # config file is bad)
        return exit_code_for(exc)


async def _serve_on(args: argparse.Namespace, providers: ToolProviders, socket_path: str) -> int:
    try:
        token = _token(args)
    except ConfigError as exc:
        _print_err(str(exc))
        return exit_code_for(exc)
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
        if args.http is None and args.unix is None:
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
        elif args.unix is not None:
            allowed = frozenset(args.allow_user or [os.geteuid()])
            try:
                await server.serve_unix(args.unix, allowed, token)
            except ConfigError as exc:
                _print_err(str(exc))
                return exit_code_for(exc)
        else:
            assert token is not None
            host, port = args.http
            await server.serve_http(host, port, token)
        return 0
    finally:
        await server.close()
        await providers.aclose()
