"""jaild.testing: the frame helpers, the fake launcher and the daemon in memory -- and,
through them, the broker's and the pipeline's rules without root.

Every test here runs the real daemon core (server shell, admission, pipeline, placement,
sessions, registry, job machine, broker) and the real in-jail runtime, in plain
subprocesses: no root, no namespaces, no cgroups, no nsjail. The positive controls are
the tests next to each refusal: the same daemon runs what it then refuses.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from jaild.client import AsyncClient, Client
from jaild.daemon.config import DaemonConfig
from jaild.daemon.core.machine import JobSpec
from jaild.daemon.jails.job import CallReply, JailedJob
from jaild.errors import (
    BadRequest,
    Busy,
    LocalProtocolError,
    PermissionDenied,
    RemoteProtocolError,
    UnknownPolicy,
)
from jaild.protocol import CLOSED, PROTOCOL_VERSION, Role, pack, unpack
from jaild.protocol.messages import (
    CodeFinished,
    Error,
    Hello,
    JailCallTool,
    JobDescription,
    RunCode,
    RunJob,
    ToolSpec,
    Welcome,
)
from jaild.testing import (
    UNHARDENED,
    ConnectionPair,
    FakeLauncher,
    daemon_pair,
    daemon_thread,
    fake_daemon,
    fake_environment,
    frame,
    frames,
    load_policies,
)
from tests.conftest import guard

POLICY = """
[limits]
wall_time_s = 20
tool_call_timeout_s = 20

[access]
approve = ["transfer"]
"""
"""The policy of these tests: ``transfer`` needs the client's approval."""


def run(test: Callable[[AsyncClient], Awaitable[None]], policies: Any = None) -> None:
    """Run ``test`` against a fresh daemon pair (``guard``: a liveness bound only)."""

    async def main() -> None:
        async with asyncio.timeout(guard(60)):
            async with daemon_pair(policies or {"default": POLICY}) as client:
                await test(client)

    asyncio.run(main())


# ----------------------------------------------------------------------------- frames


def test_frames_round_trip_whole_and_in_any_split() -> None:
    run = RunJob(ref=1, job=JobDescription(code="1"), policy="default")
    messages = [Hello(protocol=PROTOCOL_VERSION, client="t"), run]
    data = b"".join(frame(m) for m in messages)
    assert frames(data, "client->daemon") == messages
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        frames(data[:-1], "client->daemon")
    with pytest.raises(RemoteProtocolError):  # a daemon->client message sent the wrong way
        frames(frame(Welcome(protocol=PROTOCOL_VERSION)), "client->daemon")


def test_frame_refuses_what_the_link_would_refuse() -> None:
    with pytest.raises(LocalProtocolError, match="frame"):
        frame(RunJob(ref=1, job=JobDescription(code="x" * 1000), policy="default"),
              max_frame_bytes=100)


def test_client_link_pair_follows_the_state_table() -> None:
    pair = ConnectionPair.client_link()
    with pytest.raises(LocalProtocolError):  # nothing before Hello
        pair.send(Role.CLIENT, RunJob(ref=1, job=JobDescription(code="1"), policy="default"))
    pair.handshake()
    assert pair[Role.CLIENT].state is pair[Role.DAEMON].state
    run = RunJob(ref=7, job=JobDescription(code="1"), policy="default")
    assert pair.send(Role.CLIENT, run) == [run]
    assert pair.close(Role.CLIENT) == [CLOSED]


def test_jail_link_pair_byte_by_byte() -> None:
    pair = ConnectionPair.jail_link()
    pair.handshake()
    run_code = RunCode(job=JobDescription(code="1", filename="<t>"), tool_payload_bytes=64,
                       result_bytes=64)
    data = pair[Role.SUPERVISOR].send(run_code)
    received = [e for b in data for e in ConnectionPair.feed(pair[Role.JAIL], bytes([b]))]
    assert received == [run_code]
    call = JailCallTool(call_id=1, name="x", args=b"\x80")
    assert pair.send(Role.JAIL, call, CodeFinished(ok=True)) == [call, CodeFinished(ok=True)]


def test_raw_frames_at_the_daemon() -> None:
    """A hand-written conversation: the daemon answers garbage with an Error and closes."""

    async def main() -> None:
        async with asyncio.timeout(guard(60)), fake_daemon() as fake:
            reader, writer = await asyncio.open_unix_connection(sock=fake.raw_connection())
            writer.write(frame(Hello(protocol=PROTOCOL_VERSION, client="raw")))
            writer.write(b"\x00\x00\x00\x02\xc1\xc1")  # a frame of bytes msgpack never uses
            answer = frames(await reader.read(), "daemon->client")
            writer.close()
            welcome, error = answer
            assert isinstance(welcome, Welcome) and isinstance(error, Error)
            assert error.code == "bad_frame" and "msgpack" in error.message

    asyncio.run(main())


# ----------------------------------------------------------------------------- the launcher


def test_a_jailed_job_drives_the_fake_launcher_as_a_jail() -> None:
    """Below the daemon: a JailedJob and its machine, with the fake launcher's jail."""
    policy = load_policies(None)["default"]
    calls: list[tuple[str, Any]] = []

    def route(job_id: str, call_id: int, name: str, args: bytes, approval: bool) -> Any:
        calls.append((name, unpack(args)))
        reply = CallReply()
        reply.resolve(True, pack(40))  # answered before the job listens: it still gets it
        return reply

    async def main() -> None:
        env = fake_environment({"default": policy})
        spec = JobSpec("job-1", policy, policy.limits, JobDescription(
            code="await tools.add(x=2) + 2", filename="<t>", tools=(ToolSpec(name="add"),)))
        output: list[tuple[str, bytes]] = []
        job = JailedJob(spec, env, route, lambda _, stream, data: output.append((stream, data)))
        async with asyncio.timeout(guard(60)):
            record = await job.run()
        assert record.status == "ok", record.error
        assert job.result is not None and unpack(job.result) == 42
        assert calls == [("add", [[], {"x": 2}])] and output == []  # (args, kwargs)
        env.audit.close()

    asyncio.run(main())


def test_an_exception_in_the_block_is_not_wrapped() -> None:
    async def main() -> None:
        async with daemon_pair():
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        asyncio.run(main())


# ----------------------------------------------------------------------------- jobs


def test_a_jobs_record() -> None:
    async def test(client: AsyncClient) -> None:
        r = await client.run("print('hello'); import os; os.getcwd(), 6 * 7")
        assert r.status == "ok", r.error
        cwd, answer = r.result
        assert answer == 42 and r.stdout == "hello\n" and r.error is None
        assert os.path.basename(cwd).startswith("jaild-testing-job-")
        assert not os.path.exists(cwd)  # the fake jail's directory went with it
        assert r.policy == "default" and r.limits["wall_time_s"] == 20
        assert r.record.usage.output_bytes == len("hello\n")

        failed = await client.run("raise ValueError('no')")
        assert failed.status == "error" and failed.error is not None
        assert failed.error["type"] == "ValueError" and failed.error["message"] == "no"

    run(test)


def test_a_network_attempt_without_a_network_is_refused_and_counted() -> None:
    """The whole path without root: the Harden frame tells the runtime the policy has no
    network, its audit hook refuses the attempt in words, the job goes on, and the count
    reaches the record. (No seccomp filter here: tests/integration/test_network_refusal.py
    and tests/hostile have the jail's. A policy with a network refuses nothing.)"""
    code = ("import urllib.request\ntry:\n    urllib.request.urlopen('http://example.com/')\n"
            "except OSError as e:\n    caught = str(e)\n{'caught': caught, 'work': 6 * 7}")

    async def test(client: AsyncClient) -> None:
        r = await client.run(code)
        assert r.status == "ok", r.error
        assert r.result["work"] == 42
        caught = r.result["caught"]
        assert "network access refused in this jail (getaddrinfo('example.com', 80))" in caught
        assert "policy 'default' has no network" in caught
        assert r.network_refused == 1 and r.record.network_refused == 1
        looped = await client.run("import socket\nsocket.socket(socket.AF_INET).close()\n1",
                                  policy="looped")
        assert looped.status == "ok", looped.error  # loopback: the hook is not installed
        assert looped.network_refused == 0

    run(test, {"default": POLICY, "looped": '[network]\nmode = "loopback"\n'})


def test_a_tool_call_is_routed_to_its_host_handler() -> None:
    seen: list[tuple[str, int]] = []

    def lookup(name: str, count: int = 1) -> dict[str, Any]:
        seen.append((name, count))
        return {"name": name.upper(), "count": count}

    async def test(client: AsyncClient) -> None:
        r = await client.run("await tools.lookup(name='ada', count=2)", tools={"lookup": lookup})
        assert r.status == "ok", r.error
        assert r.result == {"name": "ADA", "count": 2} and seen == [("ada", 2)]
        assert [(c["name"], c["ok"]) for c in r.tool_calls] == [("lookup", True)]

    run(test)


def test_a_tool_call_that_breaks_its_schema_never_reaches_the_handler() -> None:
    seen: list[int] = []

    def double(x: int) -> int:
        seen.append(x)
        return 2 * x

    code = (
        "try:\n"
        "    await tools.double(x='seven')\n"
        "except ToolError as exc:\n"
        "    refused = str(exc)\n"
        "refused, await tools.double(x=7)\n"  # the positive control, in the same job
    )

    async def test(client: AsyncClient) -> None:
        r = await client.run(code, tools={"double": double})
        assert r.status == "ok", r.error
        refused, doubled = r.result
        assert doubled == 14 and seen == [7]
        assert "argument 'x'" in refused and "integer" in refused
        first, second = r.tool_calls
        assert (first["ok"], first["error_type"]) == (False, "invalid_arguments")
        assert second["ok"] is True

    run(test)


def test_a_tool_needing_approval_is_denied_without_an_approver() -> None:
    async def test(client: AsyncClient) -> None:
        code = "try:\n    await tools.transfer(n=1)\nexcept ToolError as e:\n    r = repr(e)\nr"
        r = await client.run(code, tools={"transfer": lambda n: n})
        assert r.status == "ok", r.error
        assert "denied" in r.result.lower()
        approved = await client.run(
            "await tools.transfer(n=3)", tools={"transfer": lambda n: n},
            approve=lambda name, args, kwargs: True,
        )
        assert approved.status == "ok" and approved.result == 3

    run(test)


def test_the_tool_call_quota_and_timeout() -> None:
    async def slow(seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    code = (
        "out = []\n"
        "for s in (0, 600, 0):\n"
        "    try:\n"
        "        out.append(await tools.slow(seconds=s))\n"
        "    except ToolError as exc:\n"
        "        out.append(str(exc))\n"
        "out\n"
    )

    async def test(client: AsyncClient) -> None:
        limits = {"tool_calls": 2, "tool_call_timeout_s": 2}
        r = await client.run(code, tools={"slow": slow}, limits=limits)
        assert r.status == "ok", r.error
        done, timed_out, over_quota = r.result
        assert done == 0 and "timeout" in timed_out and "quota" in over_quota
        assert [c.get("error_type") for c in r.tool_calls] == [None, "timeout", "quota_exceeded"]

    run(test)


def test_the_wall_clock_limit_kills_the_job() -> None:
    async def test(client: AsyncClient) -> None:
        r = await client.run("import time\nprint('started')\ntime.sleep(600)", timeout=2)
        assert r.status == "timeout" and r.error is not None
        assert r.error["limit"] == "wall_time_s" and r.stdout == "started\n"

    run(test)


def test_the_output_limit_stops_the_job() -> None:
    async def test(client: AsyncClient) -> None:
        r = await client.run("while True:\n    print('x' * 1000)", limits={"output_bytes": 10_000})
        assert r.status == "output_limit"
        assert len(r.stdout) == 10_000

    run(test)


def test_a_cancelled_job_ends_cancelled() -> None:
    async def test(client: AsyncClient) -> None:
        started = asyncio.Event()
        job = await client.submit(
            "import time\nprint('go')\ntime.sleep(600)", on_stdout=lambda _: started.set()
        )
        await started.wait()
        await job.cancel()
        r = await job.result()
        assert r.status == "cancelled" and r.stdout == "go\n"

    run(test)


def test_files_go_in_and_come_back() -> None:
    async def test(client: AsyncClient) -> None:
        code = "open('out.txt', 'w').write(open('in.txt').read().upper())"
        r = await client.run(code, files={"in.txt": b"abc"}, download=["out.txt"])
        assert r.status == "ok", r.error
        assert r.downloads == {"out.txt": b"ABC"}
        assert [f["path"] for f in r.files] == ["out.txt"]  # what the run created

    run(test)


def test_a_jail_that_cannot_start_is_an_internal_error() -> None:
    async def main() -> None:
        launcher = FakeLauncher(python="/nonexistent/python3")
        async with asyncio.timeout(guard(60)), fake_daemon(launcher=launcher) as fake:
            client = await fake.connect()
            r = await client.run("1")
            assert r.status == "internal_error" and r.error is not None
            assert r.error["type"] == "JailStartFailed"
            assert "/nonexistent/python3" in r.error["message"]

    asyncio.run(main())


def test_a_session_keeps_its_namespace_between_runs() -> None:
    async def test(client: AsyncClient) -> None:
        async with client.session() as session:
            first = await session.run("x = 20\nimport os\nos.getpid()")
            second = await session.run("x + 22, os.getpid()")
            assert first.status == second.status == "ok"
            assert second.result == [42, first.result]  # the same process: the same jail
            assert second.session is not None and second.session["run"] == 2
            assert [j["kind"] for j in await client.jobs()] == ["session"]
        assert await client.jobs() == []

    run(test)


# ----------------------------------------------------------------------------- refusals


def test_admission_refuses_an_unknown_policy_and_looser_limits() -> None:
    async def test(client: AsyncClient) -> None:
        with pytest.raises(UnknownPolicy, match="nope"):
            await client.run("1", policy="nope")
        with pytest.raises(BadRequest, match="wall_time_s=999 is looser"):
            await client.run("1", timeout=999)
        assert (await client.run("1", timeout=5)).result == 1  # the positive control

    run(test)


def test_admission_refuses_a_policy_the_peer_may_not_use() -> None:
    policies = {"default": "", "closed": "[access]\nusers = []\n"}

    async def test(client: AsyncClient) -> None:
        with pytest.raises(PermissionDenied):
            await client.run("1", policy="closed")
        assert [p["name"] for p in await client.policies()] == ["default"]
        assert (await client.run("1")).status == "ok"

    run(test, policies)


def test_the_connection_limit_refuses_a_second_client() -> None:
    async def main() -> None:
        config = DaemonConfig(max_connections=1, probe_policies=False)
        async with asyncio.timeout(guard(60)), fake_daemon(config=config) as fake:
            first = await fake.connect()
            with pytest.raises(Busy, match="1 connections open, the daemon's limit"):
                await fake.connect()
            assert (await first.run("1")).status == "ok"
            stats = await first.stats()
            assert stats["running"]["connections"] == 1

    asyncio.run(main())


# ----------------------------------------------------------------------------- the rest


def test_the_fake_jail_reports_no_hardening() -> None:
    """The fake daemon accepts exactly the fake's digest: a jail that loaded a real
    filter (or claims another) would be refused as it is by a real daemon."""

    async def main() -> None:
        async with asyncio.timeout(guard(60)), fake_daemon() as fake:
            env = fake.daemon.env
            assert env is not None and env.seccomp_digests == {"default": frozenset({UNHARDENED})}
            env.seccomp_digests["default"] = frozenset({"something else"})
            client = await fake.connect()
            r = await client.run("1")
            assert r.status == "internal_error" and r.error is not None
            assert "seccomp filter" in r.error["message"]

    asyncio.run(main())


def test_the_blocking_client_against_a_daemon_thread() -> None:
    with daemon_thread() as d, Client(d.socket_path) as client:
        assert client.run("6 * 7").result == 42  # within the policy's own 30 s: a job may
        # not ask for more (a guard-scaled timeout, 300 s under TCG, was refused as looser)
        assert os.path.exists(d.socket_path)
    assert not os.path.exists(d.socket_path)


def test_the_docs_example_works() -> None:
    page = Path(__file__).resolve().parents[2] / "docs/using/client.md"
    text = page.read_text(encoding="utf-8")
    section = text.split("## Testing against jaild without root\n", 1)[1].split("\n## ", 1)[0]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "daemon_pair" in example
    exec(compile(example, "docs/using/client.md", "exec"), {"__name__": "docs_example"})


NOBODY = 65534
PROBE = """
import asyncio, os
from jaild.testing import daemon_pair

async def main():
    async with daemon_pair() as client:
        r = await client.run("import os; os.geteuid()", tools={"one": lambda: 1})
        print(r.status, r.result, os.geteuid())

asyncio.run(main())
"""


def _unprivileged(argv: list[str]) -> tuple[list[str], int]:
    """``argv`` without privilege, and the uid it runs as. As root: as nobody with no
    capability -- or, where nobody cannot even read this interpreter and checkout (a
    0700 home, as on the real-host guests), as uid 0 with no capability left at all
    (no namespaces, no mounts, no cgroup moves, no nsjail)."""
    if os.geteuid() != 0:
        return argv, os.geteuid()
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "setpriv (util-linux) is missing"
    no_caps = [setpriv, "--inh-caps=-all", "--bounding-set=-all"]
    as_nobody = [*no_caps, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    readable = subprocess.run(
        [*as_nobody, sys.executable, "-B", "-c", "import jaild.testing"],
        capture_output=True, cwd="/", env=_probe_env(), timeout=guard(60),
    )
    if readable.returncode == 0:
        return [*as_nobody, *argv], NOBODY
    return [*no_caps, *argv], 0


def _probe_env() -> dict[str, str]:
    return {**os.environ, "HOME": "/", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def test_no_root_is_needed() -> None:
    """The whole pair, jail included, without root's privileges (see _unprivileged)."""
    argv, uid = _unprivileged([sys.executable, "-B", "-c", PROBE])
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=guard(60), cwd="/", env=_probe_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(uid), str(uid)]
    if os.geteuid() == 0:  # the drop is real: the same prefix leaves no capability in effect
        control = subprocess.run(
            [*argv[: argv.index(sys.executable)], "/bin/sh", "-c", "grep ^CapEff /proc/self/status"],
            capture_output=True, text=True, timeout=guard(60),
        )
        assert control.stdout.split() == ["CapEff:", "0000000000000000"], control


def test_the_fake_daemon_is_composed_of_public_parts() -> None:
    """jaild.testing builds its daemon through the constructor's public seams (served,
    tracing, reap_orphans) and sets no private attribute of another object: what the fake
    daemon is made of is what anyone may use. Control: such an assignment is found."""
    import ast

    def private_sets(source: str) -> list[str]:
        return [
            f"{ast.unparse(t)}:{t.lineno}"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and t.attr.startswith("_")
            and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
        ]

    source = (Path(__file__).resolve().parents[2] / "jaild" / "testing.py").read_text()
    assert private_sets(source) == []
    assert private_sets("daemon.served = x\ndaemon._pipeline = y\n") == ["daemon._pipeline:2"]


def test_testing_imports_nothing_private_of_the_package() -> None:
    """jaild.testing uses jaild's public names only (it once subclassed the client's private
    link and transport). Control: a private name is found."""
    import ast

    def private_imports(source: str) -> list[str]:
        return [
            f"{node.module}.{alias.name}"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaild")
            for alias in node.names if alias.name.startswith("_")
        ]

    source = (Path(__file__).resolve().parents[2] / "jaild" / "testing.py").read_text()
    assert private_imports(source) == []
    assert private_imports("from jaild.client import AsyncClient, _Link\n") == ["jaild.client._Link"]
