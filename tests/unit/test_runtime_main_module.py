"""The job's namespace is the ``__main__`` module's (jaild.runtime.execute.main_namespace),
and a session's snapshot keeps it so (jaild.runtime.snapshot). Each check runs in a fresh
interpreter: making a ``__main__`` replaces the one of the process it runs in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jaild.daemon.config import default_state_dir

REPO = Path(__file__).resolve().parent.parent.parent
JAIL_PYTHON = os.path.join(default_state_dir(), "envs", "default", "bin", "python3")

RUN_AS_MAIN = r"""
import pickle, sys
from jaild.protocol import unpack
from jaild.runtime import execute
old_main = sys.modules["__main__"]
ns = execute.main_namespace({"__builtins__": __builtins__, "tools": "tools"})
assert sys.modules["__main__"].__dict__ is ns and sys.modules["__main__"] is not old_main
assert "old_name" not in ns  # nothing of the process's own __main__
out = execute.run(
    "class K:\n    def __init__(self, v):\n        self.v = v\n"
    "def f(x):\n    return x + 1\n"
    "ran = []\n"
    "if __name__ == '__main__':\n    ran.append(1)\n"
    "import pickle\n"
    "[pickle.loads(pickle.dumps(K(3))).v, pickle.loads(pickle.dumps(f))(1), ran, tools]\n",
    "<job>", ns, 1 << 16)
assert out.ok, out.error
assert unpack(out.result) == [3, 2, [1], "tools"], unpack(out.result)
print("ok")
"""


def _run(python: str, code: str, cwd: Path) -> None:
    out = subprocess.run([python, "-I", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                          f"old_name = 1\n{code}"], capture_output=True, text=True, timeout=60,
                         check=False, cwd=cwd)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_job_runs_as_the_main_module_so_what_it_defines_pickles(tmp_path: Path) -> None:
    _run(sys.executable, RUN_AS_MAIN, tmp_path)


ROUND_TRIP = r"""
import pickle, sys, tempfile
from jaild.runtime import execute, files, snapshot
limits = files.FileLimits(max_files=16, max_bytes=1 << 20, max_depth=4, max_name_chars=64,
                          max_path_chars=256)
src, dst = tempfile.mkdtemp(), tempfile.mkdtemp()
ns = execute.main_namespace({"__builtins__": __builtins__, "tools": "old tools"})
exec("base = 1\ndef f(x):\n    return base + x\nclass K:\n    pass\n", ns)
blob = snapshot.take(ns, src, limits, 1 << 20)
fresh = execute.main_namespace({"__builtins__": __builtins__, "tools": "new tools"})
out = snapshot.restore(blob, fresh, dst, limits)
# the restored functions' globals are the fresh __main__ module's namespace
assert out is fresh and sys.modules["__main__"].__dict__ is out and out["f"].__globals__ is out
assert out["tools"] == "new tools" and out["__name__"] == "__main__"
out["base"] = 10
assert out["f"](1) == 11
assert pickle.loads(pickle.dumps(out["f"])) is out["f"]  # by reference, as multiprocessing does
assert type(pickle.loads(pickle.dumps(out["K"]()))) is out["K"]
# positive control: cloudpickle's own dumps, as snapshots were taken before, gives the
# functions a dictionary of their own, which pickle cannot find in __main__
import cloudpickle
anchor = type(lambda: 0)(compile("None", "<snapshot>", "eval"), ns)
plain = cloudpickle.loads(cloudpickle.dumps({"f": ns["f"], "anchor": anchor}))
assert plain["anchor"].__globals__ is not fresh and plain["f"].__globals__ is plain["anchor"].__globals__
try:
    pickle.dumps(plain["f"])
    raise AssertionError("pickled a function __main__ does not hold")
except pickle.PicklingError:
    pass
print("ok")
"""


def test_a_restored_session_is_the_main_module_again(tmp_path: Path) -> None:
    assert os.path.exists(JAIL_PYTHON), "build the jail environment first: make jail-env"
    _run(JAIL_PYTHON, ROUND_TRIP, tmp_path)
