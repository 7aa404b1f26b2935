"""The ``jaild`` command line, run as a real subprocess against real daemons."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jaild.daemon.config import DaemonConfig
from tests.conftest import REPO, DaemonHandle, _descendants, guard, proc_stat, until

pytestmark = pytest.mark.integration


def jaild(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "JAILD_SOCKET"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "jaild", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=full_env,
                          check=False)


TOOLS_FILE = '''
import asyncio
from os import getcwd  # imported, not defined here: not a tool

def add(a: int, b: int = 1) -> int:
    """Add two numbers."""
    return a + b

async def shout(text: str) -> str:
    """Upper-case some text."""
    await asyncio.sleep(0)
    return text.upper()

def _private() -> None:
    raise AssertionError("private helpers are not tools")
'''


def test_run_json_prints_exactly_the_record(daemon: DaemonHandle) -> None:
    out = jaild("run", "--socket", daemon.socket, "--json", "-c", "print('hi')\n40 + 2")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)  # the whole of stdout is one JSON object
    assert set(record) >= {"job_id", "status", "result", "stdout", "stderr", "error",
                           "tool_calls", "duration_s", "limits"}
    assert (record["status"], record["result"], record["stdout"]) == ("ok", 42, "hi\n")


def test_run_passes_labels_on(daemon: DaemonHandle) -> None:
    """``--label``: the job holds it from its first line (its record says so); without it,
    the same job holds none (the control)."""
    given = json.loads(jaild("run", "--socket", daemon.socket, "--json", "--label", "untrusted",
                             "--label", "user:alice", "-c", "1").stdout)
    assert given["status"] == "ok" and given["flow"]["labels"] == ["untrusted", "user:alice"]
    plain = json.loads(jaild("run", "--socket", daemon.socket, "--json", "-c", "1").stdout)
    assert plain["status"] == "ok" and plain.get("flow") is None
    bad = jaild("run", "--socket", daemon.socket, "--json", "--label", "Not A Label", "-c", "1")
    assert bad.returncode != 0 and "labels" in bad.stderr, (bad.returncode, bad.stderr)


@pytest.mark.parametrize(
    ("code", "status", "exit_code"),
    [("1/0", "error", 1), ("import time\ntime.sleep(9)", "timeout", 3),
     ("import ctypes\nctypes.string_at(0)", "killed", 6)],
)
def test_exit_status_follows_the_job_status(daemon: DaemonHandle, code: str, status: str,
                                            exit_code: int) -> None:
    out = jaild("run", "--socket", daemon.socket, "--json", "--timeout", "1", "-c", code)
    assert json.loads(out.stdout)["status"] == status
    assert out.returncode == exit_code


def test_run_streams_output_as_it_is_produced(daemon: DaemonHandle, tmp_path: Path) -> None:
    # The job prints 'first', then waits (in a tool of the CLI's) until the test has read
    # that line from the CLI's stdout: it can only go on if its output was streamed.
    marker = tmp_path / "first-seen"
    tools = tmp_path / "gate.py"
    tools.write_text(
        "import os, time\n\n"
        "def first_seen() -> bool:\n"
        f"    deadline = time.monotonic() + 60\n"
        f"    while not os.path.exists({str(marker)!r}):\n"
        "        if time.monotonic() > deadline:\n"
        "            return False\n"
        "        time.sleep(0.01)\n"
        "    return True\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaild", "run", "--socket", daemon.socket, "--tools", str(tools),
         "-c", "print('first', flush=True)\nprint('second' if await tools.first_seen() else 'no')"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    marker.touch()
    rest, err = proc.communicate(timeout=guard(120))
    assert first == "first\n"
    assert rest == "second\n", (rest, err)  # 'first' arrived while the job still ran
    assert proc.returncode == 0, err


def test_run_with_tools_from_a_file(daemon: DaemonHandle, tmp_path: Path) -> None:
    tools = tmp_path / "mytools.py"
    tools.write_text(TOOLS_FILE)
    code = (
        "print(sorted(tools))\n"
        "import asyncio\n"
        "await asyncio.gather(tools.add(2, b=3), tools.shout('hey'))"
    )
    out = jaild("run", "--socket", daemon.socket, "--tools", str(tools), "--json", "-c", code)
    record = json.loads(out.stdout)
    assert record["status"] == "ok", record
    assert record["stdout"] == "['add', 'shout']\n"
    assert record["result"] == [5, "HEY"]
    schema = jaild("run", "--socket", daemon.socket, "--tools", str(tools), "--json", "-c",
                   "tools.add.parameters, tools.add.description")
    params, description = json.loads(schema.stdout)["result"]
    assert description == "Add two numbers."
    assert params == {"type": "object", "additionalProperties": False, "required": ["a"],
                      "properties": {"a": {"type": "integer"},
                                     "b": {"type": "integer", "default": 1}}}
    # the --tools naming rule, as jaild mcp and jaild codemode name them
    # (jaild.providers.module_sources): GROUP=FILE.py under tools.GROUP; several modules
    # without a group each under its file's stem
    other = tmp_path / "more.py"
    other.write_text("def twice(x: int) -> int:\n    return 2 * x\n")
    grouped = jaild("run", "--socket", daemon.socket, "--tools", f"maths={tools}", "--json",
                    "-c", "await tools.maths.add(1, b=2)")
    assert json.loads(grouped.stdout)["result"] == 3
    both = jaild("run", "--socket", daemon.socket, "--tools", str(tools), "--tools", str(other),
                 "--json", "-c", "[await tools.mytools.add(1), await tools.more.twice(4)]")
    assert json.loads(both.stdout)["result"] == [2, 8]


def test_run_from_file_and_stdin(daemon: DaemonHandle, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("def main():\n    return 'from file'\n")
    assert json.loads(jaild("run", "--socket", daemon.socket, "--json", str(script)).stdout)[
        "result"] == "from file"
    out = jaild("run", "--socket", daemon.socket, "--json", "-", stdin="'from stdin'")
    assert json.loads(out.stdout)["result"] == "from stdin"


def test_human_output_shows_the_result_and_errors(daemon: DaemonHandle) -> None:
    ok = jaild("run", "--socket", daemon.socket, "-c", "print('line')\n{'k': 1}")
    assert ok.stdout == "line\n{'k': 1}\n"
    bad = jaild("run", "--socket", daemon.socket, "-c", "raise KeyError('missing')")
    assert bad.returncode == 1
    assert "KeyError: 'missing'" in bad.stderr
    assert ": error: 'missing'" in bad.stderr


def test_private_daemon_when_nothing_listens_at_the_default_socket() -> None:
    assert not os.path.exists("/run/jaild/jaild.sock"), "a system daemon runs here; test needs none"
    out = jaild("run", "--json", "-c", "'private'", env={})
    assert out.returncode == 0, out.stderr
    assert "running this job in a private daemon" in out.stderr
    assert json.loads(out.stdout)["result"] == "private"


def busy_metrics_config(directory: Path, busy: socket.socket) -> str:
    """A config file whose metrics_address is the port ``busy`` listens on."""
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    path = directory / "jaild.toml"
    path.write_text(
        f'[daemon]\npolicies_dir = "{REPO / "policies"}"\n'
        f'metrics_address = "127.0.0.1:{busy.getsockname()[1]}"\n'
    )
    # positive control: the file is read and names the busy port (a daemon of its own,
    # jaild serve, refuses to start on it: tests/integration/test_metrics.py)
    port = busy.getsockname()[1]
    assert DaemonConfig.from_sources(str(path)).metrics_address == f"127.0.0.1:{port}"
    return str(path)


def test_a_private_daemon_serves_no_metrics_whatever_the_config_says(tmp_path: Path) -> None:
    """metrics_address names the system daemon's port: a private daemon neither takes it
    nor is refused for it (here something else holds it)."""
    assert not os.path.exists("/run/jaild/jaild.sock"), "a system daemon runs here; test needs none"
    with socket.socket() as busy:
        config = busy_metrics_config(tmp_path, busy)
        out = jaild("run", "--json", "-c", "'private'", env={"JAILD_CONFIG": config})
    assert out.returncode == 0, out.stderr
    assert "running this job in a private daemon" in out.stderr
    assert json.loads(out.stdout)["result"] == "private"


ONE_SHOT = {"run": ("-c", "1"), "session": ()}
"""The commands that start a private daemon when none runs, and what they need to run 1."""
WHAT = {"run": "job", "session": "session"}


@pytest.mark.parametrize("command", ONE_SHOT)
def test_a_private_daemon_that_cannot_start_means_no_daemon(tmp_path: Path, command: str) -> None:
    assert not os.path.exists("/run/jaild/jaild.sock"), "a system daemon runs here; test needs none"
    empty = tmp_path / "policies"
    empty.mkdir()
    out = jaild(command, "--policies", str(empty), *ONE_SHOT[command], stdin="1\n", env={})
    assert out.returncode == 69, out.stderr
    assert f"running this {WHAT[command]} in a private daemon" in out.stderr
    assert "no jaild daemon at /run/jaild/jaild.sock, and a private one could not start: " in (
        out.stderr)


@pytest.mark.parametrize("command", ONE_SHOT)
def test_a_named_socket_that_does_not_answer_is_an_error(tmp_path: Path, command: str) -> None:
    missing = str(tmp_path / "nobody.sock")
    out = jaild(command, "--socket", missing, *ONE_SHOT[command], stdin="1\n")
    assert out.returncode == 69
    assert f"no jaild daemon at {missing}" in out.stderr
    assert "private daemon" not in out.stderr
    out = jaild(command, *ONE_SHOT[command], stdin="1\n", env={"JAILD_SOCKET": missing})
    assert out.returncode == 69
    assert f"no jaild daemon at {missing}" in out.stderr


def listening_socket(pid: int) -> str:
    """The path of the Unix socket process ``pid`` listens on: its private daemon's."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    # Num RefCount Protocol Flags Type St Inode Path; flag 0x10000: listening
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[6] in inodes and int(fields[3], 16) & 0x10000:
            return fields[7]
    raise AssertionError(f"process {pid} listens on no Unix socket")


def alive(pid: int, started: str) -> bool:
    """Is the process ``pid`` that started at ``started`` (clock ticks after boot) still
    running (not a zombie, and not a new process under a reused pid)?"""
    try:
        stat = proc_stat(pid)
    except (OSError, IndexError):
        return False
    return stat[19] == started and stat[0] not in ("Z", "X")


def test_session_without_a_daemon_runs_in_a_private_one_that_ends_with_it() -> None:
    """As jaild run: no socket named, nothing at the default path -> a private daemon for
    this command. While the REPL runs, the private daemon's jails and cgroups are there
    (the control); once stdin has ended and the REPL exited, none of them is left."""
    assert not os.path.exists("/run/jaild/jaild.sock"), "a system daemon runs here; test needs none"
    with subprocess.Popen(
        [sys.executable, "-m", "jaild", "session"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if k != "JAILD_SOCKET"},
    ) as proc:
        hang = threading.Timer(guard(120), proc.kill)  # a liveness guard on the reads below
        hang.start()
        try:
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            proc.stdin.write("x = 6\ndef f(y):\n    return x * y\n\nprint(f(7), flush=True)\n")
            proc.stdin.flush()
            first = proc.stdout.readline()  # the session has run its first statements
            notes = [proc.stderr.readline()]
            while notes[-1] and not notes[-1].startswith("jaild: session "):  # "": it exited
                notes.append(proc.stderr.readline())
            assert first == "42\n", (first, notes, proc.stderr.read())
            assert ("jaild: no daemon at /run/jaild/jaild.sock; running this session in a private "
                    "daemon\n") in notes, notes
            session_id = notes[-1].split()[2]  # "jaild: session ses-... (policy default); ..."
            assert session_id.startswith("ses-"), notes

            # the control: the private daemon runs the session's jail as the CLI's descendant,
            # in a cgroup of the private daemon's subtree
            private = DaemonHandle(listening_socket(proc.pid), str(REPO / "policies"),
                                   proc, "")  # type: ignore[arg-type]
            assert "jaild-private-" in private.socket
            processes = {pid: proc_stat(pid)[19] for pid in _descendants(proc.pid)}
            jailed = private.job_pids(session_id)
            assert jailed and set(jailed) <= set(processes), (jailed, processes)
            assert private.cgroup_dir(session_id).is_dir()
            assert any(os.path.isdir(d) for d in private.subtree_dirs)

            proc.stdin.write("print(f(2))\nimport os\nos.getpid() == 1\n")
            proc.stdin.close()  # the end of the REPL's input
            rest, err = proc.stdout.read(), proc.stderr.read()
            proc.wait(guard(60))
        finally:
            hang.cancel()
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert rest == "12\nTrue\n", (rest, err)  # the same session: f and x are still defined
    until(lambda: not any(alive(pid, started) for pid, started in processes.items()),
          "the private daemon's processes ending", timeout=10)
    until(lambda: not any(os.path.exists(d) for d in private.subtree_dirs),
          "the private daemon's cgroups going", timeout=10)
    assert not os.path.exists(os.path.dirname(private.socket))  # its private directory too


def test_refused_job_exit_code(daemon: DaemonHandle) -> None:
    out = jaild("run", "--socket", daemon.socket, "--policy", "nope", "-c", "1")
    assert out.returncode == 65
    assert "unknown_policy" in out.stderr


def test_policies_command(daemon: DaemonHandle) -> None:
    out = jaild("policies", "--socket", daemon.socket)
    assert out.returncode == 0
    assert "default" in out.stdout and "strict" in out.stdout
    as_json = json.loads(jaild("policies", "--socket", daemon.socket, "--json").stdout)
    assert {"default", "strict"} <= {p["name"] for p in as_json}


def test_policy_check(tmp_path: Path) -> None:
    good = jaild("policy", "check", str(REPO / "policies" / "default.toml"),
                 str(REPO / "policies" / "strict.toml"))
    assert good.returncode == 0, good.stderr
    assert good.stdout.count(": ok") == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[seccomp]\nallow = ["ptrace"]\n')
    out = jaild("policy", "check", str(bad))
    assert out.returncode == 1
    assert f"{bad}: seccomp.allow: 'ptrace' can never be allowed" in out.stderr


def test_policy_explain_shows_argv_config_and_filter() -> None:
    out = jaild("policy", "explain", "strict")  # a zygote policy
    assert out.returncode == 0, out.stderr
    assert "# nsjail command line of the policy's zygote" in out.stdout
    assert "keep_caps: true" in out.stdout and "clone_newnet: true" in out.stdout
    request = json.loads(out.stdout.split("# what the zygote is asked for each jail\n")[1]
                         .split("\n")[0])
    # strict's jails detach the zygote's /proc and mount none
    assert "/proc" in request["detach"] and "/proc" not in [m["target"] for m in request["mounts"]]
    assert request["rlimits"]["open_files"] == 64
    assert "action KILL_PROCESS" in out.stdout or "KILL_PROCESS" in out.stdout
