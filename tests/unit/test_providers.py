"""Tool providers offline: mcpServers parsing and its error messages, names, MCP results as
plain values, Python modules as grouped tools, and run_python's description and records."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp_types import CallToolResult, ImageContent, TextContent

from jaild.mcp_server import describe_run_python, json_safe, summarize
from jaild.providers import (
    ConfigError,
    McpToolError,
    ModuleSource,
    ProviderError,
    ToolProviders,
    load_mcp_servers,
    load_modules,
    module_sources,
    one_line,
    parse_mcp_servers,
    result_value,
    sanitize_group,
    tool_name,
)
from jaild.toolspec import HostTool

ENV = {"TOKEN": "t0k", "HOME": "/home/u"}


def parse(servers: Any, environ: dict[str, str] | None = None) -> list[Any]:
    return parse_mcp_servers({"mcpServers": servers}, "cfg.json", ENV if environ is None else environ)


def error_of(servers: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse(servers, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- parsing


def test_stdio_sse_and_streamable_http_entries() -> None:
    stdio, sse, http, plain_url = parse({
        "github": {"command": "npx", "args": ["-y", "server-github"],
                   "env": {"GITHUB_TOKEN": "${TOKEN}"}, "cwd": "${HOME}/w"},
        "calendar": {"type": "sse", "url": "http://localhost:3001/sse"},
        "search": {"type": "http", "url": "https://example.com/mcp",
                   "headers": {"Authorization": "Bearer ${TOKEN}"}},
        "plain": {"url": "http://127.0.0.1:9/mcp"},
    })
    assert (stdio.name, stdio.transport, stdio.command, stdio.args) == (
        "github", "stdio", "npx", ("-y", "server-github"))
    assert dict(stdio.env) == {"GITHUB_TOKEN": "t0k"} and stdio.cwd == "/home/u/w"
    assert (sse.transport, sse.url) == ("sse", "http://localhost:3001/sse")
    assert http.transport == "streamable-http" and dict(http.headers) == {"Authorization": "Bearer t0k"}
    assert plain_url.transport == "streamable-http"  # a url without a type
    assert stdio.source == "cfg.json"


def test_repr_never_shows_env_or_headers() -> None:
    stdio, http = parse({"a": {"command": "x", "env": {"K": "${TOKEN}"}},
                         "b": {"url": "http://h/mcp", "headers": {"A": "${TOKEN}"}}})
    assert "t0k" not in repr(stdio) and "t0k" not in repr(http)


def test_type_spellings_and_disabled_servers() -> None:
    servers = parse({
        "a": {"type": "streamable-http", "url": "http://h/mcp"},
        "b": {"type": "streamableHttp", "url": "http://h/mcp"},
        "c": {"type": "stdio", "command": "x"},
        "off": {"command": "x", "disabled": True},
    })
    assert [(s.name, s.transport) for s in servers] == [
        ("a", "streamable-http"), ("b", "streamable-http"), ("c", "stdio")]


def test_variable_defaults_and_missing_variables() -> None:
    (s,) = parse({"a": {"command": "x", "args": ["${NOPE:-fallback}", "${NOPE:-}"]}})
    assert s.args == ("fallback", "")
    assert error_of({"a": {"command": "x", "env": {"K": "${NOPE}"}}}) == (
        "cfg.json: mcpServers.a.env.K: ${NOPE} is not set in the environment "
        "(use ${NOPE:-default} for a default)")


@pytest.mark.parametrize(("servers", "message"), [
    ({"a": {"command": "x", "argz": []}},
     "cfg.json: mcpServers.a.argz: unknown key; allowed: args, command, cwd, disabled, env, type"),
    ({"a": {"url": "http://h/mcp", "env": {}}},
     "cfg.json: mcpServers.a.env: unknown key for a streamable-http server; "
     "allowed: disabled, headers, type, url"),
    ({"a": {"type": "websocket", "url": "ws://h"}},
     "cfg.json: mcpServers.a.type: unknown type 'websocket'"),
    ({"a": {"command": "x", "url": "http://h"}},
     "cfg.json: mcpServers.a: give either 'command' (stdio) or 'url'"),
    ({"a": {"args": []}}, "cfg.json: mcpServers.a: needs 'command' (a stdio server) or 'url'"),
    ({"a": {"type": "sse", "command": "x"}}, "cfg.json: mcpServers.a.command: unknown key for a sse"),
    ({"a": {"type": "stdio", "url": "http://h"}}, "cfg.json: mcpServers.a.url: unknown key for a stdio"),
    ({"a": {"command": 3}}, "cfg.json: mcpServers.a.command: must be a string, got int"),
    ({"a": {"command": " "}}, "cfg.json: mcpServers.a.command: must not be empty"),
    ({"a": {"command": "x", "args": "-v"}}, "cfg.json: mcpServers.a.args: must be a list of strings, got str"),
    ({"a": {"command": "x", "args": ["-v", 2]}}, "cfg.json: mcpServers.a.args[1]: must be a string, got int"),
    ({"a": {"command": "x", "env": {"PORT": 80}}}, "cfg.json: mcpServers.a.env.PORT: must be a string, got int"),
    ({"a": {"command": "x", "env": ["K=V"]}}, "cfg.json: mcpServers.a.env: must be an object of strings, got list"),
    ({"a": {"url": "localhost:3000/mcp"}}, "cfg.json: mcpServers.a.url: must be an http:// or https:// URL"),
    ({"a": {"url": "http://h", "headers": {"X": None}}}, "cfg.json: mcpServers.a.headers.X: must be a string"),
    ({"a": {"command": "x", "disabled": "yes"}}, "cfg.json: mcpServers.a.disabled: must be true or false"),
    ({"a": "npx server"}, "cfg.json: mcpServers.a: must be an object, got str"),
    ({"": {"command": "x"}}, "cfg.json: mcpServers.: a server name must not be empty"),
])
def test_invalid_entries_name_the_file_the_server_and_the_problem(servers: Any, message: str) -> None:
    assert error_of(servers).startswith(message)


@pytest.mark.parametrize(("document", "message"), [
    ([], "cfg.json: must be a JSON object, got list"),
    ({"servers": {}}, "cfg.json: servers: unknown key (a server file has only 'mcpServers')"),
    ({}, "cfg.json: mcpServers: missing, or not an object of servers by name"),
    ({"mcpServers": []}, "cfg.json: mcpServers: missing, or not an object of servers by name"),
])
def test_invalid_documents(document: Any, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_mcp_servers(document, "cfg.json", ENV)


def test_config_errors_are_value_errors_with_parts() -> None:
    with pytest.raises(ValueError) as info:
        parse({"a": {"command": 1}})
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ProviderError)
    assert (info.value.source, info.value.key) == ("cfg.json", "mcpServers.a.command")


# --------------------------------------------------------------------------- files


def write(path: Path, servers: Any) -> Path:
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def test_a_file_and_a_directory_of_files(tmp_path: Path) -> None:
    write(tmp_path / "b.json", {"beta": {"command": "b"}})
    write(tmp_path / "a.json", {"alpha": {"url": "http://h/mcp"}, "alpha2": {"command": "a"}})
    (tmp_path / "notes.txt").write_text("not json")
    assert [s.name for s in load_mcp_servers(tmp_path)] == ["alpha", "alpha2", "beta"]
    assert [s.source for s in load_mcp_servers(tmp_path / "b.json")] == [str(tmp_path / "b.json")]


def test_bad_json_names_the_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"mcpServers": {\n  "a": {"command": "x",}\n}}')
    with pytest.raises(ConfigError, match=rf"^{bad}: invalid JSON at line 2 column 24: "):
        load_mcp_servers(bad)


def test_a_key_twice_in_one_object_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "twice.json"
    f.write_text('{"mcpServers": {"a": {"command": "x"}, "a": {"command": "y"}}}')
    with pytest.raises(ConfigError, match=rf"^{f}: a: this key appears twice in one object"):
        load_mcp_servers(f)


def test_the_same_server_in_two_files(tmp_path: Path) -> None:
    first = write(tmp_path / "1.json", {"github": {"command": "a"}})
    second = write(tmp_path / "2.json", {"github": {"url": "http://h/mcp"}})
    message = f"{second}: mcpServers.github: a server of this name is also defined in {first}"
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_mcp_servers(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    again = write(other / "x.json", {"github": {"command": "b"}})
    with pytest.raises(ConfigError, match=f"^{again}: mcpServers.github: .* also defined in {first}$"):
        ToolProviders.load([first, other])


def test_unreadable_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no \*\.json files in this directory"):
        load_mcp_servers(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'missing.json'}: no such file"):
        ToolProviders.load([tmp_path / "missing.json"])
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"mcpServers": {"caf\xe9": {"command": "x"}}}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_mcp_servers(latin)


def test_groups_that_would_collide(tmp_path: Path) -> None:
    cfg = write(tmp_path / "s.json", {"my.server": {"command": "a"}, "my_server": {"command": "b"}})
    with pytest.raises(ConfigError, match=r"mcpServers.my_server: its tools would be named "
                                          r"my_server\.\*, as those of server 'my.server'"):
        ToolProviders.load([cfg])
    cfg2 = write(tmp_path / "t.json", {"util": {"command": "a"}})
    module = tmp_path / "util.py"
    module.write_text("def f() -> int:\n    return 1\n")
    other = tmp_path / "other.py"
    other.write_text("def g() -> int:\n    return 2\n")
    with pytest.raises(ConfigError, match=r"name the group with GROUP="):
        ToolProviders.load([cfg2, module, other])  # several modules: util.* as the server's
    ToolProviders.load([cfg2, f"helpers={module}", other])  # a group of its own: fine
    ToolProviders.load([cfg2, module])  # alone: at the top (util.py's f is tools.f)


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize(("server", "tool", "name"), [
    ("github", "search_repositories", "github.search_repositories"),
    ("Calendar", "list-events", "Calendar.list-events"),
    ("my server", "get item", "my_server.get_item"),
    ("a.b", "c.d", "a_b.c.d"),  # the first dot separates the server from the tool
    ("1password", "read/secret", "_1password.read_secret"),
    ("x", "-rm", "x._-rm"),
    ("ünïcode", "tøøl", "_n_code.t__l"),
])
def test_tool_names(server: str, tool: str, name: str) -> None:
    assert tool_name(server, tool) == name


def test_sanitize_group_and_one_line() -> None:
    assert tool_name("", "get item") == "get_item"  # ungrouped (a module loaded with =FILE)
    assert sanitize_group("-x") == "_-x" and sanitize_group("ok_name-1") == "ok_name-1"
    assert one_line("\n\n  First line.  \nSecond.") == "First line."
    assert one_line("x" * 300, 10) == "x" * 9 + "…" and one_line("") == ""


# --------------------------------------------------------------------------- results


def test_structured_content_wins_and_a_result_wrapper_is_unwrapped() -> None:
    r = CallToolResult(content=[TextContent(text="5")], structured_content={"result": 5})
    wrapped = {"type": "object", "properties": {"result": {"type": "integer"}}}
    assert result_value(r, wrapped) == 5
    assert result_value(r, None) == {"result": 5}  # no schema: not known to be a wrapper
    obj = CallToolResult(content=[], structured_content={"a": 1, "result": 2})
    assert result_value(obj, wrapped) == {"a": 1, "result": 2}


def test_text_content_is_json_decoded_when_it_parses() -> None:
    assert result_value(CallToolResult(content=[TextContent(text='{"a": [1, 2]}')])) == {"a": [1, 2]}
    assert result_value(CallToolResult(content=[TextContent(text="plain words")])) == "plain words"
    many = CallToolResult(content=[TextContent(text="1"), TextContent(text="two"),
                                   ImageContent(data="aGk=", mime_type="image/png")])
    assert result_value(many) == [1, "two", {"type": "image", "data": "aGk=", "mimeType": "image/png"}]
    assert result_value(CallToolResult(content=[])) is None


def test_is_error_raises_with_the_tools_text() -> None:
    r = CallToolResult(content=[TextContent(text="rate limited"), TextContent(text="retry in 5 s")],
                       structured_content={"ignored": True}, is_error=True)
    with pytest.raises(McpToolError, match=r"^rate limited\nretry in 5 s$"):
        result_value(r)
    with pytest.raises(McpToolError, match="the tool reported an error"):
        result_value(CallToolResult(content=[], is_error=True))


# --------------------------------------------------------------------------- modules and lifecycle


def test_python_modules_become_grouped_tools(tmp_path: Path) -> None:
    module = tmp_path / "weather.py"
    module.write_text(
        "def forecast(city: str, days: int = 3) -> list[str]:\n"
        "    '''Forecast for a city.\n\n    Longer text.'''\n"
        "    return [city] * days\n"
        "def _private() -> None:\n    pass\n"
    )

    async def main(sources: list[Any]) -> tuple[dict[str, HostTool], list[tuple[str, str]]]:
        async with ToolProviders.load(sources) as p:
            return p.host_tools(), p.catalog()

    other = tmp_path / "other.py"
    other.write_text("def forecast() -> None:\n    pass\n")
    tools, catalog = asyncio.run(main([module, other]))  # several: each under its stem
    assert list(tools) == ["weather.forecast", "other.forecast"]
    assert catalog[1] == ("weather.forecast", "Forecast for a city.")
    assert tools["weather.forecast"].parameters["required"] == ["city"]
    assert tools["weather.forecast"].handler("Oslo", 1) == ["Oslo"]
    assert list(asyncio.run(main([module]))[0]) == ["forecast"]  # alone: at the top
    assert list(asyncio.run(main([f"wx={module}"]))[0]) == ["wx.forecast"]
    assert list(asyncio.run(main([f"={module}"]))[0]) == ["forecast"]
    assert list(asyncio.run(main([ModuleSource(str(module), "w")]))[0]) == ["w.forecast"]


def test_a_module_that_fails_to_import(tmp_path: Path) -> None:
    module = tmp_path / "broken.py"
    module.write_text("raise RuntimeError('no config')\n")

    async def main() -> None:
        async with ToolProviders.load([module]):
            pass

    with pytest.raises(ProviderError, match=rf"^cannot load tools from {module}: "
                                            r"RuntimeError: no config$"):
        asyncio.run(main())


def test_a_server_that_cannot_start_is_named_or_skipped(tmp_path: Path) -> None:
    cfg = write(tmp_path / "s.json", {"gone": {"command": str(tmp_path / "no-such-binary")}})

    async def start(**kwargs: Any) -> ToolProviders:
        p = ToolProviders.load([cfg], **kwargs)
        await p.start()
        await p.aclose()
        return p

    with pytest.raises(ProviderError, match=rf"^MCP server 'gone' \(from {cfg}\) failed to start: "
                                            r"FileNotFoundError"):
        asyncio.run(start())
    p = asyncio.run(start(skip_failed=True))
    assert list(p.failed) == ["gone"] and "failed to start" in p.failed["gone"] and len(p) == 0


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    script = f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    cfg = write(tmp_path / "s.json", {"mute": {"command": sys.executable, "args": ["-c", script]}})

    async def main() -> None:
        async with ToolProviders.load([cfg], connect_timeout_s=1.0, errlog=sys.stderr):
            pass

    with pytest.raises(ProviderError, match=r"^MCP server 'mute' \(from .*\) did not connect and "
                                            r"list its tools within 1 s$"):
        asyncio.run(main())
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


# --------------------------------------------------------------------------- run_python


def _tool(name: str, description: str, parameters: dict[str, Any]) -> HostTool:
    return HostTool(name, description, parameters, lambda: None)


def test_run_python_description_lists_every_tool() -> None:
    tools = {
        "gh.search": _tool("gh.search", "Search repos.\nMore.", {
            "type": "object", "properties": {"q": {}, "limit": {}}, "required": ["q"]}),
        "cal.list-events": _tool("cal.list-events", "", {"type": "object"}),
    }
    text = describe_run_python(tools, persistent=False)
    assert "Available tools (2):\n- cal.list-events()\n- gh.search(q, limit=…): Search repos." in text
    assert "More." not in text and "nothing persists between calls" in text
    assert "persist between run_python calls" in describe_run_python(tools, persistent=True)
    assert "No host tools are configured." in describe_run_python({}, persistent=False)


def test_records_are_made_json_safe_and_summarized() -> None:
    value = {1: b"\xff", (1, 2): float("nan"), "s": {1, 2}, "ok": [1.5, None, "x", b"hi"]}
    safe = json_safe(value)
    assert safe == {"1": "b'\\xff'", "[1, 2]": "nan", "s": "{1, 2}", "ok": [1.5, None, "x", "hi"]}
    json.dumps(safe, allow_nan=False)
    record = {"status": "error", "result": None, "stdout": "a\n", "stderr": "", "tool_calls": [{}],
              "duration_s": 0.25, "error": {"type": "KeyError", "message": "'k'", "lineno": 3,
                                            "traceback": "Traceback ...\nKeyError: 'k'\n"}}
    text = summarize(record, note="a note")
    assert text.splitlines()[:3] == ["status: error (0.25 s, 1 tool call)", "note: a note", "stdout:"]
    assert "error: KeyError: 'k' (line 3)\nTraceback ...\nKeyError: 'k'" in text
    long = summarize({"status": "ok", "result": "x" * 20000, "stdout": "", "stderr": "",
                      "error": None, "tool_calls": []})
    assert len(long) < 9000 and "more characters of the result in the structured result" in long
    caught = summarize({"status": "ok", "result": 1, "stdout": "", "stderr": "", "error": None,
                        "tool_calls": [], "duration_s": 0.5, "network_refused": 2})
    assert caught.splitlines()[0] == "status: ok (0.50 s, 2 network attempts refused)"


# --------------------------------------------------------------------------- --tools naming


@pytest.mark.parametrize(("specs", "groups"), [
    (["a/tools.py"], [""]),                                  # alone: at the top
    (["a/tools.py", "b/more.py"], ["tools", "more"]),        # several: by stem
    (["g=a/tools.py"], ["g"]),                               # GROUP=: under it
    (["g=a/tools.py", "b/more.py"], ["g", ""]),              # the one without a group: top
    (["g=a/tools.py", "b/more.py", "c/x.py"], ["g", "more", "x"]),
    (["=a/tools.py", "b/more.py", "c/x.py"], ["", "more", "x"]),  # =FILE: at the top
])
def test_the_tools_naming_rule(specs: list[str], groups: list[str]) -> None:
    assert [m.group for m in module_sources(specs)] == groups
    assert [m.path for m in module_sources(specs)] == [s.partition("=")[2] or s for s in specs]


def test_every_front_end_names_tools_by_the_one_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """jaild run/session (cli._load_tools), jaild codemode (load_modules, as cmd_codemode
    calls it) and jaild mcp (ToolProviders) name one --tools' functions alike."""
    from jaild import cli

    a = tmp_path / "tools.py"
    a.write_text("def f() -> int:\n    return 1\n")
    b = tmp_path / "more.py"
    b.write_text("def f() -> int:\n    return 2\n")

    async def mcp(specs: list[str]) -> list[str]:
        async with ToolProviders.load(specs) as p:
            return sorted(p.host_tools())

    parser = cli.build_parser()
    for specs, names in [([str(a)], ["f"]), ([f"g={a}"], ["g.f"]),
                         ([str(a), str(b)], ["more.f", "tools.f"])]:
        flags = [x for spec in specs for x in ("--tools", spec)]
        for command in (["run", "-c", "1"], ["session"], ["codemode", "a task"]):
            parsed = parser.parse_args([command[0], *flags, *command[1:]])
            assert parsed.tools == specs
            assert sorted(cli._load_tools(parsed.tools) or {}) == names
        assert sorted(load_modules(specs)) == names
        assert asyncio.run(mcp(specs)) == names
    assert cli._load_tools([str(tmp_path / "missing.py")]) is None
    assert "cannot load tools from" in capsys.readouterr().err


def test_a_tool_and_a_group_may_not_share_a_name(tmp_path: Path) -> None:
    a = tmp_path / "util.py"
    a.write_text("def f() -> int:\n    return 1\n")
    b = tmp_path / "top.py"
    b.write_text("def util() -> int:\n    return 2\n")
    with pytest.raises(ConfigError, match=r"a tool and a group of tools \(util.f\) would share"):
        load_modules([f"util={a}", f"={b}"])
    assert sorted(load_modules([f"util={a}", f"other={b}"])) == ["other.util", "util.f"]
