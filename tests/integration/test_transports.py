"""The core of jaild, over each transport: the same checks over the Unix socket and over
mutual TLS, against one real daemon serving both (run, tools, sessions, files, limits,
statuses, and what a client may see of the daemon)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.errors import DaemonUnavailable
from tests.conftest import guard
from tests.network import TlsDaemon, start_tls_daemon
from tests.tls import make_pki, spiffe_id

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsDaemon]:
    directory = tmp_path_factory.mktemp("transports")
    pki = make_pki(directory / "pki")
    d = start_tls_daemon(directory / "daemon", pki)
    yield d
    assert d.stop() == 0, d.handle.log()[-3000:]


@pytest.fixture(params=["unix", "tls"])
def client(request: pytest.FixtureRequest, served: TlsDaemon) -> Iterator[Client]:
    c = Client(served.socket) if request.param == "unix" else served.client()
    with c:
        yield c


def test_a_job_prints_and_returns(client: Client) -> None:
    r = client.run("print('hello'); import sys; print('err', file=sys.stderr); {'a': [1, 2]}")
    assert (r.status, r.result, r.stdout, r.stderr) == ("ok", {"a": [1, 2]}, "hello\n", "err\n")


def test_tool_calls_come_back_to_this_process_each_with_its_own_answer(client: Client) -> None:
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()
    nonce = secrets.token_hex(8)

    def lookup(key: str, n: int = 0) -> dict[str, object]:
        with lock:
            seen.append((key, n))
        return {"key": key, "n": n, "nonce": nonce}

    r = client.run(
        "import asyncio\n"
        "out = await asyncio.gather(*(tools.lookup(f'k{i}', n=i) for i in range(20)))\n"
        "[(o['key'], o['n'], o['nonce']) for o in out]",
        tools=[lookup],
    )
    assert r.status == "ok", r.error
    assert r.result == [[f"k{i}", i, nonce] for i in range(20)]
    assert sorted(seen) == sorted((f"k{i}", i) for i in range(20))
    assert len(r.tool_calls) == 20


def test_a_failing_tool_raises_in_the_jail(client: Client) -> None:
    def broken() -> None:
        raise KeyError("no such thing")

    r = client.run(
        "try:\n    await tools.broken()\nexcept Exception as e:\n    r = (type(e).__name__, str(e))\nr",
        tools=[broken],
    )
    assert r.status == "ok", r.error
    assert r.result[0] == "ToolError" and "no such thing" in r.result[1]


def test_a_session_keeps_its_state_and_its_files(client: Client) -> None:
    with client.session() as s:
        assert s.run("x = 40; open('f.txt', 'w').write('kept'); None").status == "ok"
        r = s.run("x + 2, open('f.txt').read()")
        assert r.result == [42, "kept"]
        assert s.download("f.txt") == {"f.txt": b"kept"}


def test_files_go_in_and_come_back(client: Client, tmp_path: Path) -> None:
    r = client.run(
        "data = open('in.bin', 'rb').read()\n"
        "open('out.bin', 'wb').write(data[::-1])\n"
        "len(data)",
        files={"in.bin": bytes(range(256))}, download=["out.bin"],
    )
    assert r.status == "ok", r.error
    assert r.result == 256
    assert r.downloads == {"out.bin": bytes(range(256))[::-1]}


@pytest.mark.parametrize(
    ("code", "limits", "status", "error_type"),
    [
        ("1 / 0", {}, "error", "ZeroDivisionError"),
        ("import time\ntime.sleep(30)", {"wall_time_s": 1}, "timeout", None),
        ("x = bytearray(1 << 30)", {"memory_mb": 64}, "memory_limit", None),
        ("syntax error here", {}, "error", "SyntaxError"),
    ],
    ids=["raises", "wall-time", "memory", "syntax"],
)
def test_each_status_is_the_same(client: Client, code: str, limits: dict[str, float],
                                 status: str, error_type: str | None) -> None:
    r = client.run(code, limits=limits)
    assert r.status == status, r.error
    if error_type is not None:
        assert r.error is not None and r.error["type"] == error_type


def test_a_cancelled_job_is_cancelled(client: Client) -> None:
    job = client.submit("import time\ntime.sleep(30)")
    job.cancel()
    assert job.result().status == "cancelled"


def test_the_client_sees_its_own_jobs_and_the_policies(client: Client) -> None:
    job = client.submit("import time\ntime.sleep(30)")
    try:
        assert job.job_id in {j["id"] for j in client.jobs()}
        assert "default" in {p["name"] for p in client.policies()}
        assert client.stats()["running"]["jobs"] >= 1
    finally:
        job.cancel()
        job.result()


# ------------------------------------------------------------------ the front ends over TLS


def test_the_cli_runs_a_job_over_tls(served: TlsDaemon) -> None:
    pki = served.pki
    argv = [sys.executable, "-m", "jaild", "run", "--socket", served.address, "--json",
            "-c", "print(6 * 7)"]
    tls = ["--tls-cert", pki.client.cert, "--tls-key", pki.client.key, "--tls-ca", pki.ca.cert]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAILD_TLS_")}
    out = subprocess.run([*argv, *tls], capture_output=True, text=True, env=env,
                         timeout=guard(60), check=False)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert (record["status"], record["stdout"]) == ("ok", "42\n")
    # the control: no certificate, no job -- and a message saying what is missing
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=guard(60),
                         check=False)
    assert out.returncode == 69 and "--tls-cert" in out.stderr, out.stderr
    # jaild ps over TLS: the network client's job, no uid, its principal as the owner
    with served.client() as c:
        job = c.submit("import time\ntime.sleep(30)")
        try:
            out = subprocess.run(
                [sys.executable, "-m", "jaild", "ps", "--socket", served.address, *tls],
                capture_output=True, text=True, env=env, timeout=guard(60), check=False)
        finally:
            job.cancel()
            job.result()
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith(job.job_id)]
    assert row.split()[3] == "-" and row.endswith(spiffe_id("alice")), row


def test_the_library_says_what_is_missing_without_a_certificate(served: TlsDaemon) -> None:
    with pytest.raises(DaemonUnavailable, match="cert= and key="):
        Client(served.address, ca=served.pki.ca.cert)


def test_jaild_mcp_runs_code_over_tls(served: TlsDaemon, tmp_path: Path) -> None:
    from tests.integration.test_mcp import _drive, _jaild_mcp, _run, _text

    pki = served.pki
    env = {**os.environ, "JAILD_TLS_CERT": pki.client.cert, "JAILD_TLS_KEY": pki.client.key,
           "JAILD_TLS_CA": pki.ca.cert}

    async def body(session: object) -> str:
        return _text(await _run(session, "print(6 * 7)"))

    text = _drive(_jaild_mcp(served.address), tmp_path / "log", body, env=env)
    assert "42" in text
