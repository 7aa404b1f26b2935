"""The client library as another uid runs it, for the fairness measurement.

The checkout (and its venv) may live under a 0700 home directory that no other uid can
reach, so the modules the client imports -- the checkout's own and the venv's (msgpack) --
are copied, exactly those, into a world-readable directory, and run by the base
interpreter the venv was made from, isolated (``-I -S -B``), as ``uid``:``gid`` with no
supplementary groups. This is what ``tests/conftest.py``'s ``ForeignClient`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

from measure import BenchError, Latency

from jaild.testing import copy_modules

MODULES = ("jaild.client", "jaild.errors")
LATENCY = """\
import asyncio, json, sys, time
from jaild.client import AsyncClient

async def main(socket, policy, runs, warmup, pause_s):
    samples = []
    async with AsyncClient(socket) as c:
        for i in range(warmup + runs):
            await asyncio.sleep(pause_s)
            started = time.perf_counter()
            r = await c.run("result = 1 + 1\\nresult", policy)
            took = time.perf_counter() - started
            if r.status != "ok" or r.result != 2:
                return {"error": f"job {r.status}, result {r.result!r}: {r.error}"}
            if i >= warmup:
                samples.append(took)
    return {"samples": samples}

socket, policy, runs, warmup, pause_s = sys.argv[1:]
print(json.dumps(asyncio.run(main(socket, policy, int(runs), int(warmup), float(pause_s)))))
"""


class ForeignClient:
    """A world-readable copy of the client library in a temporary directory (a context
    manager: removed on exit), runnable as any uid."""

    def __init__(self) -> None:
        self.python = getattr(sys, "_base_executable", "") or os.path.realpath(sys.executable)
        self.path = Path(tempfile.mkdtemp(prefix="jaild-bench-client-", dir="/tmp"))

    def __enter__(self) -> ForeignClient:
        try:
            self._copy()
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def _copy(self) -> None:
        copy_modules(self.path, MODULES)

    def latency(self, socket: str, policy: str, runs: int, pause_s: float, *, uid: int,
                warmup: int = 2, timeout_s: float = 600) -> Latency:
        """``runs`` sequential trivial jobs (after ``warmup`` untimed ones), ``pause_s``
        (untimed) before each, call to result, by an ``AsyncClient`` running as ``uid``."""
        prelude = f"import sys\nsys.path.insert(0, {str(self.path)!r})\n"
        out = subprocess.run(
            [self.python, "-I", "-S", "-B", "-c", prelude + LATENCY,
             socket, policy, str(runs), str(warmup), str(pause_s)],
            capture_output=True, text=True, timeout=timeout_s, check=False,
            user=uid, group=uid, extra_groups=[], cwd=self.path,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        if out.returncode != 0:
            raise BenchError(f"uid {uid}'s client exited {out.returncode}: {out.stderr[-800:]}")
        answer = json.loads(out.stdout)
        if "error" in answer:
            raise BenchError(f"uid {uid}'s job failed: {answer['error']}")
        return Latency([float(s) for s in answer["samples"]])
