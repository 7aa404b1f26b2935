"""``jaild env``: build and list the jail Python environments.

::

    jaild env build NAME -r requirements.txt [--python /usr/bin/python3] [--state-dir DIR]
                    [--rebuild [--force]] [--quiet]
    jaild env list [--state-dir DIR] [--policies DIR] [--json]

Theory of operation
-------------------

A jail environment is a venv at ``<state_dir>/envs/NAME`` that a policy names with
``python.env = "NAME"``. The daemon binds it read-only into every jail of that policy, where
the jailed (unprivileged, unmapped) uid runs its ``bin/python3``. That fixes what a usable
environment is:

* **Made from a system interpreter.** A jail sees ``/usr``, the env and nothing else of the
  host, so ``bin/python3`` must resolve to an interpreter under ``/usr`` -- not to another
  venv's, and not to a ``~/.pyenv`` or ``/opt`` build.
* **Reachable and readable by anyone.** Everything is ``a+rX``, and every directory from ``/``
  down to the env is world-searchable (:func:`jaild.policy.schema.blocking_ancestor`).
* **Able to run the in-jail runtime.** The runtime's packages (``envs/default.txt``: msgpack,
  pyseccomp, python-prctl) are installed with the user's requirements, and the runtime's own
  imports are tried with the new interpreter before the env is put in place.

Environments are **immutable**: once built, an env is sealed (``a-w`` everywhere) and carries a
manifest, ``.jaild-env.json`` (interpreter, requirements and their digest, ``pip freeze``, build
time, builder). Building a NAME that exists is refused unless ``--rebuild``; a rebuild whose
requirements digest and interpreter match the manifest is a no-op unless ``--force``. The
digest covers the *resolved* requirements: ``-r``/``-c`` includes are expanded, comments and
blank lines dropped, and the runtime's packages are part of it.

A build never touches the live env until it has succeeded. It happens in a hidden sibling
directory, ``.NAME.build-<pid>``; the finished tree is swapped in with one
``renameat2(RENAME_EXCHANGE)`` (two renames where the filesystem lacks it), so ``envs/NAME``
always names a complete env. A failed build removes its directory and leaves any existing env
as it was. Builds hold ``envs/.jaild-envs.lock``, so two never interleave.

What a running daemon sees. The daemon binds ``envs/NAME`` by path when it makes a jail: a
zygote (``[pool] mode = "zygote"``) bound it when the daemon started and keeps that tree for
the daemon's life; a ``spawn`` policy's jails made after the swap get the new tree. Restart the
daemon to have every jail use a rebuilt env. The replaced tree is therefore removed only once
no mount namespace has it mounted (``/proc/*/mountinfo``): until then it stays as
``.NAME.old-<time>``, and the next build removes it once it is free.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from jaild.errors import EXIT_FAILURE, EXIT_USAGE, EnvError, EnvUsageError
from jaild.version import __version__

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}"
"""Env names: the rule of ``python.env`` in policies (jaild.policy.schema._check_python)."""

MANIFEST = ".jaild-env.json"
MANIFEST_FORMAT = 1
LOCK = ".jaild-envs.lock"
DEFAULT_PYTHON = "/usr/bin/python3"
MIN_PYTHON = (3, 11)
SYSTEM_PREFIX = "/usr"
"""Where the interpreter must live: the jail binds /usr and nothing else of the host."""

RUNTIME_REQUIREMENTS = (
    "msgpack>=1.0.5", "pyseccomp>=0.1.2", "python-prctl>=1.8.1", "cloudpickle>=3.0",
)
"""What the in-jail runtime imports: envs/default.txt's requirements (a unit test keeps the two
equal), for an installation of jaild that has no checkout around it."""

CHECKOUT = Path(__file__).resolve().parent.parent
RUNTIME_REQUIREMENTS_FILE = CHECKOUT / "envs" / "default.txt"

EXIT_OK = 0

PIP_TAIL_LINES = 25


# ---------------------------------------------------------------------------- names, paths


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid env name. Raises EnvUsageError naming the problem."""
    if re.fullmatch(NAME_PATTERN, name):
        return name
    if not name:
        problem = "it is empty"
    elif len(name) > 64:
        problem = f"it has {len(name)} characters (at most 64)"
    elif not name[0].isascii() or not name[0].isalnum():
        problem = f"it starts with {name[0]!r}"
    else:
        bad = next(c for c in name if not re.fullmatch(r"[A-Za-z0-9_.\-]", c))
        problem = f"it contains {bad!r}"
    raise EnvUsageError(
        f"invalid environment name {name!r}: {problem}; names are letters, digits, '_', '.' "
        "and '-', start with a letter or digit, and have at most 64 characters"
    )


def envs_dir_of(state_dir: str) -> str:
    """``<state_dir>/envs``: where the daemon looks for named envs (DaemonConfig.envs_dir)."""
    return os.path.join(state_dir, "envs")


# ---------------------------------------------------------------------------- requirements


def runtime_requirements_text() -> str:
    """The runtime's requirements: the checkout's envs/default.txt, else RUNTIME_REQUIREMENTS."""
    try:
        return RUNTIME_REQUIREMENTS_FILE.read_text(encoding="utf-8")
    except OSError:
        return "".join(f"{r}\n" for r in RUNTIME_REQUIREMENTS)


_INCLUDE = re.compile(
    r"^(?P<opt>-r|-c|--requirement|--constraint)(?:\s*=\s*|\s+|(?<=-r)|(?<=-c))(?P<arg>\S.*)$"
)


def _strip_comment(raw: str) -> str:
    return re.sub(r"(^|\s+)#.*$", "", raw)


def _logical_lines(text: str) -> Iterator[tuple[str, list[str]]]:
    """pip's view of a requirements file: (logical line, the raw lines it came from), with
    continuations joined, comments dropped, whitespace stripped; "" for blank lines."""
    pending, raws = "", []
    for raw in text.splitlines():
        line = _strip_comment(raw)
        raws.append(raw)
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        yield (pending + line).strip(), raws
        pending, raws = "", []
    if raws:
        yield pending.strip(), raws


@dataclass(frozen=True)
class Requirements:
    """A requirements file with its ``-r``/``-c`` includes resolved.

    ``text``: the files as written, each include replaced by the included file between
    ``# begin -r FILE`` and ``# end -r FILE`` (what the manifest keeps). ``canonical``: only
    the logical lines, includes expanded -- what the digest is taken of, so a comment or a
    blank line does not call for a rebuild. ``files``: every file read.
    """

    path: str
    text: str
    canonical: str
    files: tuple[str, ...]


def resolve_requirements(path: str) -> Requirements:
    """Read a requirements file and, recursively, the files it includes with ``-r``/``-c``.

    Raises:
        EnvUsageError: the file or an included file cannot be read, or includes itself.
    """
    files: list[str] = []

    def read(file: str, chain: tuple[str, ...], origin: str) -> tuple[list[str], list[str]]:
        real = os.path.realpath(file)
        if real in chain:
            raise EnvUsageError(f"{origin}: includes {file}, which includes it again")
        try:
            text = Path(file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise EnvUsageError(f"{origin}: {file} does not exist") from None
        except IsADirectoryError:
            raise EnvUsageError(f"{origin}: {file} is a directory, not a file") from None
        except OSError as exc:
            raise EnvUsageError(f"{origin}: cannot read {file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise EnvUsageError(f"{origin}: {file} is not UTF-8 text") from None
        files.append(file)
        shown: list[str] = []
        logical: list[str] = []
        for line, raws in _logical_lines(text):
            match = _INCLUDE.match(line)
            arg = match["arg"].strip() if match else ""
            if match is None or re.match(r"^[a-z][a-z0-9+.\-]*://", arg):
                # not an include, or one of a URL (pip fetches it; it is digested as written)
                shown += raws
                if line:
                    logical.append(line)
                continue
            opt = "-r" if match["opt"] in ("-r", "--requirement") else "-c"
            inner = os.path.join(os.path.dirname(file), arg)
            inner_shown, inner_logical = read(inner, (*chain, real), f"{file}: {opt} {arg}")
            shown += [f"# begin {opt} {arg}", *inner_shown, f"# end {opt} {arg}"]
            logical += [f"# {opt} {arg}", *inner_logical]
        return shown, logical

    shown, logical = read(path, (), "requirements")
    return Requirements(
        path=path,
        text="\n".join(shown) + "\n",
        canonical="\n".join(logical) + "\n",
        files=tuple(files),
    )


def env_digest(runtime: str, requirements: Requirements) -> str:
    """The digest a manifest records: the runtime's needs and the resolved requirements."""
    runtime_lines = "\n".join(line for line, _raws in _logical_lines(runtime) if line)
    canonical = f"# jaild runtime\n{runtime_lines}\n# requirements\n{requirements.canonical}"
    return hashlib.sha256(canonical.encode()).hexdigest()


def redact(text: str) -> str:
    """Hide credentials in URLs (``https://user:token@host``): the manifest is world-readable,
    and visible inside every jail."""
    return re.sub(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s@]+@", r"\1***@", text)


# ---------------------------------------------------------------------------- the interpreter


@dataclass(frozen=True)
class Interpreter:
    path: str  # as given
    realpath: str
    version: str  # "3.11.2"

    @property
    def abi(self) -> str:
        """``3.11``: what a venv depends on (its lib/python3.11)."""
        return ".".join(self.version.split(".")[:2])


def inspect_python(path: str) -> Interpreter:
    """Check that ``path`` is a system interpreter a jail can run, with ``venv`` available.

    Raises:
        EnvUsageError: it is missing, not under /usr, a venv's interpreter, too old, or lacks
            the venv module.
    """
    if not os.path.isabs(path):
        found = shutil.which(path)
        if found is None:
            raise EnvUsageError(f"--python {path}: not found on PATH; give an absolute path")
        path = found
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise EnvUsageError(f"--python {path}: no such executable")
    real = os.path.realpath(path)
    if not real.startswith(SYSTEM_PREFIX + "/"):
        raise EnvUsageError(
            f"--python {path} resolves to {real}, which jails cannot see (they see {SYSTEM_PREFIX} "
            "and the env only); build from a system interpreter, e.g. /usr/bin/python3"
        )
    probe = (
        "import json, sys\n"
        "try:\n    import ensurepip, venv\n    ok = True\nexcept ImportError:\n    ok = False\n"
        "print(json.dumps([list(sys.version_info[:3]), sys.prefix, sys.base_prefix, ok]))"
    )
    try:
        run = subprocess.run(
            [path, "-I", "-B", "-c", probe], capture_output=True, text=True, timeout=60, check=False
        )
        version_info, prefix, base_prefix, has_venv = json.loads(run.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise EnvUsageError(f"--python {path}: cannot run it: {exc}") from None
    if prefix != base_prefix:
        raise EnvUsageError(
            f"--python {path} is the interpreter of the venv {prefix}; an env made from it "
            f"would point into that venv. Use the system interpreter: {base_prefix}/bin/python3"
        )
    version = ".".join(str(v) for v in version_info)
    if tuple(version_info[:2]) < MIN_PYTHON:
        raise EnvUsageError(
            f"--python {path} is Python {version}; the jail runtime needs "
            f"{'.'.join(map(str, MIN_PYTHON))} or later"
        )
    if not has_venv:
        raise EnvUsageError(
            f"--python {path} has no venv/ensurepip module: apt-get install python3-venv"
        )
    return Interpreter(path=path, realpath=real, version=version)


# ---------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class Manifest:
    """``<env>/.jaild-env.json``."""

    name: str
    python: str
    python_realpath: str
    python_version: str
    requirements_file: str
    requirements: str  # the resolved text, credentials redacted
    requirements_sha256: str  # env_digest(): runtime needs + resolved requirements
    packages: tuple[str, ...]  # pip freeze
    built_at: str  # ISO 8601, UTC
    builder: str  # "jaild 0.1.0"
    format: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["packages"] = list(self.packages)
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in fields}
        known["packages"] = tuple(known.get("packages", ()))
        return cls(**known)

    @property
    def abi(self) -> str:
        return ".".join(self.python_version.split(".")[:2])


def read_manifest(env: str) -> Manifest | None:
    """The env's manifest, or None if it has none (built by hand, or by an older jaild)."""
    try:
        return Manifest.from_json(Path(env, MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None


# ---------------------------------------------------------------------------- filesystem


def _walk(root: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` (root included), symlinks not followed."""
    yield root, os.lstat(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(FileNotFoundError):
                yield path, os.lstat(path)


def set_modes(root: str, *, writable: bool) -> None:
    """Make a tree world-readable (``a+rX``) and sealed (``a-w``), or writable by its owner
    again (``u+w``, to remove it). Symlinks are left alone: chmod would follow them out of
    the tree (``bin/python3`` points at /usr/bin)."""
    for path, st in _walk(root):
        if stat.S_ISLNK(st.st_mode):
            continue
        mode = stat.S_IMODE(st.st_mode)
        if writable:
            new = mode | stat.S_IWUSR
        else:
            new = mode | 0o444
            if stat.S_ISDIR(st.st_mode) or mode & 0o111:
                new |= 0o111
            new &= ~0o222
        if new != mode:
            os.chmod(path, new)


def remove_tree(path: str) -> None:
    """Remove a (sealed) tree: give its owner write permission back first."""
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        set_modes(path, writable=True)
    shutil.rmtree(path)


def disk_usage(root: str) -> int:
    """Bytes allocated under ``root``, each inode counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for _path, st in _walk(root):
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _renameat2_exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False if this kernel or filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def _decode_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _fs_relative(path: str) -> tuple[str, str] | None:
    """(``major:minor``, path within its filesystem) -- how other mount namespaces'
    mountinfo names a bind mount of ``path``."""
    real = os.path.realpath(path)
    best: tuple[int, str, str] | None = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        root, point = _decode_mountinfo(fields[3]), _decode_mountinfo(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            rest = os.path.relpath(real, point)
            best = (len(point), fields[2], os.path.normpath(os.path.join(root, rest)))
    return None if best is None else (best[1], best[2])


def mounted_by(path: str) -> list[int]:
    """Pids (one per mount namespace) that have ``path``, or something under it, mounted:
    jails of a running daemon that bound this tree."""
    where = _fs_relative(path)
    if where is None:
        return []
    device, inner = where
    pids: list[int] = []
    namespaces: set[str] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{entry.name}/ns/mnt")
            if ns in namespaces:
                continue
            namespaces.add(ns)
            lines = Path(f"/proc/{entry.name}/mountinfo").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 5 or fields[2] != device:
                continue
            root = _decode_mountinfo(fields[3])
            if root == inner or root.startswith(inner.rstrip("/") + "/"):
                pids.append(int(entry.name))
                break
    return pids


@contextlib.contextmanager
def _locked(envs_dir: str) -> Iterator[None]:
    fd = os.open(os.path.join(envs_dir, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _prepare_envs_dir(state_dir: str) -> str:
    """Create ``<state_dir>/envs`` and any missing directory above it, each 0755 whatever the
    umask; refuse if an existing directory on the way is not searchable by anyone (jaild does
    not open up directories it did not make)."""
    from jaild.policy.schema import blocking_ancestor

    envs_dir = envs_dir_of(os.path.abspath(state_dir))
    missing = []
    d = envs_dir
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
            os.chmod(d, 0o755)
        except FileExistsError:
            pass
        except PermissionError:
            raise EnvError(
                f"cannot create {d}: permission denied. The system state directory needs root "
                "(sudo jaild env build ...), or choose one with --state-dir DIR"
            ) from None
        except OSError as exc:
            raise EnvError(f"cannot create {d}: {exc.strerror}") from None
    blocked = blocking_ancestor(envs_dir)
    if blocked is not None:
        raise EnvError(
            f"{blocked} is not world-searchable, so the jailed uid could not reach "
            f"{envs_dir}: chmod o+x {blocked}, or choose a state directory outside it "
            "(--state-dir DIR)"
        )
    if not os.access(envs_dir, os.W_OK):
        raise EnvError(
            f"cannot write to {envs_dir}: permission denied; run as root (sudo) or choose "
            "a state directory you own (--state-dir DIR)"
        )
    return envs_dir


def _collect_garbage(envs_dir: str, out: TextIO) -> None:
    """Remove what earlier builds left (called with the lock held, so no build is running):
    build directories of interrupted builds, and replaced trees no jail has mounted any more."""
    for entry in sorted(os.scandir(envs_dir), key=lambda e: e.name):
        if not entry.is_dir(follow_symlinks=False) or not entry.name.startswith("."):
            continue
        if ".build-" in entry.name:
            remove_tree(entry.path)
        elif ".old-" in entry.name and not mounted_by(entry.path):
            remove_tree(entry.path)
            print(f"removed {entry.path} (a replaced env no jail uses any more)", file=out)


# ---------------------------------------------------------------------------- build


def _now() -> str:
    """The build time a manifest records: now, or ``SOURCE_DATE_EPOCH`` where it is set (the
    reproducible-builds convention: an image built twice from one commit is the same bytes)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    when = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        if epoch.isdigit()
        else datetime.datetime.now(datetime.UTC)
    )
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


class _Progress:
    def __init__(self, out: TextIO, name: str, steps: int) -> None:
        self.out, self.name, self.steps, self.step = out, name, steps, 0

    def phase(self, text: str) -> None:
        self.step += 1
        print(f"[{self.step}/{self.steps}] {self.name}: {text}", file=self.out, flush=True)


def _run_streamed(argv: list[str], cwd: str, out: TextIO, quiet: bool) -> tuple[int, list[str]]:
    """Run a command, echoing its output (indented) unless ``quiet``; return its exit status
    and the last lines of its output."""
    tail: deque[str] = deque(maxlen=PIP_TAIL_LINES)
    env = {
        **os.environ,
        "PIP_NO_INPUT": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_ROOT_USER_ACTION": "ignore",  # building as root is the point here
    }
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    with subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if not quiet:
                out.write(f"    {line}")
                out.flush()
    return proc.returncode, list(tail)


def _fix_script_paths(work: str, final: str) -> None:
    """The venv was made at ``work`` and moves to ``final``: point its scripts' shebangs and
    activate files there (a jail runs bin/python3 directly; these are for the host)."""
    bin_dir = os.path.join(work, "bin")
    old, new = work.encode(), final.encode()
    for entry in os.scandir(bin_dir):
        if entry.is_symlink() or not entry.is_file():
            continue
        with open(entry.path, "rb") as f:
            data = f.read(1 << 20)
        if old in data and b"\0" not in data:
            with open(entry.path, "wb") as f:
                f.write(data.replace(old, new))


def _verify_runtime(python: str) -> str | None:
    """Try the in-jail runtime's imports with the env's interpreter: None if they work, else
    the error. Only ``jaild`` itself is added to its path (through a directory holding just a
    link to this package), so the env's own msgpack, pyseccomp and prctl are what is tried."""
    with tempfile.TemporaryDirectory(prefix="jaild-verify-") as tmp:
        os.symlink(Path(__file__).resolve().parent, os.path.join(tmp, "jaild"))
        code = (
            f"import sys; sys.path.insert(0, {tmp!r}); "
            "import msgpack, jaild.runtime.seccomp, jaild.runtime.harden"
        )
        run = subprocess.run(
            [python, "-I", "-B", "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if run.returncode == 0:
        return None
    return (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]


@dataclass(frozen=True)
class BuildRequest:
    name: str
    requirements: str
    python: str = DEFAULT_PYTHON
    state_dir: str = "/var/lib/jaild"
    rebuild: bool = False
    force: bool = False
    quiet: bool = False


def build_env(req: BuildRequest, out: TextIO = sys.stderr) -> tuple[str, Manifest | None]:
    """Build (or rebuild) an env; return its path and its new manifest (None: up to date).

    Raises:
        EnvUsageError: bad name, unreadable requirements, unusable interpreter.
        EnvError: the env exists (without ``rebuild``), pip or the runtime check failed,
            permissions.
    """
    name = check_name(req.name)
    requirements = resolve_requirements(req.requirements)
    runtime = runtime_requirements_text()
    digest = env_digest(runtime, requirements)
    python = inspect_python(req.python)
    envs_dir = _prepare_envs_dir(req.state_dir)
    final = os.path.join(envs_dir, name)
    with _locked(envs_dir):
        _collect_garbage(envs_dir, out)
        if os.path.lexists(final):
            current = read_manifest(final)
            built = f"built {current.built_at}" if current else "built by hand: no manifest"
            if not req.rebuild:
                raise EnvError(
                    f"environment {name} exists ({built}); environments are immutable: "
                    "rebuild with --rebuild"
                )
            if (
                current is not None
                and current.requirements_sha256 == digest
                and current.python_realpath == python.realpath
                and current.abi == python.abi
                and not req.force
            ):
                return final, None
            why = (
                "it has no manifest: built by hand or by an older jaild"
                if current is None
                else f"{built}; requirements changed"
                if current.requirements_sha256 != digest
                else f"{built}; interpreter changed"
                if current.python_realpath != python.realpath or current.abi != python.abi
                else f"{built}; --force"
            )
            print(f"{name}: rebuilding ({why})", file=out, flush=True)
        work = os.path.join(envs_dir, f".{name}.build-{os.getpid()}")
        remove_tree(work)
        try:
            manifest = _build_into(
                work, final, name, requirements, runtime, digest, python, req, out
            )
            _swap_in(work, final, name, out)
        finally:
            if os.path.lexists(work):
                remove_tree(work)
    return final, manifest


def _build_into(
    work: str,
    final: str,
    name: str,
    requirements: Requirements,
    runtime: str,
    digest: str,
    python: Interpreter,
    req: BuildRequest,
    out: TextIO,
) -> Manifest:
    progress = _Progress(out, name, 4)
    progress.phase(f"creating venv from {python.path} (Python {python.version})")
    made = subprocess.run(
        [python.path, "-I", "-m", "venv", work], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        detail = made.stderr.strip() or made.stdout.strip()
        raise EnvError(f"{python.path} -m venv failed: {detail}")
    env_python = os.path.join(work, "bin", "python3")

    progress.phase(f"installing the runtime's packages and {requirements.path} (pip)")
    with tempfile.NamedTemporaryFile("w", prefix="jaild-runtime-", suffix=".txt") as rt:
        rt.write(runtime)
        rt.flush()
        argv = [
            env_python, "-m", "pip", "install", "--progress-bar", "off",
            "-r", rt.name, "-r", os.path.abspath(requirements.path),
        ]  # fmt: skip
        status, tail = _run_streamed(
            argv, os.path.dirname(os.path.abspath(requirements.path)), out, req.quiet
        )
    if status != 0:
        shown = "\n".join(f"    {line}" for line in tail)
        raise EnvError(
            f"pip could not install the requirements of {name} (exit status {status}); "
            f"nothing was changed. The end of pip's output:\n{shown}"
        )

    progress.phase("checking the jail runtime's imports with the new interpreter")
    problem = _verify_runtime(env_python)
    if problem is not None:
        raise EnvError(
            f"the new env cannot run the jail runtime ({problem}); it needs "
            f"{', '.join(RUNTIME_REQUIREMENTS)}. Nothing was changed"
        )
    freeze = subprocess.run(
        [env_python, "-m", "pip", "freeze"], capture_output=True, text=True, check=False
    )
    if freeze.returncode != 0:
        raise EnvError(f"pip freeze failed in the new env: {freeze.stderr.strip()}")

    progress.phase(f"sealing (a+rX, a-w) and moving into place at {final}")
    manifest = Manifest(
        name=name,
        python=python.path,
        python_realpath=python.realpath,
        python_version=python.version,
        requirements_file=os.path.abspath(requirements.path),
        requirements=redact(requirements.text),
        requirements_sha256=digest,
        packages=tuple(redact(line) for line in freeze.stdout.splitlines() if line.strip()),
        built_at=_now(),
        builder=f"jaild {__version__}",
    )
    _fix_script_paths(work, final)
    Path(work, MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
    set_modes(work, writable=False)
    return manifest


def _swap_in(work: str, final: str, name: str, out: TextIO) -> None:
    """Put the finished tree at ``final``; remove the one it replaces unless a jail uses it."""
    envs_dir = os.path.dirname(final)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    old = os.path.join(envs_dir, f".{name}.old-{stamp}-{os.getpid()}")
    if not os.path.lexists(final):
        os.rename(work, final)
        return
    if _renameat2_exchange(work, final):
        os.rename(work, old)
    else:  # two renames: envs/NAME is missing for an instant
        os.rename(final, old)
        try:
            os.rename(work, final)
        except OSError:
            os.rename(old, final)
            raise
    time.sleep(0.1)  # a jail that looked the path up just before the swap has mounted it now
    users = mounted_by(old)
    if users:
        print(
            f"{name}: the replaced env is still mounted by running jails (pids "
            f"{' '.join(map(str, users[:8]))}); it stays at {old} until they are gone, and "
            "the next jaild env build removes it. Restart the daemon to use the new env "
            "everywhere",
            file=out,
        )
    else:
        try:
            remove_tree(old)
        except OSError as exc:
            print(
                f"{name}: cannot remove the replaced env {old} ({exc}); the next build will",
                file=out,
            )


# ---------------------------------------------------------------------------- list


@dataclass(frozen=True)
class EnvInfo:
    name: str
    path: str
    manifest: Manifest | None
    python_version: str | None
    packages: int
    size_bytes: int
    policies: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "name": self.name,
            "path": self.path,
            "has_manifest": m is not None,
            "python": m.python if m else None,
            "python_version": self.python_version,
            "packages": self.packages,
            "size_bytes": self.size_bytes,
            "built_at": m.built_at if m else None,
            "requirements_sha256": m.requirements_sha256 if m else None,
            "builder": m.builder if m else None,
            "policies": list(self.policies),
        }


@dataclass(frozen=True)
class MissingEnv:
    policy: str
    file: str
    env: str

    def to_dict(self) -> dict[str, str]:
        return {"policy": self.policy, "file": self.file, "env": self.env}


@dataclass(frozen=True)
class Listing:
    envs_dir: str
    envs: tuple[EnvInfo, ...]
    missing: tuple[MissingEnv, ...]
    retired: tuple[tuple[str, int], ...]  # replaced trees kept, and how many jails mount each
    policies_dir: str
    policies_error: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "envs_dir": self.envs_dir,
            "envs": [e.to_dict() for e in self.envs],
            "policies_dir": self.policies_dir,
            "policies_error": self.policies_error,
            "missing": [m.to_dict() for m in self.missing],
            "retired": [{"path": path, "mounted_by": n} for path, n in self.retired],
        }


def _venv_version(env: str) -> str | None:
    try:
        text = Path(env, "pyvenv.cfg").read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r"^\s*version(?:_info)?\s*=\s*(\S+)", text, re.MULTILINE)
    return match[1] if match else None


def _count_dists(env: str) -> int:
    return sum(
        1
        for site in Path(env).glob("lib/python3*/site-packages")
        for d in site.glob("*.dist-info")
        if d.name.split("-")[0].lower() not in ("pip", "setuptools")
    )


def list_envs(state_dir: str, policies_dir: str) -> Listing:
    """What ``jaild env list`` shows: every env, what uses it, and what is missing."""
    from jaild.errors import PolicyError
    from jaild.policy.schema import Policy, load_policy_dir, resolve_env

    envs_dir = envs_dir_of(os.path.abspath(state_dir))
    policies: dict[str, Policy] = {}
    error = None
    try:
        policies = load_policy_dir(policies_dir)
    except PolicyError as exc:
        error = exc.message
    users: dict[str, list[str]] = {}
    missing = []
    for policy in policies.values():
        env = os.path.normpath(resolve_env(policy, envs_dir))
        users.setdefault(env, []).append(policy.name)
        if not os.path.isdir(env):
            missing.append(MissingEnv(policy.name, policy.path, env))
    envs = []
    retired = []
    entries = sorted(os.scandir(envs_dir), key=lambda e: e.name) if os.path.isdir(envs_dir) else []
    for entry in entries:
        if not entry.is_dir():  # an env may be a link to a venv elsewhere
            continue
        if entry.name.startswith("."):
            if ".old-" in entry.name:
                retired.append((entry.path, len(mounted_by(entry.path))))
            continue
        manifest = read_manifest(entry.path)
        envs.append(
            EnvInfo(
                name=entry.name,
                path=entry.path,
                manifest=manifest,
                python_version=manifest.python_version if manifest else _venv_version(entry.path),
                packages=len(manifest.packages) if manifest else _count_dists(entry.path),
                size_bytes=disk_usage(entry.path),
                policies=tuple(sorted(users.get(os.path.normpath(entry.path), []))),
            )
        )
    return Listing(envs_dir, tuple(envs), tuple(missing), tuple(retired), policies_dir, error)


def human_size(n: object) -> str:
    """Bytes for people: ``512 B``, ``9.8 MB``; ``-`` for no number."""
    if not isinstance(n, (int, float)):
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def format_listing(listing: Listing) -> str:
    lines = []
    if not listing.envs:
        lines.append(f"no environments in {listing.envs_dir}")
    else:
        rows = [("NAME", "PYTHON", "PACKAGES", "SIZE", "BUILT", "DIGEST", "POLICIES")]
        for e in listing.envs:
            m = e.manifest
            rows.append(
                (
                    e.name,
                    e.python_version or "?",
                    str(e.packages),
                    human_size(e.size_bytes),
                    m.built_at if m else "no manifest",
                    m.requirements_sha256[:12] if m else "-",
                    ", ".join(e.policies) or "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        lines.append(f"({listing.envs_dir})")
    for e in listing.envs:
        if e.manifest is None:
            lines.append(
                f"note: {e.name} has no manifest (built by hand or by an older jaild); "
                f"rebuild it: jaild env build {e.name} -r REQUIREMENTS --rebuild"
            )
    for gap in listing.missing:
        lines.append(
            f"missing: policy {gap.policy} ({gap.file}) uses {gap.env}, which does not exist; "
            f"build it: jaild env build {os.path.basename(gap.env)} -r requirements.txt"
        )
    for path, users in listing.retired:
        lines.append(
            f"replaced: {path}, kept while jails use it ({users} mount namespaces); "
            "the next jaild env build removes it once none does"
        )
    if listing.policies_error:
        lines.append(f"warning: policies not loaded: {listing.policies_error}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- command line


def _state_dir(args: argparse.Namespace) -> str:
    from jaild.daemon.config import default_state_dir

    return str(args.state_dir or default_state_dir())


def cmd_env_build(args: argparse.Namespace) -> int:
    if args.force and not args.rebuild:
        print("jaild: --force only applies with --rebuild", file=sys.stderr)
        return EXIT_USAGE
    req = BuildRequest(
        name=args.name,
        requirements=args.requirements,
        python=args.python,
        state_dir=_state_dir(args),
        rebuild=args.rebuild,
        force=args.force,
        quiet=args.quiet,
    )
    try:
        path, manifest = build_env(req)
    except EnvError as exc:
        print(f"jaild: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"jaild: building {args.name} failed, nothing was changed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("jaild: interrupted; nothing was changed", file=sys.stderr)
        return 130
    if manifest is None:
        print(f"{args.name}: up to date ({path})")
    else:
        print(
            f"{args.name}: built {path} (Python {manifest.python_version}, "
            f"{len(manifest.packages)} packages, requirements {manifest.requirements_sha256[:12]})"
        )
    return EXIT_OK


def cmd_env_list(args: argparse.Namespace) -> int:
    from jaild.daemon.config import default_policies_dir

    listing = list_envs(_state_dir(args), args.policies or default_policies_dir())
    if args.json:
        json.dump(listing.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_listing(listing))
    return EXIT_OK


def add_env_commands(sub: Any) -> None:
    """Register ``jaild env build`` and ``jaild env list`` on the CLI's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "env", help="build and list jail Python environments"
    )
    esub = p.add_subparsers(dest="env_command", required=True)
    state_help = "envs live in DIR/envs (default: $JAILD_STATE_DIR or /var/lib/jaild)"

    b = esub.add_parser(
        "build",
        help="build an immutable jail environment from a requirements file",
        description="Build a venv usable inside jails at STATE_DIR/envs/NAME: the jail "
        "runtime's packages plus REQUIREMENTS, from a system interpreter, world-readable "
        "and sealed. An existing NAME is replaced only with --rebuild.",
    )
    b.add_argument("name", metavar="NAME", help="environment name (what python.env names)")
    b.add_argument(
        "-r", "--requirements", required=True, metavar="FILE", help="pip requirements file"
    )
    b.add_argument(
        "--python", default=DEFAULT_PYTHON, help=f"system interpreter (default: {DEFAULT_PYTHON})"
    )
    b.add_argument("--state-dir", metavar="DIR", help=state_help)
    b.add_argument(
        "--rebuild",
        action="store_true",
        help="replace an existing env (a no-op if its requirements and interpreter are unchanged)",
    )
    b.add_argument(
        "--force", action="store_true", help="with --rebuild: rebuild even if up to date"
    )
    b.add_argument("-q", "--quiet", action="store_true", help="do not echo pip's output")
    b.set_defaults(func=cmd_env_build)

    ls = esub.add_parser("list", help="list jail environments and the policies that use them")
    ls.add_argument("--state-dir", metavar="DIR", help=state_help)
    ls.add_argument(
        "--policies", metavar="DIR", help="policy directory (default: as jaild serve finds it)"
    )
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=cmd_env_list)
