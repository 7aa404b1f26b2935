"""Files in and out of a jail's working directory, without ever following a link.

Theory of operation
-------------------
The daemon never touches a jail's filesystem: host code that opens paths inside a
tree the jail controls follows whatever links the jail planted there (the Judge0
escapes of 2024). Instead, every file operation on the working directory happens
*inside* the jail, in this module, and only plain values cross the channel:

1. Uploads arrive as ``{relative path: bytes}``. :func:`write_uploads` checks them
   all (:func:`check_path`, count, total size, no path both a file and a directory)
   before it writes anything, then writes them through directory file descriptors
   with ``O_NOFOLLOW`` at every component: a symlink met on the way is removed and
   replaced, never followed.
2. :func:`snapshot` records what the tree holds before the user's code runs (an
   ``lstat`` walk: device, inode, mtime, size, ctime per entry).
3. After the run, :func:`collect` walks the tree again -- by directory file
   descriptors, never following a symlink -- and lists the regular files created or
   modified since the snapshot (path, size, sha256), with the contents of the files
   that match the client's patterns. Everything it refuses (links, FIFOs, sockets,
   devices, hard links, sparse files, bad names, anything over the limits, files that
   change while being read) is reported in ``skipped`` with a reason; it never raises.
4. The user's code ran in the same process as the runtime and may have replaced any
   of the above, so the host treats the jail's answer as hostile:
   :func:`validate_collected` turns any value at all into a :class:`Collected` that
   respects the limits, dropping (and reporting) what it cannot vouch for.

The limits (:class:`FileLimits`, the policy's ``[files]`` section) apply to uploads
and downloads alike:

* depth is the number of path components: ``"f"`` is 1, ``"d/f"`` is 2;
* names and paths are measured in UTF-8 bytes;
* ``max_files`` counts the distinct paths the host receives (listed, or carried with
  their contents, or both); ``max_bytes`` counts the contents carried.

This module imports only the standard library: the in-jail runtime and host code
both use it.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TypedDict

from jaild.errors import MAX_DISPLAY_CHARS, UploadError, display

MAX_WALK_ENTRIES = 100_000
"""A walk (snapshot or collect) looks at no more entries than this, then stops."""
MAX_SKIPPED = 100
"""Refused entries reported one by one; beyond that, only counted (``skipped_more``)."""
SPARSE_SLACK_BYTES = 4096
"""A file is sparse if its allocated blocks fall short of its size by more than this."""
MAX_READ_BYTES = 1 << 30
"""A collect reads (to hash, or to send) at most this many bytes in all: a run that fills
a large tmpfs does not keep its jail hashing for minutes. Files beyond are skipped."""

_READ_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_WRITE_FLAGS = (  # no O_TRUNC: the file is truncated once fstat says it is ours alone
    os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LIMIT_NAMES = ("max_files", "max_bytes", "max_depth", "max_name_chars", "max_path_chars")


@dataclass(frozen=True)
class FileLimits:
    """What may be uploaded into, or collected from, one run's working directory."""

    max_files: int  # files per run (uploaded, or collected: listed and/or carried)
    max_bytes: int  # total bytes of contents per run
    max_depth: int  # path components: "f" is 1, "d/f" is 2
    max_name_chars: int  # UTF-8 bytes per path component
    max_path_chars: int  # UTF-8 bytes of the whole relative path

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "max_bytes" else 1
            if type(value) is not int or value < least:
                raise ValueError(f"FileLimits.{f.name} must be an int >= {least}, not {value!r}")

    def to_wire(self) -> dict[str, int]:
        """The limits as a plain map, for the channel."""
        return {name: getattr(self, name) for name in _LIMIT_NAMES}

    @classmethod
    def from_wire(cls, wire: object) -> FileLimits:
        """Rebuild limits from :meth:`to_wire`'s map (or ``dataclasses.asdict`` of the
        policy's ``[files]`` section).

        Raises:
            ValueError: not a map of exactly the five limits, each an int >= 1
                (``max_bytes`` >= 0).
        """
        if not isinstance(wire, Mapping) or set(wire) != set(_LIMIT_NAMES):
            raise ValueError(f"file limits must be a map of exactly {', '.join(_LIMIT_NAMES)}")
        return cls(**{name: wire[name] for name in _LIMIT_NAMES})


class ListedFile(TypedDict):
    path: str
    size: int
    sha256: str


class SkippedEntry(TypedDict):
    path: str  # for display only: undecodable bytes and control characters escaped, clipped
    reason: str


@dataclass(frozen=True)
class Snapshot:
    """What the tree held: relative path -> (st_dev, st_ino, st_mtime_ns, st_size,
    st_ctime_ns), for everything but directories. ``truncated``: the walk stopped at
    :data:`MAX_WALK_ENTRIES`, so files missing from ``entries`` may be old ones (and
    :func:`collect` will list them as new)."""

    entries: dict[str, tuple[int, int, int, int, int]] = field(default_factory=dict)
    truncated: bool = False


@dataclass
class Collected:
    """What a run left: ``files`` (created or modified regular files, sorted by path),
    ``data`` (contents of the files matching the patterns), ``skipped`` (what was
    refused, at most :data:`MAX_SKIPPED`) and ``skipped_more`` (how many more were)."""

    files: list[ListedFile] = field(default_factory=list)
    data: dict[str, bytes] = field(default_factory=dict)
    skipped: list[SkippedEntry] = field(default_factory=list)
    skipped_more: int = 0

    def to_wire(self) -> dict[str, object]:
        """Plain types only (msgpack carries them as they are)."""
        return {
            "files": [dict(f) for f in self.files],
            "data": dict(self.data),
            "skipped": [dict(s) for s in self.skipped],
            "skipped_more": self.skipped_more,
        }

    def skip(self, path: str, reason: str) -> None:
        """Report a refused entry (the first :data:`MAX_SKIPPED`; the rest are counted)."""
        if len(self.skipped) < MAX_SKIPPED:
            self.skipped.append({"path": display(path), "reason": display(reason)})
        else:
            self.skipped_more += 1


# --- paths -------------------------------------------------------------------------


def check_path(path: object, limits: FileLimits) -> str | None:
    """Why ``path`` is not an acceptable relative path under ``limits``, or None if it is.

    Accepted: a str of "/"-separated components, none empty, ``.`` or ``..``; no
    leading "/", no backslash, no control character (C0, DEL, C1, which includes
    NUL and newline); encodable as UTF-8 (no lone surrogate); each component at most
    ``max_name_chars`` UTF-8 bytes, the whole at most ``max_path_chars``, at most
    ``max_depth`` components.
    """
    if not isinstance(path, str):
        return "not a string"
    if not path:
        return "empty path"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8"
    if "\0" in path:
        return "NUL in name"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in path):
        return "control character in name"
    if "\\" in path:
        return "backslash in name"
    if path.startswith("/"):
        return "absolute path"
    if len(encoded) > limits.max_path_chars:
        return f"path longer than {limits.max_path_chars} bytes"
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            return f"{part!r} component" if part else "empty component"
        if len(part.encode("utf-8")) > limits.max_name_chars:
            return f"name longer than {limits.max_name_chars} bytes"
    if len(parts) > limits.max_depth:
        return f"deeper than {limits.max_depth} levels"
    return None


def _prefix_conflict(paths: Sequence[str]) -> tuple[str, str] | None:
    """A (path, reason) if some path is also a directory of another path."""
    as_files = set(paths)
    for path in sorted(paths):
        parts = path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in as_files:
                return path, f"{parent!r} is also a file in this set"
    return None


def check_file_set(files: object, limits: FileLimits) -> tuple[str, str] | None:
    """Why the whole set ``{path: bytes}`` cannot be written as one tree under
    ``limits``: a (path, reason) for the first problem, or None.

    Checks every path (:func:`check_path`), that every value is bytes, the count,
    the total size, and that no path is also a parent directory of another.
    """
    if not isinstance(files, Mapping):
        return "", "the files are not a map of path to bytes"
    total = 0
    for count, (path, content) in enumerate(sorted(files.items(), key=lambda kv: str(kv[0])), 1):
        reason = check_path(path, limits)
        if reason is not None:
            return display(str(path)), reason
        if not isinstance(content, bytes):
            return path, "contents are not bytes"
        if count > limits.max_files:
            return path, f"more than {limits.max_files} files (max_files)"
        total += len(content)
        if total > limits.max_bytes:
            return path, f"more than {limits.max_bytes} bytes in all (max_bytes)"
    return _prefix_conflict(list(files))


# --- writing -----------------------------------------------------------------------


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


ErrorFactory = Callable[[str, str], Exception]
"""Builds the error to raise for (path, reason): :class:`UploadError`, or the caller's."""


def _open_dir_at(dir_fd: int, name: str, path: str, replace_links: bool,
                 error: ErrorFactory) -> int:
    """Open directory ``name`` below ``dir_fd`` (creating it if missing), never
    following a symlink: one found there is removed if ``replace_links``, else refused."""
    for _attempt in range(3):
        st = _lstat_at(dir_fd, name)
        made = st is None
        if st is None:
            try:
                os.mkdir(name, 0o755, dir_fd=dir_fd)
            except FileExistsError:
                continue  # made since the lstat: look again
        elif stat.S_ISLNK(st.st_mode):
            if not replace_links:
                raise error(path, f"{name!r} is a symlink; refusing to follow or remove it")
            os.unlink(name, dir_fd=dir_fd)
            continue
        elif not stat.S_ISDIR(st.st_mode):
            raise error(path, f"{name!r} is in the way: it is not a directory")
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                raise
            continue  # replaced since the lstat (a symlink now, or gone): look again
        if made:
            os.fchmod(fd, 0o755)  # whatever the umask
        return fd
    raise error(path, f"{name!r} keeps changing")


def _write_leaf(dir_fd: int, leaf: str, content: bytes, path: str, replace_links: bool,
                error: ErrorFactory, exclusive: bool = False) -> None:
    for _attempt in range(3):
        st = _lstat_at(dir_fd, leaf)
        if st is not None:
            if exclusive and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                raise error(path, "a file of that name appeared while writing; it is kept")
            if stat.S_ISDIR(st.st_mode):
                raise error(path, "a directory is in the way")
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                kind = _kind(st) or "hard link"
                if not replace_links:
                    raise error(path, f"a {kind} is in the way; refusing to write through it")
                os.unlink(leaf, dir_fd=dir_fd)  # never write through it: replace it
        try:
            fd = os.open(leaf, _WRITE_FLAGS | (os.O_EXCL if exclusive else 0), 0o644,
                         dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EEXIST):
                raise
            continue  # a symlink or a file since the lstat: look again
        break
    else:
        raise error(path, f"{leaf!r} keeps changing")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise error(path, "replaced by something else while being written")
        os.ftruncate(fd, 0)  # only now: O_TRUNC would have cut a hard link's other names
        os.fchmod(fd, 0o644)  # whatever the umask, and for a file that was there
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def write_tree(root: str, files: Mapping[str, bytes], replace_links: bool,
               error: ErrorFactory, exclusive: bool = False) -> list[str]:
    """Write ``files`` (already checked by :func:`check_file_set`) below ``root``.

    Every component is opened relative to its parent's descriptor with ``O_NOFOLLOW``.
    A symlink found where a directory or the file must go (or, for the file, a FIFO,
    socket, device or hard link) is removed first if ``replace_links``, else
    ``error(path, reason)`` is raised. A directory where the file must go, or a
    non-directory where a directory must go, always raises; so does an OS error
    (the reason says which). Files are 0o644, directories made here 0o755.
    ``root`` itself is trusted (it may be a symlink). With ``exclusive`` a file is only
    ever created (``O_EXCL``), never written over: one found there raises. Returns the
    paths written.
    """
    written: list[str] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise error("", f"cannot open {root!r}: {exc.strerror}") from exc
    try:
        for path in sorted(files):
            *dirs, leaf = path.split("/")
            fd = os.dup(root_fd)
            try:
                for name in dirs:
                    child = _open_dir_at(fd, name, path, replace_links, error)
                    os.close(fd)
                    fd = child
                _write_leaf(fd, leaf, files[path], path, replace_links, error, exclusive)
            except OSError as exc:
                raise error(path, f"cannot write it: {exc.strerror}") from exc
            finally:
                os.close(fd)
            written.append(path)
    finally:
        os.close(root_fd)
    return written


def write_uploads(root: str, files: Mapping[str, bytes], limits: FileLimits) -> None:
    """Write uploaded files below ``root`` (the jail's working directory).

    Everything is checked before anything is written. No symlink on the way is ever
    followed: one found at a directory component or at the file itself is removed
    and replaced.

    Args:
        root: the directory to write into (trusted: it may itself be a symlink).
        files: relative "/"-separated path -> contents.
        limits: the policy's ``[files]`` limits.

    Raises:
        UploadError: a bad path, too many files or bytes, a path that is both a file
            and a directory; a directory where a file must go or a non-directory where
            a directory must go; or an OS error while writing (the message says which).
    """
    problem = check_file_set(files, limits)
    if problem is not None:
        raise UploadError(*problem)
    write_tree(root, files, True, UploadError)


# --- walking -----------------------------------------------------------------------


def _kind(st: os.stat_result) -> str | None:
    """None for a regular file or a directory, else the reason to refuse it."""
    return special_kind(st.st_mode)


def special_kind(mode: int) -> str | None:
    """None for a regular file or a directory, else what it is: symlink, fifo, socket,
    device, or "not a regular file"."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "not a regular file"


def _key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns)


@dataclass
class _Entry:
    path: str  # relative, "/"-joined; undecodable bytes as surrogate escapes
    name: str  # the name in its directory, for *at calls
    dir_fd: int  # valid until the walk moves on
    stat: os.stat_result


class _Walk:
    """A bounded walk by directory descriptors that never follows a symlink.

    Yields every non-directory entry; descends into directories whose children can
    be at most ``max_depth`` deep; reports what it cannot enter through ``problem``.
    """

    def __init__(self, limits: FileLimits, problem: Callable[[str, str], None]) -> None:
        self.limits = limits
        self.problem = problem
        self.seen = 0
        self.truncated = False

    def run(self, root: str) -> Iterator[_Entry]:
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            self.problem(".", f"unreadable directory: {exc.strerror}")
            return
        try:
            yield from self._dir(fd, "", 0)
        finally:
            os.close(fd)

    def _dir(self, fd: int, prefix: str, depth: int) -> Iterator[_Entry]:
        try:
            with os.scandir(fd) as it:
                entries: list[os.DirEntry[str]] = []
                for entry in it:
                    if self.seen + len(entries) >= MAX_WALK_ENTRIES:
                        self.truncated = True
                        break
                    entries.append(entry)
        except OSError as exc:
            self.problem(prefix or ".", f"unreadable directory: {exc.strerror}")
            return
        self.seen += len(entries)
        entries.sort(key=lambda e: e.name)
        for entry in entries:
            text = os.fsencode(entry.name).decode("utf-8", "surrogateescape")
            path = f"{prefix}/{text}" if prefix else text
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            if not stat.S_ISDIR(st.st_mode):
                yield _Entry(path, entry.name, fd, st)
                continue
            reason = check_path(path, self.limits)
            if reason is not None:
                self.problem(path, reason)
                continue
            if depth + 1 >= self.limits.max_depth:
                self.problem(path, "too deep")
                continue
            try:
                child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):  # swapped or gone
                    self.problem(path, "changed while reading")
                else:
                    self.problem(path, f"unreadable directory: {exc.strerror}")
                continue
            try:
                now = os.fstat(child)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    self.problem(path, "changed while reading")
                    continue
                yield from self._dir(child, path, depth + 1)
            finally:
                os.close(child)
            if self.truncated:
                return


def snapshot(root: str, limits: FileLimits) -> Snapshot:
    """Record what ``root`` holds, to tell later what a run created or changed.

    An ``lstat`` walk that never follows a symlink, bounded by ``limits.max_depth``
    and :data:`MAX_WALK_ENTRIES`. Never raises on what it finds (an unreadable
    ``root`` gives an empty snapshot).
    """
    walk = _Walk(limits, lambda path, reason: None)
    entries = {entry.path: _key(entry.stat) for entry in walk.run(root)}
    return Snapshot(entries, walk.truncated)


def _read(entry: _Entry, keep: bool) -> tuple[str, bytes | None] | str:
    """(sha256 hex, contents if ``keep``) of a regular file, or the reason it cannot be
    vouched for. Reads at most size + 1 bytes, from a descriptor that is checked to be
    the very file the walk saw."""
    before = entry.stat
    try:
        fd = os.open(entry.name, _READ_FLAGS, dir_fd=entry.dir_fd)
    except FileNotFoundError:
        return "changed while reading"
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink now
            return "changed while reading"
        return f"unreadable: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or (st.st_dev, st.st_ino, st.st_size) != (before.st_dev, before.st_ino, before.st_size)
        ):
            return "changed while reading"
        if st.st_nlink > 1:
            return "hard link"
        digest = hashlib.sha256()
        chunks: list[bytes] = []
        left = before.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, _READ_CHUNK))
            if not chunk:
                break
            left -= len(chunk)
            digest.update(chunk)
            if keep:
                chunks.append(chunk)
        after = os.fstat(fd)
        if left != 1 or _key(after) != _key(st):
            return "changed while reading"
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    finally:
        os.close(fd)
    return digest.hexdigest(), (b"".join(chunks) if keep else None)


def _matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    if isinstance(patterns, str):  # one pattern, not a sequence of one-letter ones
        patterns = [patterns]
    regexes = [re.compile(fnmatch.translate(p)) for p in patterns if isinstance(p, str)]
    return lambda path: any(r.match(path) for r in regexes)


def collect(root: str, before: Snapshot, patterns: Sequence[str],
            limits: FileLimits, changed_too: bool = False) -> Collected:
    """What the run left in ``root``: a listing of what it created or changed, and the
    contents of what the client asked for.

    Args:
        root: the working directory.
        before: :func:`snapshot` of ``root`` taken before the run.
        patterns: which files to send, fnmatch-style against the relative path
            (``*`` matches across "/" too: ``"*.csv"`` is every CSV at any depth;
            ``["*"]`` is everything; ``[]`` is nothing). Changed or not.
        limits: the policy's ``[files]`` limits.
        changed_too: also send every file created or changed (as if it matched).

    Returns:
        ``files``: regular files created or modified since ``before`` (sorted by
        path); ``data``: contents of regular files matching ``patterns``;
        ``skipped``: what was refused and why. A matched file too large for what is
        left of ``max_bytes`` is still listed (if changed) and reported "too large".
        Files are read (hashed, or sent) up to :data:`MAX_READ_BYTES` in all.
        Only created, changed or matched entries are considered (directories always
        are: a refused one is reported).

    Never raises because of what the tree holds.
    """
    out = Collected()
    walk = _Walk(limits, out.skip)
    matches = _matcher(patterns)
    count = 0
    bytes_left = limits.max_bytes
    read_left = MAX_READ_BYTES
    for entry in walk.run(root):
        st = entry.stat
        changed = before.entries.get(entry.path) != _key(st)
        wanted = matches(entry.path) or (changed_too and changed)
        if not (changed or wanted):
            continue
        reason = _kind(st) or check_path(entry.path, limits)
        if reason is None and st.st_nlink > 1:
            reason = "hard link"
        if reason is None and st.st_blocks * 512 + SPARSE_SLACK_BYTES < st.st_size:
            reason = "sparse file"
        if reason is None and count >= limits.max_files:
            reason = "too many files"
        if reason is not None:
            out.skip(entry.path, reason)
            continue
        send = wanted and st.st_size <= bytes_left
        if wanted and not send:
            out.skip(entry.path, f"too large: {st.st_size} bytes, {bytes_left} left of max_bytes")
            if not changed:
                continue
        if st.st_size > read_left:
            out.skip(entry.path, f"too large to read: the walk reads {MAX_READ_BYTES} bytes in all")
            continue
        got = _read(entry, send)
        if isinstance(got, str):
            out.skip(entry.path, got)
            continue
        read_left -= st.st_size
        sha256, content = got
        count += 1
        if changed:
            out.files.append({"path": entry.path, "size": st.st_size, "sha256": sha256})
        if content is not None:
            out.data[entry.path] = content
            bytes_left -= len(content)
    if walk.truncated:
        out.skip(".", f"walk stopped after {MAX_WALK_ENTRIES} entries")
    out.files.sort(key=lambda f: f["path"])
    return out


# --- the host's side ----------------------------------------------------------------


def validate_collected(wire: object, limits: FileLimits) -> Collected:
    """The jail's :meth:`Collected.to_wire`, checked as hostile input.

    Whatever ``wire`` is, the result respects ``limits``: every path passes
    :func:`check_path` and appears at most once in ``files``; every listed size and
    sha256 agrees with the contents carried for it; at most ``max_files`` distinct
    paths, at most ``max_bytes`` of contents. What is dropped is reported first in
    ``skipped`` with the reason "refused by the daemon: <why>", followed by the jail's
    own (sanitised) skipped entries. Never raises.
    """
    out = Collected()

    def refuse(path: object, why: str) -> None:
        out.skip(path if isinstance(path, str) else repr(path)[:MAX_DISPLAY_CHARS],
                 f"refused by the daemon: {why}")

    if not isinstance(wire, Mapping):
        refuse("", "the jail's file listing is not a map")
        return out
    wire_files = wire.get("files", [])
    wire_data = wire.get("data", {})
    wire_skipped = wire.get("skipped", [])
    wire_more = wire.get("skipped_more", 0)

    listed: dict[str, ListedFile] = {}
    twice: set[str] = set()
    if isinstance(wire_files, list):
        for item in wire_files:
            path = item.get("path") if isinstance(item, Mapping) else None
            reason = check_path(path, limits)
            if reason is not None:
                refuse(path, f"bad path: {reason}")
                continue
            assert isinstance(path, str) and isinstance(item, Mapping)
            size, sha256 = item.get("size"), item.get("sha256")
            if set(item) != {"path", "size", "sha256"}:
                refuse(path, "malformed listing entry")
            elif type(size) is not int or not 0 <= size < 1 << 63:
                refuse(path, "bad size")
            elif not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
                refuse(path, "bad sha256")
            elif path in listed or path in twice:
                refuse(path, "listed more than once")
                twice.add(path)  # which one is true? neither
            else:
                listed[path] = {"path": path, "size": size, "sha256": sha256}
        for path in twice:
            listed.pop(path, None)
    else:
        refuse("", "the listing is not a list")

    data: dict[str, bytes] = {}
    if isinstance(wire_data, Mapping):
        for path, content in wire_data.items():
            reason = check_path(path, limits)
            if reason is not None:
                refuse(path, f"bad path: {reason}")
            elif not isinstance(content, bytes):
                refuse(path, "contents are not bytes")
            else:
                data[path] = content
    else:
        refuse("", "the contents are not a map")

    for path in sorted(set(listed) & set(data)):
        entry, content = listed[path], data[path]
        if entry["size"] != len(content):
            why = "the listed size disagrees with the contents"
        elif entry["sha256"] != hashlib.sha256(content).hexdigest():
            why = "the listed sha256 disagrees with the contents"
        else:
            continue
        refuse(path, why)
        del listed[path], data[path]

    bytes_left = limits.max_bytes
    kept = 0
    for path in sorted(set(listed) | set(data)):
        if kept >= limits.max_files:
            refuse(path, f"more than {limits.max_files} files (max_files)")
            listed.pop(path, None)
            data.pop(path, None)
            continue
        kept += 1
        if path in data:
            if len(data[path]) > bytes_left:
                refuse(path, f"contents over what is left of {limits.max_bytes} bytes (max_bytes)")
                del data[path]
            else:
                bytes_left -= len(data[path])
    out.files = [listed[path] for path in sorted(listed)]
    out.data = data

    if isinstance(wire_skipped, list):
        for item in wire_skipped:
            if (isinstance(item, Mapping) and isinstance(item.get("path"), str)
                    and isinstance(item.get("reason"), str)):
                out.skip(item["path"], item["reason"])
            else:
                out.skipped_more += 1
    if type(wire_more) is int and wire_more > 0:  # no honest walk skips more than it saw
        out.skipped_more += min(wire_more, MAX_WALK_ENTRIES)
    return out
