"""A user's script beside the clone imports the library (issue 17, item 2).

With the clone at ``X/jaild``, a script in ``X/`` has ``X`` first on ``sys.path``, and
``X/jaild`` -- the clone, a directory without ``__init__.py`` -- is a namespace package
candidate named ``jaild``. The path finder returns a namespace package only when no
``sys.path`` entry holds a regular package of that name. setuptools' default editable
install for a flat layout is an import hook appended to ``sys.meta_path``, asked only
after the path finder has settled on the namespace package, and the script got
``ImportError: cannot import name 'Client' from 'jaild' (unknown location)``.
``pyproject.toml`` (``package-dir``) makes the editable install a ``.pth`` line naming the
checkout, so the path finder sees ``<checkout>/jaild/__init__.py`` and takes it.

The situation is rebuilt wherever the checkout lives: ``X`` is a temporary directory and
``X/jaild`` a link to this checkout. Run with this interpreter -- the venv ``make setup``
built, which runs the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, guard

SCRIPT = """\
from jaild import Client
import jaild
print(jaild.__file__)
print(Client.__module__)
"""
UNKNOWN_LOCATION = "cannot import name 'Client' from 'jaild' (unknown location)"


@pytest.fixture
def beside_clone(tmp_path: Path) -> Path:
    """X/ with X/jaild -> this checkout and X/use_jaild.py, a user's script."""
    parent = tmp_path / "X"
    parent.mkdir()
    (parent / "jaild").symlink_to(REPO, target_is_directory=True)
    (parent / "use_jaild.py").write_text(SCRIPT)
    return parent


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # As from a user's shell: nothing of pytest's path, and sys.path[0] kept (PYTHONSAFEPATH
    # would drop the script's directory, and with it the clone that shadows the package).
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME", "PYTHONNOUSERSITE")}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=guard(120), check=False)


def imports_the_checkout(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, (
        f"the script could not import jaild (exit {proc.returncode}); is the editable install "
        f"a .pth path entry? `make setup` reinstalls it (pyproject.toml: package-dir)\n"
        f"{proc.stderr}")
    module_file, client_module = proc.stdout.split()
    assert Path(module_file).resolve() == (REPO / "jaild" / "__init__.py").resolve()
    assert client_module == "jaild.client"


def test_a_script_beside_the_clone_run_from_there(beside_clone: Path) -> None:
    imports_the_checkout(run(["use_jaild.py"], cwd=beside_clone))


def test_a_script_beside_the_clone_run_from_elsewhere(beside_clone: Path,
                                                      tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    imports_the_checkout(run([str(beside_clone / "use_jaild.py")], cwd=elsewhere))


def test_python_c_in_the_clones_parent(beside_clone: Path) -> None:
    imports_the_checkout(run(["-c", SCRIPT], cwd=beside_clone))


def test_positive_control_the_clone_shadows_without_the_install(beside_clone: Path) -> None:
    """Without site-packages (-S: no .pth is read) the clone's directory is all there is
    named jaild, and the script fails exactly as the issue reported: the setup above does
    put a shadowing namespace package in the way."""
    proc = run(["-S", "use_jaild.py"], cwd=beside_clone)
    assert proc.returncode == 1
    assert UNKNOWN_LOCATION in proc.stderr, proc.stderr
