"""A session's state as bytes, and back: taken in the session's jail, restored in a fresh one.

Theory of operation
-------------------
A snapshot is made *inside the jail* and restored *inside another jail*: the daemon only
stores the bytes and never parses them (they are the jail's output, hostile to everyone
else). Its content:

* ``state``: one cloudpickle of the session's names (everything the runs bound in the
  namespace, but the runtime's own ``tools``, ``ToolError`` and discovery helpers, which
  the restoring jail provides afresh), the public data attributes of each Python module a
  name is bound to, and its public methods bound to objects (``import random`` then
  ``random.seed(1)``: the generator's state comes back; never ``sys``, ``os`` or the
  runtime's own modules, :data:`NO_MODULE_STATE`), and an
  *anchor*: a function whose globals are the namespace. Functions and classes the session
  defined are pickled by value, and in one pickle every function of the namespace shares one
  globals dictionary; after loading, the anchor's globals *are* the new namespace, so the
  restored functions see later runs' assignments as before. That dictionary is not pickled:
  it stands for the namespace (a persistent id, :data:`MAIN_GLOBALS`), and the restoring jail
  loads the session's functions with the fresh jail's ``__main__`` module's dictionary as their
  globals -- so they stay ``__main__``'s, picklable by reference (``multiprocessing``) after a
  restore or a fork as before it. Modules come back by import.
* ``files``: every regular file below the working directory (path and contents), read as
  uploads and downloads are (:mod:`jaild.runtime.files`: no link is ever followed).
* ``python``: the interpreter's ``major.minor``; code objects do not cross versions.

A closed file (what ``with open(...) as f`` leaves in ``f``) comes back as a
:class:`ClosedFile` stand-in. What cannot be captured makes the snapshot fail naming it (a
variable holding an open file (for reading too: never a copy of what is left of it),
a generator, a socket, a thread; a symlink, FIFO or device in the working directory; more
bytes than the policy allows), never a partial state. What does not survive by design:
running tasks of the session's event loop and threads (none can be pickled; the names that
hold them fail the snapshot), a module's unpicklable internals (left as a fresh import
makes them), file permission bits (files come back 0644), empty directories and timestamps.

This module imports the standard library, msgpack and ``jaild.runtime.files``; cloudpickle
is imported on first use (it is in the jail's environment, ``envs/default.txt``).
"""

from __future__ import annotations

import io
import sys
import types
from collections.abc import Mapping
from typing import Any

import msgpack

from jaild.errors import SnapshotError, UploadError
from jaild.runtime import files

FORMAT = "jaild-snapshot"
VERSION = 1
RUNTIME_NAMES = frozenset(
    {"__builtins__", "tools", "ToolError", "_discover", "_schema", "_search"}
)
"""Names the runtime puts in every session's namespace: never captured, provided anew."""
SHOWN_CULPRITS = 5


def _python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _cloudpickle() -> Any:
    try:
        import cloudpickle  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:
        raise SnapshotError(
            "snapshots need cloudpickle in the jail's Python environment (the runtime's "
            "envs/default.txt); this environment has none: rebuild it (make jail-env)"
        ) from exc
    return cloudpickle


class ClosedFile:
    """What a closed file the session held (``with open(...) as f`` leaves ``f``) comes back
    as: its ``name`` and ``mode``, ``closed`` True, and every I/O a closed file refuses."""

    closed = True

    def __init__(self, name: object, mode: str) -> None:
        self.name = name
        self.mode = mode

    def __getattr__(self, attr: str) -> Any:
        raise ValueError(f"I/O operation on closed file ({attr})")

    def __repr__(self) -> str:
        return f"<closed file {self.name!r}, mode {self.mode!r}>"


def _closed_file(name: object, mode: str) -> ClosedFile:
    return ClosedFile(name, mode)


OPEN_FILES = (io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom,
              io.TextIOWrapper)
"""Files backed by a descriptor (``open()``'s): what a snapshot refuses while they are open;
in-memory ones (``io.StringIO``, ``io.BytesIO``) are values and are captured."""


MAIN_GLOBALS = "jaild:__main__"
"""The persistent id that stands for the session's namespace (the ``__main__`` module's
dictionary, the globals of every function the session defined) in a snapshot's pickle."""


def _dumper(cloudpickle: Any, main_globals: dict[str, Any] | None = None) -> Any:
    """cloudpickle's ``dumps``, with closed files pickled as :class:`ClosedFile` and open
    ones refused; functions whose globals are ``main_globals`` get, once loaded by
    :func:`_loads`, the namespace given there as theirs."""
    import pickle  # with cloudpickle, on first use: the runtime's start imports neither

    class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
        def __init__(self, file: Any, protocol: int) -> None:
            super().__init__(file, protocol=protocol)
            self._main_marker: dict[str, Any] | None = None
            if main_globals is not None:
                # cloudpickle pickles a function's globals as the dictionary it keeps for
                # them in ``globals_ref`` (one per globals, shared by the functions of one
                # pickle): ours is a marker, pickled as the persistent id only.
                self._main_marker = self.globals_ref.setdefault(id(main_globals), {})

        def persistent_id(self, obj: Any) -> Any:
            return MAIN_GLOBALS if obj is self._main_marker else None

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, io.IOBase) and obj.closed:
                name = getattr(obj, "name", None)
                name = name if isinstance(name, (str, int)) else None
                return _closed_file, (name, str(getattr(obj, "mode", "")))
            if isinstance(obj, OPEN_FILES) and obj not in (sys.stdin, sys.stdout, sys.stderr):
                # cloudpickle would take a file open for reading as a StringIO of what is left
                # of it: another object, with no file behind it. Refused, as a written one is.
                raise pickle.PicklingError(
                    f"an open file ({getattr(obj, 'name', '?')!r}) cannot be captured: close it")
            return super().reducer_override(obj)

    def dumps(obj: Any, protocol: int = 5) -> bytes:
        out = io.BytesIO()
        Pickler(out, protocol=protocol).dump(obj)
        return out.getvalue()

    return dumps


NO_MODULE_STATE = frozenset({"sys", "builtins", "os", "posix", "posixpath", "importlib",
                             "jaild", "cloudpickle", "pickle", "copyreg", "msgpack"})
"""Modules whose attributes a snapshot never carries (the interpreter's and the runtime's
own machinery: ``sys.modules``, ``os.environ``, ...); they come back as the new jail has them."""


def _module_state_kept(module: types.ModuleType) -> bool:
    """A module written in Python, not of the interpreter's or the runtime's machinery."""
    name = getattr(module, "__name__", "")
    if not isinstance(name, str) or name.split(".")[0] in NO_MODULE_STATE:
        return False
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and path.endswith(".py")


def _kept_attribute(name: str, value: Any) -> bool:
    """A module attribute a snapshot carries: public data, and public methods bound to an
    object (``random.random``: so the generator they share comes back in its state) -- not
    the module's private names, functions, classes or submodules (its import brings those
    back)."""
    if name.startswith("_"):
        return False
    if isinstance(value, (types.ModuleType, type)):
        return False
    if callable(value):
        bound_to = getattr(value, "__self__", None)
        return bound_to is not None and not isinstance(bound_to, (types.ModuleType, type))
    return True


def _module_data(module: types.ModuleType, dumps: Any) -> dict[str, Any]:
    """The attributes of ``module`` a snapshot keeps; the unpicklable ones are left to the
    restoring jail's import (a lock, a logger's handlers, C state)."""
    kept = {}
    for name, value in list(vars(module).items()):
        if not _kept_attribute(name, value):
            continue
        try:
            dumps(value)
        except Exception:
            continue
        kept[name] = value
    return kept


def _unpicklable(names: Mapping[str, Any], dumps: Any) -> list[str]:
    bad = []
    for name, value in names.items():
        try:
            dumps(value)
        except Exception as exc:  # cloudpickle raises TypeError, PicklingError, ...
            bad.append(f"{name!r} ({type(value).__name__}: {str(exc)[:200]})")
    return bad


def _files(workdir: str, limits: files.FileLimits) -> dict[str, bytes]:
    collected = files.collect(workdir, files.Snapshot({}), ("*",), limits, True)
    if collected.skipped:
        shown = "; ".join(f"{s['path']}: {s['reason']}" for s in collected.skipped[:SHOWN_CULPRITS])
        more = len(collected.skipped) + collected.skipped_more - SHOWN_CULPRITS
        raise SnapshotError(
            "cannot snapshot the working directory: " + shown
            + (f" (and {more} more)" if more > 0 else "")
        )
    return collected.data


def take(namespace: dict[str, Any] | None, workdir: str, limits: files.FileLimits,
         max_bytes: int) -> bytes:
    """The session's state (``namespace``: its names; None before its first run) and
    working directory as one snapshot of at most ``max_bytes``.

    Raises:
        SnapshotError: naming what could not be captured, or the size.
    """
    cloudpickle = _cloudpickle()
    main_globals = namespace if namespace is not None else {"__name__": "__main__"}
    dumps = _dumper(cloudpickle, main_globals)
    names = {k: v for k, v in (namespace or {}).items() if k not in RUNTIME_NAMES}
    modules = {}
    for value in names.values():
        if (isinstance(value, types.ModuleType) and value.__name__ not in modules
                and _module_state_kept(value)):
            modules[value.__name__] = _module_data(value, dumps)
    anchor = types.FunctionType(compile("None", "<snapshot>", "eval"), main_globals)
    try:
        state = dumps({"names": names, "modules": modules, "anchor": anchor}, protocol=5)
    except Exception as exc:
        bad = _unpicklable(names, dumps) or [f"({type(exc).__name__}: {str(exc)[:200]})"]
        more = f" (and {len(bad) - SHOWN_CULPRITS} more)" if len(bad) > SHOWN_CULPRITS else ""
        raise SnapshotError(
            "cannot snapshot the session: these names hold what cannot be pickled: "
            + "; ".join(bad[:SHOWN_CULPRITS]) + more
        ) from None
    if len(state) > max_bytes:
        raise SnapshotError(
            f"the session's state is {len(state)} bytes pickled; the policy allows "
            f"{max_bytes} bytes per snapshot (session.snapshot_max_mb)"
        )
    room = files.FileLimits(
        max_files=files.MAX_WALK_ENTRIES, max_bytes=max_bytes - len(state),
        max_depth=limits.max_depth, max_name_chars=limits.max_name_chars,
        max_path_chars=limits.max_path_chars,
    )
    tree = _files(workdir, room)
    blob: bytes = msgpack.packb(
        {"format": FORMAT, "version": VERSION, "python": _python(), "state": state,
         "files": tree},
        use_bin_type=True,
    )
    if len(blob) > max_bytes:
        raise SnapshotError(
            f"the snapshot is {len(blob)} bytes; the policy allows {max_bytes} bytes per "
            "snapshot (session.snapshot_max_mb)"
        )
    return blob


def _document(blob: bytes) -> dict[str, Any]:
    try:
        doc = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as exc:
        raise SnapshotError(f"this is not a jaild snapshot: {type(exc).__name__}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotError("this is not a jaild snapshot")
    if doc.get("version") != VERSION:
        raise SnapshotError(f"snapshot format version {doc.get('version')!r}; this runtime "
                            f"restores version {VERSION}")
    if doc.get("python") != _python():
        raise SnapshotError(f"the snapshot was taken under Python {doc.get('python')!r}; this "
                            f"jail runs Python {_python()} (code objects do not cross versions)")
    if not isinstance(doc.get("state"), bytes) or not isinstance(doc.get("files"), dict):
        raise SnapshotError("the snapshot's state or files are malformed")
    return doc


def _loads(state: bytes, namespace: dict[str, Any]) -> Any:
    """Load a snapshot's pickle with ``namespace`` standing for :data:`MAIN_GLOBALS`."""
    import pickle

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            if pid == MAIN_GLOBALS:
                return namespace
            raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:100]!r}")

    return Unpickler(io.BytesIO(state)).load()


def restore(blob: bytes, namespace: dict[str, Any], workdir: str,
            limits: files.FileLimits) -> dict[str, Any]:
    """Restore a snapshot into this (fresh) jail: its files into ``workdir``, its names
    into ``namespace`` (the fresh jail's ``__main__`` module's dictionary, holding the
    runtime's names), the globals of the session's functions. Returns that namespace (a
    snapshot taken before this format marked its namespace: the namespace it brought, a
    dictionary of its own, with ``namespace``'s runtime names).

    Raises:
        SnapshotError: the snapshot is not one this runtime restores, or restoring it
            failed (naming what).
    """
    doc = _document(blob)
    room = files.FileLimits(
        max_files=files.MAX_WALK_ENTRIES, max_bytes=len(blob),
        max_depth=limits.max_depth, max_name_chars=limits.max_name_chars,
        max_path_chars=limits.max_path_chars,
    )
    try:
        files.write_uploads(workdir, doc["files"], room)
    except UploadError as exc:
        raise SnapshotError(f"cannot restore the working directory: {exc}") from None
    _cloudpickle()  # its reconstructors are what the state names: say so if it is missing
    try:
        payload = _loads(doc["state"], namespace)
        names, modules, anchor = payload["names"], payload["modules"], payload["anchor"]
        restored: dict[str, Any] = anchor.__globals__
    except Exception as exc:
        raise SnapshotError(
            f"cannot restore the session's state: {type(exc).__name__}: {str(exc)[:500]}"
        ) from None
    for module_name, attrs in modules.items():
        module = sys.modules.get(module_name)
        for attr, value in attrs.items():
            try:
                setattr(module, attr, value)
            except Exception as exc:
                raise SnapshotError(f"cannot restore {module_name}.{attr}: "
                                    f"{type(exc).__name__}: {str(exc)[:200]}") from None
    restored.update(names)
    restored.update({k: v for k, v in namespace.items() if k in RUNTIME_NAMES})
    restored["__name__"] = namespace.get("__name__", "__main__")
    return restored


__all__ = ["FORMAT", "RUNTIME_NAMES", "VERSION", "restore", "take"]
