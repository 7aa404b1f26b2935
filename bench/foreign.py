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
import sysconfig
import tempfile
from pathlib import Path
from types import TracebackType

from measure import BenchError, Latency

MODULES = ("jaild.client", "jaild.errors")
_STDLIB_PATHS = {
    sysconfig.get_path(key, vars={"installed_base": sys.base_prefix, "base": sys.base_prefix,
                                  "installed_platbase": sys.base_exec_prefix,
                                  "platbase": sys.base_exec_prefix})
    for key in ("stdlib", "platstdlib")
}
_LIST_MODULES = (
    "import importlib, json, sys\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "print(json.dumps([(n, m.__file__, hasattr(m, '__path__')) for n, m in sys.modules.items()"
    " if getattr(m, '__file__', None)]))\n"
)
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
        listed = subprocess.run([sys.executable, "-c", _LIST_MODULES, *MODULES],
                                capture_output=True, text=True, timeout=60, check=True)
        for name, file, is_package in json.loads(listed.stdout):
            if any(file.startswith(p + os.sep) for p in _STDLIB_PATHS):
                continue
            parts = name.split(".") if is_package else name.split(".")[:-1]
            target = self.path.joinpath(*parts, os.path.basename(file))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, target)
        for root, _dirs, files in os.walk(self.path):
            os.chmod(root, 0o755)
            for name in files:
                os.chmod(os.path.join(root, name), 0o644)

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
