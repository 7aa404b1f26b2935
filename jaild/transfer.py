"""Files between the client's machine and a jail: what to upload, where downloads go.

The client's side of :mod:`jaild.runtime.files`. Uploads are read here from the
client's own files (trusted, but only regular files: a FIFO or a device would hang
or flood the client). Downloads come from a jail by way of the daemon, which checked
them (:func:`jaild.runtime.files.validate_collected`); :func:`save_files` still
treats every name as hostile and writes with the same discipline as the jail's
uploads -- directory descriptors, ``O_NOFOLLOW`` at every component -- but, being in
the client's own directory, it refuses a symlink it finds instead of removing it.

What a download may replace: a job's output is written into a directory of the user's, so
it must not silently replace what is there. By default an existing file is never written
over (the file is created with ``O_EXCL``, so one that appears meanwhile is kept too);
``overwrite=True`` (``--overwrite``) allows it. Dotfiles -- any path with a component that
starts with ``.``, such as ``.bashrc``, ``.git/hooks/x``, ``.ssh/authorized_keys`` -- are
configuration that shells, editors and tools run or trust; a job's output must never
become one unasked, new or not, so they are written only with ``dotfiles=True``
(``--dotfiles``), and written over only with ``overwrite=True`` as well.
:func:`refusals` lists, before anything is written, which files would be refused and why,
so that a caller (the CLI) may write the others and report those by name.
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
           "is_dotfile", "load_uploads", "refusals", "save_files"]

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


def is_dotfile(path: str) -> bool:
    """Whether a downloaded path has a component starting with ``.`` (hidden: a dotfile
    or inside a dot-directory)."""
    return any(name.startswith(".") for name in path.split("/"))


def refusals(dest_dir: str, files: Mapping[str, bytes], *, overwrite: bool = False,
             dotfiles: bool = False) -> dict[str, str]:
    """The files :func:`save_files` would refuse to protect what is in ``dest_dir``.

    Args:
        dest_dir: the download directory (need not exist yet).
        files: ``{relative path: contents}`` as the jail named them (checked names).
        overwrite: existing files may be written over.
        dotfiles: paths with a hidden component may be written.

    Returns:
        ``{path: reason}``: each existing file (unless ``overwrite``), each dotfile (unless
        ``dotfiles``), the reason saying what to pass to allow it. Other problems (a
        symlink or a directory in the way) are not listed: :func:`save_files` raises them.
    """
    existing = (_check_existing(dest_dir, files, raise_problems=False)
                if os.path.isdir(dest_dir) else set())
    return _refusals(dest_dir, files, existing, overwrite, dotfiles)


def _refusals(dest_dir: str, files: Mapping[str, bytes], existing: set[str], overwrite: bool,
              dotfiles: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    dotfile = ("a dotfile (a name in it starts with '.'), which shells and tools read as "
               "configuration")
    for path in sorted(files):
        kept = path in existing and not overwrite
        if is_dotfile(path) and not dotfiles:
            out[path] = (f"{dotfile}; it already exists in {dest_dir!r} and is kept; pass "
                         "--dotfiles and --overwrite (dotfiles=True, overwrite=True) to "
                         "replace it" if kept else
                         f"{dotfile}; pass --dotfiles (dotfiles=True) to write it")
        elif kept:
            out[path] = (f"it already exists in {dest_dir!r} and is kept; pass --overwrite "
                         "(overwrite=True) to replace it")
    return out


def save_files(dest_dir: str, files: Mapping[str, bytes],
               limits: FileLimits | None = None, *, overwrite: bool = False,
               dotfiles: bool = False) -> list[str]:
    """Write downloaded files below ``dest_dir`` (made if missing).

    Every name is checked before anything is written: absolute paths, ``..``, empty
    components, control characters and the like are refused; so is a symlink already
    in ``dest_dir`` at any component of a path (it is neither followed nor removed),
    a non-directory where a directory must go, and a directory, FIFO, socket, device
    or hard-linked file where a file must go. Writing never follows a symlink either
    (directory descriptors, ``O_NOFOLLOW``), so a link planted while it writes cannot
    lead outside ``dest_dir``. An existing regular file is refused unless ``overwrite``
    (and a file is created ``O_EXCL``, so one appearing meanwhile is kept); a dotfile is
    refused unless ``dotfiles`` (see the module docstring; :func:`refusals` lists both).

    Args:
        dest_dir: the client's directory (trusted: it may itself be a symlink).
        files: ``{relative path: contents}`` as the jail named them.
        limits: the limits to check the names, count and size against; by default
            :data:`WIDEST_LIMITS`.
        overwrite: write over existing regular files.
        dotfiles: write paths with a component starting with ``.``.

    Returns:
        The local paths written (``dest_dir`` joined with each relative path), sorted.

    Raises:
        UnsafePath: names the path and the reason (for a file in the way or a dotfile,
            what to pass to allow it); before anything was written.
    """
    limits = limits or WIDEST_LIMITS
    problem = check_file_set(files, limits)
    if problem is not None:
        raise UnsafePath(*problem)
    os.makedirs(dest_dir, exist_ok=True)
    refused = _refusals(dest_dir, files, _check_existing(dest_dir, files), overwrite, dotfiles)
    if refused:
        path = min(refused)
        raise UnsafePath(path, refused[path])
    written = write_tree(dest_dir, files, False, UnsafePath, exclusive=not overwrite)
    return [os.path.join(dest_dir, path) for path in written]


def _check_existing(dest_dir: str, files: Mapping[str, bytes],
                    raise_problems: bool = True) -> set[str]:
    """Refuse, before writing anything, what is already in the way in ``dest_dir``, and
    return the paths where a regular file already is (that writing would replace).
    Looks without following: ``lstat`` and ``O_NOFOLLOW`` opens by directory fd. Without
    ``raise_problems`` a path with something else in the way is skipped, not raised."""
    existing: set[str] = set()
    root_fd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path in sorted(files):
            try:
                if _exists_at(root_fd, dest_dir, path):
                    existing.add(path)
            except UnsafePath:
                if raise_problems:
                    raise
    finally:
        os.close(root_fd)
    return existing


def _exists_at(root_fd: int, dest_dir: str, path: str) -> bool:
    """Whether a regular file (of one link) is at ``path`` below ``root_fd``; UnsafePath
    for anything else in the way."""
    *dirs, leaf = path.split("/")
    fd = os.dup(root_fd)
    try:
        for name in dirs:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return False  # made when written
            if not stat.S_ISDIR(st.st_mode):
                what = _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else "a file"
                raise UnsafePath(path, f"{name!r} in {dest_dir!r} is {what}, not a directory")
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                            dir_fd=fd)
            os.close(fd)
            fd = child
        try:
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePath(path, "a directory is in the way")
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(path, f"{_kind(st.st_mode)} is in the way")
        if st.st_nlink > 1:
            raise UnsafePath(path, "a hard-linked file is in the way; "
                                   "writing would change its other names too")
        return True
    except OSError as exc:
        raise UnsafePath(path, f"cannot look at what is in the way: {exc.strerror}") from exc
    finally:
        os.close(fd)
