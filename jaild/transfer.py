"""Files between the client's machine and a jail: what to upload, where downloads go.

The client's side of :mod:`jaild.runtime.files`. Uploads are read here from the
client's own files (trusted, but only regular files: a FIFO or a device would hang
or flood the client). Downloads come from a jail by way of the daemon, which checked
them (:func:`jaild.runtime.files.validate_collected`); :func:`save_files` still
treats every name as hostile and writes with the same discipline as the jail's
uploads -- directory descriptors, ``O_NOFOLLOW`` at every component -- but, being in
the client's own directory, it refuses a symlink it finds instead of removing it.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TypeAlias

from jaild.errors import UnsafePath, UploadError, display
from jaild.runtime.files import (
    FileLimits,
    check_file_set,
    check_path,
    special_kind,
    write_tree,
)

__all__ = ["WIDEST_LIMITS", "FileLimits", "UnsafePath", "UploadError", "Uploads",
           "load_uploads", "save_files"]

WIDEST_LIMITS = FileLimits(
    max_files=1 << 16, max_bytes=sys.maxsize, max_depth=64, max_name_chars=255,
    max_path_chars=4096,
)
"""What any path must respect when no policy's limits are given: the widest ``[files]``
section a policy can have (jaild/policy/schema.py), with no bound on bytes."""

LocalPath: TypeAlias = str | os.PathLike[str]
Source: TypeAlias = bytes | bytearray | memoryview | LocalPath  # contents, or a local path
Uploads: TypeAlias = Mapping[str, Source] | Iterable[LocalPath] | LocalPath
"""What :func:`load_uploads` takes: ``{jail path: contents or local path}``, or local paths."""

_LOCAL_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _kind(mode: int) -> str:
    kind = special_kind(mode) or "directory"
    return kind if kind.startswith("not ") else f"a {kind}"


def _read_local(local: str, jail_path: str, follow: bool) -> bytes:
    """The contents of the client's regular file ``local``; never blocks on a FIFO."""
    flags = _LOCAL_READ_FLAGS | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(local, flags)
    except OSError as exc:
        raise UploadError(jail_path, f"cannot read {local!r}: {exc.strerror}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UploadError(jail_path, f"{local!r} is {_kind(mode)}, not a regular file; "
                                         "only regular files can be uploaded")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise UploadError(jail_path, f"cannot read {local!r}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def load_uploads(items: Uploads, limits: FileLimits | None = None) -> dict[str, bytes]:
    """Gather files to upload into a jail's working directory.

    Args:
        items: either a map ``{jail path: source}`` where a source is the contents
            (bytes) or a local path (str or PathLike: a file, or a directory uploaded
            recursively below that jail path); or local paths (one, or an iterable),
            each uploaded under its base name -- a directory recursively, relative to
            its parent (``/x/data`` gives ``data/...``). Symlinks inside a directory
            are refused, not followed; a path given explicitly is followed. Empty
            directories are not uploaded.
        limits: the policy's ``[files]`` limits, to fail here rather than at the
            daemon; without them only the widest limits apply (:data:`WIDEST_LIMITS`).

    Returns:
        ``{jail path: contents}``, ready for the daemon.

    Raises:
        UploadError: a bad jail path, a path given twice, a local file that is not a
            regular file (FIFO, socket, device) or a symlink inside a directory, a
            local file that cannot be read, or more files or bytes than ``limits``.
    """
    limits = limits or WIDEST_LIMITS
    out: dict[str, bytes] = {}
    total = 0

    def add(jail_path: str, content: bytes) -> None:
        nonlocal total
        reason = check_path(jail_path, limits)
        if reason is not None:
            raise UploadError(jail_path, reason)
        if jail_path in out:
            raise UploadError(jail_path, "given twice")
        if len(out) >= limits.max_files:
            raise UploadError(jail_path, f"more than {limits.max_files} files (max_files)")
        total += len(content)
        if total > limits.max_bytes:
            raise UploadError(jail_path, f"more than {limits.max_bytes} bytes in all (max_bytes)")
        out[jail_path] = content

    if isinstance(items, (str, os.PathLike)):
        items = [items]
    if isinstance(items, Mapping):
        for jail_path, source in items.items():
            if not isinstance(jail_path, str):
                raise UploadError(display(repr(jail_path)), "a jail path must be a str")
            if isinstance(source, (bytes, bytearray, memoryview)):
                add(jail_path, bytes(source))
            elif isinstance(source, (str, os.PathLike)):
                _add_local(os.fspath(source), jail_path, add)
            else:
                raise UploadError(jail_path, "expected the contents (bytes) or a local path, "
                                             f"not {type(source).__name__}")
    else:
        for source in items:
            if not isinstance(source, (str, os.PathLike)):
                raise UploadError("", f"expected a local path, not {type(source).__name__}; "
                                      "to upload contents, pass {jail path: bytes}")
            local = os.fspath(source)
            name = os.path.basename(os.path.abspath(local))
            if not name:
                raise UploadError("", f"{local!r} has no name to upload it under; "
                                      "pass {jail path: local path}")
            _add_local(local, name, add)
    problem = check_file_set(out, limits)  # a file that is also a directory
    if problem is not None:
        raise UploadError(*problem)
    return out


def _add_local(local: str, jail_path: str, add: Callable[[str, bytes], None]) -> None:
    try:
        st = os.stat(local)
    except OSError as exc:
        raise UploadError(jail_path, f"cannot read {local!r}: {exc.strerror}") from exc
    if stat.S_ISDIR(st.st_mode):
        _add_dir(local, jail_path, add)
    else:
        add(jail_path, _read_local(local, jail_path, follow=True))


def _add_dir(local: str, jail_prefix: str, add: Callable[[str, bytes], None]) -> None:
    try:
        with os.scandir(local) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        raise UploadError(jail_prefix, f"cannot list {local!r}: {exc.strerror}") from exc
    for entry in entries:
        jail_path = f"{jail_prefix}/{entry.name}"
        reason = check_path(jail_path, WIDEST_LIMITS)  # before going deeper
        if reason is not None:
            raise UploadError(jail_path, reason)
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode):
            _add_dir(entry.path, jail_path, add)
        elif stat.S_ISREG(mode):
            add(jail_path, _read_local(entry.path, jail_path, follow=False))
        else:
            raise UploadError(jail_path, f"{entry.path!r} is {_kind(mode)}; only regular files "
                                         "and directories are uploaded (give a link's target "
                                         "explicitly)")


def save_files(dest_dir: str, files: Mapping[str, bytes],
               limits: FileLimits | None = None) -> list[str]:
    """Write downloaded files below ``dest_dir`` (made if missing).

    Every name is checked before anything is written: absolute paths, ``..``, empty
    components, control characters and the like are refused; so is a symlink already
    in ``dest_dir`` at any component of a path (it is neither followed nor removed),
    a non-directory where a directory must go, and a directory, FIFO, socket, device
    or hard-linked file where a file must go. Writing never follows a symlink either
    (directory descriptors, ``O_NOFOLLOW``), so a link planted while it writes cannot
    lead outside ``dest_dir``. An existing regular file is overwritten.

    Args:
        dest_dir: the client's directory (trusted: it may itself be a symlink).
        files: ``{relative path: contents}`` as the jail named them.
        limits: the limits to check the names, count and size against; by default
            :data:`WIDEST_LIMITS`.

    Returns:
        The local paths written (``dest_dir`` joined with each relative path), sorted.

    Raises:
        UnsafePath: names the path and the reason; before anything was written.
    """
    limits = limits or WIDEST_LIMITS
    problem = check_file_set(files, limits)
    if problem is not None:
        raise UnsafePath(*problem)
    os.makedirs(dest_dir, exist_ok=True)
    _check_existing(dest_dir, files)
    written = write_tree(dest_dir, files, False, UnsafePath)
    return [os.path.join(dest_dir, path) for path in written]


def _check_existing(dest_dir: str, files: Mapping[str, bytes]) -> None:
    """Refuse, before writing anything, what is already in the way in ``dest_dir``.
    Looks without following: ``lstat`` and ``O_NOFOLLOW`` opens by directory fd."""
    root_fd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path in sorted(files):
            *dirs, leaf = path.split("/")
            fd = os.dup(root_fd)
            try:
                for name in dirs:
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        break  # made when written
                    if not stat.S_ISDIR(st.st_mode):
                        what = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else "a file"
                        raise UnsafePath(path, f"{name!r} in {dest_dir!r} is {what}, "
                                               "not a directory")
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                    | os.O_CLOEXEC, dir_fd=fd)
                    os.close(fd)
                    fd = child
                else:
                    try:
                        st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        raise UnsafePath(path, "a directory is in the way")
                    if not stat.S_ISREG(st.st_mode):
                        raise UnsafePath(path, f"{_kind(st.st_mode)} is in the way")
                    if st.st_nlink > 1:
                        raise UnsafePath(path, "a hard-linked file is in the way; "
                                               "writing would change its other names too")
            except OSError as exc:
                raise UnsafePath(path, f"cannot look at what is in the way: {exc.strerror}"
                                 ) from exc
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
