"""The client's public entry points: full, typed signatures that the blocking and the asyncio
clients share parameter for parameter, documented alike -- and every keyword of a run
reaching the job through each of them (against the daemon in memory, no root).

``help(Client.run)`` used to show ``**kwargs``; these tests keep it from coming back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import pydoc
import re
import typing
from collections.abc import Callable
from typing import Any

import pytest

from jaild.client import (
    RUN_OPTION_DEFAULTS,
    AsyncClient,
    AsyncSession,
    Client,
    JobResult,
    RunOptions,
    Session,
    _run_options,
)
from jaild.testing import daemon_thread
from tests.conftest import guard, until

PAIRS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "run": (Client.run, AsyncClient.run),
    "submit": (Client.submit, AsyncClient.submit),
    "session": (Client.session, AsyncClient.session),
    "session run": (Session.run, AsyncSession.run),
}
"""Each blocking entry point and the asyncio one it wraps."""

RUNS = [Client.run, Client.submit, AsyncClient.run, AsyncClient.submit,
        Session.run, AsyncSession.run, AsyncSession.submit]
"""Every public method that runs code: their keyword-only parameters are the run's options."""

ENTRY_POINTS = sorted({*RUNS, Client.session, AsyncClient.session}, key=lambda f: f.__qualname__)


def signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s signature, its annotations evaluated (they must resolve, for IDEs and help())."""
    return inspect.signature(fn, eval_str=True)


def args_section(fn: Callable[..., Any]) -> dict[str, str]:
    """The ``Args:`` entries of ``fn``'s docstring: name -> its text (continuation lines
    joined)."""
    doc = inspect.getdoc(fn) or ""
    match = re.search(r"^Args:\n((?:    .*\n|\n)+?)(?=^\S|\Z)", doc + "\n", re.MULTILINE)
    assert match, f"{fn.__qualname__}: no Args section"
    entries: dict[str, str] = {}
    name = ""
    for line in match.group(1).splitlines():
        head = re.match(r"^    (\w+): (.*)$", line)
        if head:
            name = head.group(1)
            assert name not in entries, f"{fn.__qualname__}: {name} documented twice"
            entries[name] = head.group(2)
        elif line.strip():
            assert line.startswith("        ") and name, f"{fn.__qualname__}: {line!r}"
            entries[name] += " " + line.strip()
    return entries


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__qualname__)
def test_no_entry_point_takes_arbitrary_keywords(fn: Callable[..., Any]) -> None:
    kinds = {p.kind for p in signature(fn).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    assert inspect.Parameter.VAR_POSITIONAL not in kinds


@pytest.mark.parametrize("pair", PAIRS.values(), ids=list(PAIRS))
def test_the_blocking_and_the_asyncio_client_take_the_same_parameters(
    pair: tuple[Callable[..., Any], Callable[..., Any]],
) -> None:
    blocking, asynchronous = (list(signature(fn).parameters.values()) for fn in pair)
    assert blocking == asynchronous  # names, order, kinds, defaults and types


@pytest.mark.parametrize("fn", RUNS, ids=lambda f: f.__qualname__)
def test_the_keywords_of_every_run_are_the_run_options(fn: Callable[..., Any]) -> None:
    """Declared once (RunOptions, with RUN_OPTION_DEFAULTS beside it): each entry point's
    keyword-only parameters, as help() and inspect show them, are exactly those, with
    their defaults and types; in the source each takes ``**options: Unpack[RunOptions]``."""
    keywords = [p for p in signature(fn).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    hints = typing.get_type_hints(RunOptions)
    assert list(hints) == list(RUN_OPTION_DEFAULTS)
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=hints[name])
               for name, default in RUN_OPTION_DEFAULTS.items()]
    assert keywords == options
    source = inspect.getsource(fn)
    assert "**options: Unpack[RunOptions]" in source and "timeout:" not in source


def test_an_unknown_keyword_is_named_with_the_ones_a_run_takes() -> None:
    """``**options`` takes any keyword at the language level: the one place that reads
    them refuses one it does not know, as a written-out signature would (each entry point
    is driven with one below: Typo)."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'timout'; a run takes "
                                        "timeout, limits"):
        _run_options({"timout": 5})  # type: ignore[typeddict-unknown-key]
    assert _run_options({"timeout": 5})["filename"] == "<job>"  # the control


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__qualname__)
def test_every_parameter_is_documented(fn: Callable[..., Any]) -> None:
    params = [name for name in signature(fn).parameters if name != "self"]
    assert list(args_section(fn)) == params
    doc = inspect.getdoc(fn) or ""
    assert "\nReturns:\n" in doc and "\nRaises:\n" in doc, fn.__qualname__


@pytest.mark.parametrize("pair", PAIRS.values(), ids=list(PAIRS))
def test_the_blocking_and_the_asyncio_client_document_their_parameters_alike(
    pair: tuple[Callable[..., Any], Callable[..., Any]],
) -> None:
    assert args_section(pair[0]) == args_section(pair[1])


def test_help_shows_the_run_options() -> None:
    shown = pydoc.render_doc(Client.run, renderer=pydoc.plaintext)
    assert "**kwargs" not in shown
    for name in ("timeout", "limits", "on_stdout", "files", "download", "approve"):
        assert f"{name}: " in shown, name
    assert "Wall-clock seconds" in shown  # the Args section, too


# ----------------------------------------------------------------------------- behaviour

POLICY = "[limits]\nwall_time_s = 20\noutput_bytes = 1000000\n[access]\napprove = [\"transfer\"]\n"

CODE = (
    "import sys\n"
    "print('out')\n"
    "print('err', file=sys.stderr)\n"
    "open('out.txt', 'w').write(open('in.txt').read().upper())\n"
    "[await tools.transfer(n=3), sys._getframe().f_code.co_filename]\n"
)
"""Uses every option: prints to both streams, reads an upload, writes a file to download,
calls a tool that needs approval and names the file it was compiled as."""


class Seen:
    """What a run's callbacks saw."""

    def __init__(self) -> None:
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.asked: list[str] = []

    def options(self) -> dict[str, Any]:
        def approve(name: str, args: list[Any], kwargs: dict[str, Any]) -> bool:
            self.asked.append(name)
            return True

        return {"timeout": 15, "limits": {"output_bytes": 4096},
                "on_stdout": self.stdout.append, "on_stderr": self.stderr.append,
                "filename": "cell.py", "files": {"in.txt": b"abc"}, "download": ["out.txt"],
                "approve": approve}

    def check(self, r: JobResult, entry_point: str) -> None:
        assert r.status == "ok", (entry_point, r.error)
        assert r.result == [3, "cell.py"], entry_point
        assert (r.limits["wall_time_s"], r.limits["output_bytes"]) == (15, 4096), entry_point
        assert r.downloads == {"out.txt": b"ABC"}, entry_point
        assert ("".join(self.stdout), "".join(self.stderr)) == ("out\n", "err\n"), entry_point
        assert self.asked == ["transfer"], entry_point


class Typo(Seen):
    """A misspelt option: every entry point raises TypeError for it, sending nothing."""

    def options(self) -> dict[str, Any]:
        return {"timout": 15}


TOOLS = {"transfer": lambda n: n}
PID = "import os\nos.getpid()"
"""In a session: its jail's pid (the fake launcher's jails are plain processes)."""


def reaped(pids: list[int]) -> None:
    """Wait until the sessions' jails are reaped. A daemon stopped while a session it was
    just told to close is still being discarded can leave that jail's process unreaped
    (seen with jaild.testing's daemon thread: a ResourceWarning, which fails the test)."""
    until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids),
          "the sessions' jails reaped", timeout=30)


def blocking_run(client: Client, seen: Seen, name: str, pids: list[int]) -> JobResult:
    if name == "Client.run":
        return client.run(CODE, tools=TOOLS, **seen.options())
    if name == "Client.submit":
        return client.submit(CODE, tools=TOOLS, **seen.options()).result(guard(60))
    with client.session(tools=TOOLS) as s:
        result = s.run(CODE, **seen.options())
        pids.append(s.run(PID).result)
        return result


async def asyncio_run(client: AsyncClient, seen: Seen, name: str, pids: list[int]) -> JobResult:
    if name == "AsyncClient.run":
        return await client.run(CODE, tools=TOOLS, **seen.options())
    if name == "AsyncClient.submit":
        return await (await client.submit(CODE, tools=TOOLS, **seen.options())).result()
    async with client.session(tools=TOOLS) as s:
        if name == "AsyncSession.run":
            result = await s.run(CODE, **seen.options())
        else:
            result = await (await s.submit(CODE, **seen.options())).result()
        pids.append((await s.run(PID)).result)
        return result


def test_every_run_option_reaches_the_job_through_every_entry_point() -> None:
    checked: list[str] = []
    pids: list[int] = []
    with daemon_thread({"default": POLICY}) as d:
        with Client(d.socket_path) as client:
            for name in ("Client.run", "Client.submit", "Session.run"):
                with pytest.raises(TypeError, match="unexpected keyword argument 'timout'"):
                    blocking_run(client, Typo(), name, pids)
                seen = Seen()
                seen.check(blocking_run(client, seen, name, pids), name)
                checked.append(name)

        async def main() -> None:
            async with asyncio.timeout(guard(120)), AsyncClient(d.socket_path) as client:
                for name in ("AsyncClient.run", "AsyncClient.submit", "AsyncSession.run",
                             "AsyncSession.submit"):
                    with pytest.raises(TypeError, match="unexpected keyword argument 'timout'"):
                        await asyncio_run(client, Typo(), name, pids)
                    seen = Seen()
                    seen.check(await asyncio_run(client, seen, name, pids), name)
                    checked.append(name)

        asyncio.run(main())
        reaped(pids)
    assert sorted(checked) == sorted(f.__qualname__ for f in RUNS)


def test_a_session_run_without_approve_asks_the_sessions_callback() -> None:
    asked: list[str] = []

    def session_approve(name: str, args: list[Any], kwargs: dict[str, Any]) -> bool:
        asked.append(name)
        return True

    with daemon_thread({"default": POLICY}) as d, Client(d.socket_path) as client:
        with client.session(tools=TOOLS, approve=session_approve) as s:
            r = s.run("await tools.transfer(n=5)", approve=None)  # None: the default
            pid = s.run(PID).result
        reaped([pid])
    assert (r.status, r.result, asked) == ("ok", 5, ["transfer"])


def test_a_job_result_has_every_field_of_the_record_and_only_those_besides_its_own() -> None:
    """JobResult is the record's fields plus ``result`` and ``downloads``; the copies between
    them are derived from the record's fields (client.RECORD_FIELDS), so a field added to
    JobRecord and not to JobResult fails here, not in a to_dict that forgot it."""

    from jaild.client import RECORD_FIELDS, JobResult
    from jaild.protocol.records import JobRecord

    own = {f.name for f in dataclasses.fields(JobResult)} - {"result", "downloads", "_record"}
    assert own == {f.name for f in dataclasses.fields(JobRecord)} == set(RECORD_FIELDS)


def test_a_job_results_views_round_trip_through_the_record() -> None:
    from jaild.client import JobResult

    wire = {"job_id": "job-1", "policy": "default", "status": "error", "stdout": "a",
            "stderr": "b", "error": {"type": "ValueError", "message": "no", "traceback": "t"},
            "tool_calls": [{"name": "f", "duration_s": 0.5, "ok": True}], "duration_s": 1.5,
            "limits": {"wall_time_s": 30}, "usage": None, "files": [], "files_skipped": [],
            "tool_calls_omitted": 3, "session": {"id": "ses-1", "run": 2, "closed": "timeout"},
            "network_refused": 2}
    r = JobResult.from_wire(wire, None, {"out.txt": b"x"})
    assert (r.tool_calls_omitted, r.session, r.network_refused, r.downloads, r.usage) == (
        3, {"id": "ses-1", "run": 2, "closed": "timeout"}, 2, {"out.txt": b"x"}, {})
    d = r.to_dict()
    assert list(d)[:3] == ["job_id", "status", "result"] and d["usage"] == {}
    assert "egress" not in d and d["tool_calls_omitted"] == 3  # at its default: left out
    again = JobResult.from_wire(r.record, None)
    assert again.to_dict() == d
    made = JobResult(**{k: v for k, v in d.items() if k != "result"}, result=None)
    assert made.record == r.record  # a hand-made result types as the wire's


def test_a_field_the_records_view_leaves_out_keeps_its_value() -> None:
    """The record's view leaves out what is empty (0 network refusals counted): the result
    keeps it as counted, not as 'not reported' (None)."""
    from jaild.client import JobResult

    wire = {"job_id": "job-1", "policy": "default", "status": "ok", "stdout": "", "stderr": "",
            "error": None, "tool_calls": [], "duration_s": 0.1, "limits": {}, "usage": None,
            "files": [], "files_skipped": [], "tool_calls_omitted": 0, "session": None}
    assert JobResult.from_wire({**wire, "network_refused": 0}, None).network_refused == 0
    assert JobResult.from_wire(wire, None).network_refused is None


# ------------------------------------------------------------------------------- transport


def test_the_transport_shorthand_keywords_are_the_transports_fields() -> None:
    from jaild.transport import Transport, TransportOptions

    assert list(typing.get_type_hints(TransportOptions)) == [
        f.name for f in dataclasses.fields(Transport)]


def test_both_spellings_of_the_transport_give_the_same_object() -> None:
    """``AsyncClient(address, cert=..., ...)``, the shorthand kept for one release, builds
    the ``Transport`` that ``transport=`` gives; the blocking client and the fleets take
    either and hand it on."""
    import ssl

    from jaild.fleet import AsyncFleet, Fleet
    from jaild.transport import Transport

    context = ssl.create_default_context()
    fields: dict[str, Any] = {"tls": context, "server_name": "daemon.example",
                              "liveness_timeout_s": 7.0, "connect_timeout_s": 3.0}
    address = "tls://daemon.example:7100"
    long = AsyncClient(address, transport=Transport(**fields))
    short = AsyncClient(address, **fields)
    assert short.transport == long.transport == Transport(**fields)
    assert short._wire.server_name == long._wire.server_name == "daemon.example"
    assert AsyncClient("/tmp/x.sock").transport == Transport()
    fleet = AsyncFleet([address], transport=Transport(**fields))
    assert fleet._factory(address).transport == long.transport
    assert AsyncFleet([address], **fields)._factory(address).transport == long.transport
    for entry in (Client, Fleet):
        assert "transport" in inspect.signature(entry).parameters
    with pytest.raises(TypeError, match="give transport= or its fields as keywords"):
        AsyncClient(address, transport=Transport(**fields), connect_timeout_s=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cafile'"):
        AsyncClient(address, cafile="x")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="are for a tls:// address"):
        AsyncClient("/tmp/x.sock", transport=Transport(ca="ca.pem"))
