"""Files in and out of a jail's working directory: the attacks, run on the host.

The in-jail side (:mod:`jaild.runtime.files`) runs here against temporary trees: the
walks, reads and writes are the same inside a jail (the jail only narrows what the
process can reach). Each attack has its positive control -- the naive operation
(``open(path).read()``, writing through the path) really does reach outside, block,
or flood -- so a refusal proves the code refused, not that the test was broken.

The two attacks that need root (a device node, a link to /etc/shadow) are in
tests/integration/test_files.py, which runs as root like the daemon.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaild.runtime.files as rf
from jaild.policy.schema import Files
from jaild.protocol import pack, unpack
from jaild.runtime.files import (
    MAX_SKIPPED,
    Collected,
    FileLimits,
    Snapshot,
    UploadError,
    check_path,
    collect,
    snapshot,
    validate_collected,
    write_uploads,
)
from jaild.transfer import WIDEST_LIMITS, UnsafePath, load_uploads, save_files
from tests.conftest import guard

LIMITS = FileLimits(max_files=256, max_bytes=1 << 20, max_depth=16, max_name_chars=255,
                    max_path_chars=1024)
T = TypeVar("T")


def within(seconds: float, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it blocks."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(guard(seconds))  # a liveness guard: scaled on slow hosts (TCG guests)
    assert not thread.is_alive(), f"{fn.__name__} blocked for more than {guard(seconds)} s"
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(root: Path, before: Snapshot | None = None, patterns: tuple[str, ...] = ("*",),
        limits: FileLimits = LIMITS) -> Collected:
    """collect() as the runtime does it, guarded against blocking and fd leaks."""
    fds = open_fds()
    got = within(10, collect, str(root), before or Snapshot(), list(patterns), limits)
    assert open_fds() == fds, "collect leaked file descriptors"
    return got


def reasons(c: Collected) -> dict[str, str]:
    return {s["path"]: s["reason"] for s in c.skipped}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "tree").mkdir()
    return tmp_path / "tree"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the tree, with a secret the tree must never leak."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"the secret outside the tree")
    return tmp_path / "outside"


def assert_no_leak(c: Collected, secret: bytes) -> None:
    assert all(secret not in content for content in c.data.values())


# --- limits and paths -----------------------------------------------------------------


def test_limits_travel_as_a_plain_map_and_match_the_policy_section() -> None:
    assert FileLimits.from_wire(unpack(pack(LIMITS.to_wire()))) == LIMITS
    assert FileLimits.from_wire(asdict(Files())) == FileLimits(256, 16 << 20, 16, 255, 1024)
    bad: object
    for bad in (None, [], {}, {**LIMITS.to_wire(), "extra": 1}, {**LIMITS.to_wire(), "max_files": 0},
                {**LIMITS.to_wire(), "max_depth": True}, {**LIMITS.to_wire(), "max_bytes": -1},
                {**LIMITS.to_wire(), "max_path_chars": "9"}):
        with pytest.raises(ValueError):
            FileLimits.from_wire(bad)


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        (b"a", "not a string"),
        (None, "not a string"),
        ("", "empty path"),
        ("/etc/passwd", "absolute path"),
        ("..", "'..' component"),
        ("a/../../x", "'..' component"),
        ("./a", "'.' component"),
        ("a//b", "empty component"),
        ("a/", "empty component"),
        ("a\\..\\x", "backslash in name"),
        ("a\0b", "NUL in name"),
        ("new\nline", "control character in name"),
        ("esc\x1b[2J", "control character in name"),
        ("c1\x85", "control character in name"),
        ("lone\udcff", "not valid UTF-8"),
        ("n" * 256, "name longer than 255 bytes"),
        ("é" * 128, "name longer than 255 bytes"),  # 128 chars, 256 bytes
        ("/".join(["d"] * 17), "deeper than 16 levels"),
        ("/".join(["n" * 200] * 6), "path longer than 1024 bytes"),
    ],
)
def test_check_path_refuses(path: object, reason: str) -> None:
    assert check_path(path, LIMITS) == reason


@pytest.mark.parametrize("path", ["a", "...", "..hidden", "a..b/c", "é" * 127, "n" * 255,
                                  "/".join(["d"] * 16), "sp ace/ünï/日本.txt", "-rf"])
def test_check_path_accepts(path: str) -> None:
    assert check_path(path, LIMITS) is None


# --- collect: the baseline ------------------------------------------------------------


def test_collect_lists_what_changed_and_sends_what_matches(tree: Path) -> None:
    (tree / "in").mkdir()
    (tree / "in" / "input.csv").write_bytes(b"a,b\n")
    (tree / "kept.txt").write_bytes(b"unchanged")
    (tree / "edited.txt").write_bytes(b"old")
    before = snapshot(str(tree), LIMITS)
    (tree / "edited.txt").write_bytes(b"new contents")
    (tree / "out").mkdir()
    (tree / "out" / "result.csv").write_bytes(b"x,y\n1,2\n")
    (tree / "out" / "log.txt").write_bytes(b"log")

    c = run(tree, before, ("*.csv",))
    assert c.files == [
        {"path": "edited.txt", "size": 12, "sha256": sha(b"new contents")},
        {"path": "out/log.txt", "size": 3, "sha256": sha(b"log")},
        {"path": "out/result.csv", "size": 8, "sha256": sha(b"x,y\n1,2\n")},
    ]
    # "*" matches across "/"; matched files come whether they changed or not
    assert c.data == {"in/input.csv": b"a,b\n", "out/result.csv": b"x,y\n1,2\n"}
    assert c.skipped == [] and c.skipped_more == 0
    assert run(tree, before, ()).data == {}
    assert set(run(tree, before, ("*",)).data) == {"in/input.csv", "kept.txt", "edited.txt",
                                                  "out/log.txt", "out/result.csv"}


def test_a_file_whose_times_were_reset_still_counts_as_changed(tree: Path) -> None:
    f = tree / "same.txt"
    f.write_bytes(b"aaaa")
    st0 = f.stat()
    before = snapshot(str(tree), LIMITS)
    f.write_bytes(b"bbbb")
    os.utime(f, ns=(st0.st_atime_ns, st0.st_mtime_ns))  # same size, same mtime: ctime moved
    assert f.stat().st_mtime_ns == st0.st_mtime_ns  # control
    assert [e["path"] for e in run(tree, before, ()).files] == ["same.txt"]


def test_collect_never_raises_on_a_missing_root(tmp_path: Path) -> None:
    c = run(tmp_path / "missing")
    assert c.files == [] and c.data == {}
    assert reasons(c) == {".": "unreadable directory: No such file or directory"}


# --- collect: the attacks -------------------------------------------------------------


def test_symlink_to_a_directory_outside_is_not_entered(tree: Path, outside: Path) -> None:
    os.symlink(outside, tree / "door")
    os.symlink("../outside/secret", tree / "relative")
    assert os.listdir(tree / "door") == ["secret"]  # control
    assert (tree / "relative").read_bytes() == (outside / "secret").read_bytes()  # control
    c = run(tree)
    assert reasons(c) == {"door": "symlink", "relative": "symlink"}
    assert c.files == [] and c.data == {}


def test_a_fifo_is_refused_without_blocking(tree: Path) -> None:
    fifo = tree / "pipe"
    os.mkfifo(fifo)
    # control: the naive read blocks (no writer), until a writer comes
    def naive_read() -> None:
        with open(fifo, "rb") as f:
            f.read()

    reader = threading.Thread(target=naive_read, daemon=True)
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release it
    reader.join(5)
    assert reader.is_alive() is False
    assert reasons(run(tree)) == {"pipe": "fifo"}


def test_a_file_swapped_for_a_fifo_after_the_lstat_does_not_block(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tree / "swap.txt").write_bytes(b"data")
    real_open = os.open

    def swapping_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == "swap.txt":  # the user's thread wins the race
            os.unlink(tree / "swap.txt")
            os.mkfifo(tree / "swap.txt")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapping_open)
    c = run(tree)
    assert reasons(c) == {"swap.txt": "changed while reading"}
    assert c.data == {}


@pytest.mark.parametrize("swapped", ["file", "dir"])
def test_an_entry_swapped_for_a_symlink_after_the_lstat_is_not_followed(
        tree: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, swapped: str) -> None:
    name = "victim"
    if swapped == "file":
        (tree / name).write_bytes(b"harmless")
    else:
        (tree / name).mkdir()
        (tree / name / "inner").write_bytes(b"harmless")
    target = outside / "secret" if swapped == "file" else outside
    real_open = os.open

    reached: list[str] = []

    def swapping_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == name:  # the user's thread wins the race
            os.rename(tree / name, tree / "moved")
            os.symlink(target, tree / name)
        fd = real_open(path, flags, *args, **kwargs)
        if os.path.samestat(os.fstat(fd), os.stat(target)):
            reached.append(path)
        return fd

    monkeypatch.setattr(os, "open", swapping_open)
    c = run(tree)
    monkeypatch.undo()
    # control: by the time of the open, the name leads outside
    assert os.path.realpath(tree / name) == str(target)
    assert reached == []  # O_NOFOLLOW: the target was never even opened
    assert reasons(c) == {name: "changed while reading"}
    assert_no_leak(c, (outside / "secret").read_bytes())
    assert all(not p.startswith(name) for p in c.data)


def test_a_unix_socket_is_refused(tree: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(tree / "sock"))
        server.listen()
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(tree / "sock"))  # control: a live socket
        assert reasons(run(tree)) == {"sock": "socket"}
    finally:
        server.close()


def test_hard_links_are_refused(tree: Path, outside: Path) -> None:
    os.link(outside / "secret", tree / "leak")
    (tree / "a").write_bytes(b"one inode")
    os.link(tree / "a", tree / "b")
    secret = (outside / "secret").read_bytes()
    assert (tree / "leak").read_bytes() == secret  # control: the link reaches the file outside
    assert (tree / "leak").stat().st_nlink == 2
    c = run(tree)
    assert reasons(c) == {"leak": "hard link", "a": "hard link", "b": "hard link"}
    assert c.files == [] and c.data == {}
    assert_no_leak(c, secret)


def test_a_sparse_file_is_refused(tree: Path) -> None:
    with open(tree / "huge", "wb") as f:
        f.truncate(10 << 30)
    (tree / "dense").write_bytes(b"x" * 100_000)
    st_huge = (tree / "huge").stat()
    assert st_huge.st_size == 10 << 30 and st_huge.st_blocks * 512 < 1 << 20  # control
    c = run(tree)
    assert reasons(c) == {"huge": "sparse file"}
    assert [e["path"] for e in c.files] == ["dense"] and list(c.data) == ["dense"]


def test_a_file_growing_between_lstat_and_open_is_refused(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tree / "grow.log").write_bytes(b"line\n")
    assert run(tree).data == {"grow.log": b"line\n"}  # control: untouched, it is collected
    real_open = os.open

    def growing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == "grow.log":
            with open(tree / "grow.log", "ab") as f:
                f.write(b"more\n" * 1000)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", growing_open)
    c = run(tree)
    assert reasons(c) == {"grow.log": "changed while reading"}
    assert c.files == [] and c.data == {}


def test_a_file_growing_while_being_read_is_refused(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tree / "grow.log").write_bytes(b"line\n")
    real_open, real_read = os.open, os.read
    fds: set[int] = set()

    def tracking_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if path == "grow.log":
            fds.add(fd)
        return fd

    def growing_read(fd: int, n: int) -> bytes:
        if fd in fds:
            fds.discard(fd)
            with open(tree / "grow.log", "ab") as f:
                f.write(b"more\n" * 1000)
        return real_read(fd, n)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "read", growing_read)
    c = run(tree)
    assert reasons(c) == {"grow.log": "changed while reading"}
    assert c.data == {}


def test_hostile_names_are_refused_and_shown_escaped(tree: Path) -> None:
    raw = os.fsencode(tree)
    for name in (b"new\nline", b"\xff\xfe.bin", b"back\\slash", b"tab\there", b"...",
                 b"..hidden", b"caf\xc3\xa9"):
        with open(raw + b"/" + name, "wb") as f:
            f.write(b"x")
    os.mkdir(raw + b"/bad\ndir")
    with open(raw + b"/bad\ndir/inner", "wb") as f:
        f.write(b"x")
    assert len(os.listdir(raw)) == 8  # control: the names exist
    c = run(tree)
    assert reasons(c) == {
        "new\\x0aline": "control character in name",
        "\\xff\\xfe.bin": "not valid UTF-8",
        "back\\slash": "backslash in name",
        "tab\\x09here": "control character in name",
        "bad\\x0adir": "control character in name",
    }
    assert sorted(c.data) == ["...", "..hidden", "café"]


def test_a_300_deep_tree_stops_at_max_depth(tree: Path) -> None:
    deep = tree.joinpath(*["d"] * 300)
    deep.mkdir(parents=True)
    (deep / "bottom.txt").write_bytes(b"deep")
    (tree / "d" / "d" / "shallow.txt").write_bytes(b"shallow")
    assert (deep / "bottom.txt").read_bytes() == b"deep"  # control: it is there
    c = run(tree)
    assert reasons(c) == {"/".join(["d"] * 16): "too deep"}
    assert list(c.data) == ["d/d/shallow.txt"]
    assert snapshot(str(tree), LIMITS).entries.keys() == {"d/d/shallow.txt"}


def test_ten_thousand_files_stop_at_max_files(tree: Path) -> None:
    before = snapshot(str(tree), LIMITS)
    for i in range(10_000):
        (tree / f"f{i:05}").write_bytes(b"x")
    c = run(tree, before)
    assert len(c.files) == len(c.data) == 256  # listed and sent: 256 distinct paths
    assert [e["path"] for e in c.files] == [f"f{i:05}" for i in range(256)]
    assert len(c.skipped) == MAX_SKIPPED and c.skipped_more == 10_000 - 256 - MAX_SKIPPED
    assert set(reasons(c).values()) == {"too many files"}


def test_listing_and_contents_share_max_files(tree: Path) -> None:
    limits = FileLimits(3, 1 << 20, 16, 255, 1024)
    (tree / "a.csv").write_bytes(b"old input")  # matched, unchanged: sent, not listed
    before = snapshot(str(tree), limits)
    for name in ("b.csv", "c.txt", "d.txt"):
        (tree / name).write_bytes(b"new")
    c = run(tree, before, ("*.csv",), limits)
    assert [e["path"] for e in c.files] == ["b.csv", "c.txt"]
    assert list(c.data) == ["a.csv", "b.csv"]
    assert reasons(c) == {"d.txt": "too many files"}


def test_contents_stop_at_max_bytes_but_stay_listed(tree: Path) -> None:
    limits = FileLimits(256, 1000, 16, 255, 1024)
    for name in ("a", "b", "c"):
        (tree / name).write_bytes(name.encode() * 400)
    c = run(tree, limits=limits)
    assert list(c.data) == ["a", "b"] and sum(map(len, c.data.values())) <= 1000
    assert [e["path"] for e in c.files] == ["a", "b", "c"]
    assert c.files[2] == {"path": "c", "size": 400, "sha256": sha(b"c" * 400)}
    assert reasons(c) == {"c": "too large: 400 bytes, 200 left of max_bytes"}


def test_collect_reads_a_bounded_number_of_bytes(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rf, "MAX_READ_BYTES", 1000)
    for name in ("a", "b", "c"):
        (tree / name).write_bytes(b"x" * 400)
    c = run(tree, patterns=())
    assert [e["path"] for e in c.files] == ["a", "b"]
    assert reasons(c) == {"c": "too large to read: the walk reads 1000 bytes in all"}


def test_walks_stop_after_max_walk_entries(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rf, "MAX_WALK_ENTRIES", 10)
    for i in range(30):
        (tree / f"f{i:02}").write_bytes(b"x")
    assert snapshot(str(tree), LIMITS).truncated
    c = run(tree)
    assert len(c.files) == 10
    assert reasons(c)["."] == "walk stopped after 10 entries"


# --- write_uploads ----------------------------------------------------------------------


def test_write_uploads_writes_the_tree(tree: Path) -> None:
    old = os.umask(0o077)
    try:
        write_uploads(str(tree), {"a.txt": b"A", "dir/sub/b.bin": b"\0B", "dir/c": b""}, LIMITS)
    finally:
        os.umask(old)
    assert (tree / "a.txt").read_bytes() == b"A"
    assert (tree / "dir" / "sub" / "b.bin").read_bytes() == b"\0B"
    assert stat.S_IMODE((tree / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tree / "dir" / "sub").stat().st_mode) == 0o755
    assert snapshot(str(tree), LIMITS).entries.keys() == {"a.txt", "dir/sub/b.bin", "dir/c"}


def test_write_uploads_replaces_a_symlinked_directory(tree: Path, outside: Path) -> None:
    os.symlink(outside, tree / "sub")
    (tree / "sub" / "probe").write_bytes(b"")  # control: writing through it lands outside
    assert (outside / "probe").exists()
    (outside / "probe").unlink()
    write_uploads(str(tree), {"sub/x.txt": b"upload"}, LIMITS)
    assert sorted(os.listdir(outside)) == ["secret"]
    assert not (tree / "sub").is_symlink() and (tree / "sub" / "x.txt").read_bytes() == b"upload"


def test_write_uploads_replaces_symlinks_at_the_file(tree: Path, outside: Path) -> None:
    os.symlink(outside / "secret", tree / "x.txt")
    os.symlink(outside / "planted", tree / "dangling")
    with open(tree / "dangling", "w"):  # control: O_CREAT follows a dangling link
        pass
    assert (outside / "planted").exists()
    (outside / "planted").unlink()
    write_uploads(str(tree), {"x.txt": b"upload", "dangling": b"upload"}, LIMITS)
    assert (outside / "secret").read_bytes() == b"the secret outside the tree"
    assert sorted(os.listdir(outside)) == ["secret"]
    for name in ("x.txt", "dangling"):
        assert not (tree / name).is_symlink() and (tree / name).read_bytes() == b"upload"


@pytest.mark.parametrize("planted", ["dir", "leaf", "hard link"])
def test_writes_never_follow_a_link_planted_after_the_lstat(
        tree: Path, outside: Path, monkeypatch: pytest.MonkeyPatch,
        planted: str) -> None:
    """The race: a link appears between the look (lstat) and the open."""
    real_open = os.open
    name = "sub" if planted == "dir" else "x.txt"
    files = {"sub/x.txt": b"upload"} if planted == "dir" else {"x.txt": b"upload"}

    done: list[str] = []

    def planting_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == name and not done:
            done.append(path)
            if os.path.lexists(tree / name):
                os.rename(tree / name, tree / "moved")
            if planted == "dir":
                os.symlink(outside, tree / name)
            elif planted == "leaf":
                os.symlink(outside / "planted", tree / name)  # dangling: O_CREAT would make it
            else:
                os.link(outside / "secret", tree / name)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", planting_open)
    if planted == "hard link":
        with pytest.raises(UploadError, match="replaced by something else"):
            write_uploads(str(tree), files, LIMITS)
    else:
        write_uploads(str(tree), files, LIMITS)  # the link is replaced, as at any time
        assert done  # control: the link was planted
        assert (tree / next(iter(files))).read_bytes() == b"upload"
        assert not any(p.is_symlink() for p in tree.rglob("*"))
    monkeypatch.undo()
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_bytes() == b"the secret outside the tree"


def test_write_uploads_replaces_a_fifo_without_blocking(tree: Path) -> None:
    os.mkfifo(tree / "pipe")
    within(5, write_uploads, str(tree), {"pipe": b"data"}, LIMITS)
    assert (tree / "pipe").read_bytes() == b"data"


def test_write_uploads_refuses_what_is_in_the_way(tree: Path) -> None:
    (tree / "x.txt").mkdir()
    with pytest.raises(UploadError, match="a directory is in the way") as info:
        write_uploads(str(tree), {"x.txt": b""}, LIMITS)
    assert info.value.path == "x.txt"
    (tree / "plain").write_bytes(b"file")
    with pytest.raises(UploadError, match="'plain' is in the way: it is not a directory"):
        write_uploads(str(tree), {"plain/y": b""}, LIMITS)
    assert (tree / "plain").read_bytes() == b"file"


@pytest.mark.parametrize(
    ("files", "limits", "path", "reason"),
    [
        ({"ok.txt": b"", "../escape": b""}, LIMITS, "../escape", "'..' component"),
        ({"ok.txt": b"", "/abs": b""}, LIMITS, "/abs", "absolute path"),
        ({"ok.txt": b"", "s": "text"}, LIMITS, "s", "contents are not bytes"),
        ({"ok.txt": b"", "a": b"", "a/b": b""}, LIMITS, "a/b", "'a' is also a file in this set"),
        ({"ok.txt": b"", "z": b""}, FileLimits(1, 100, 16, 255, 1024), "z",
         "more than 1 files (max_files)"),
        ({"ok.txt": b"12", "z": b"345"}, FileLimits(9, 4, 16, 255, 1024), "z",
         "more than 4 bytes in all (max_bytes)"),
    ],
)
def test_write_uploads_checks_everything_before_writing(
        tree: Path, files: dict[str, Any], limits: FileLimits, path: str, reason: str) -> None:
    with pytest.raises(UploadError) as info:
        write_uploads(str(tree), files, limits)
    assert (info.value.path, info.value.reason) == (path, reason)
    assert os.listdir(tree) == []


# --- save_files -----------------------------------------------------------------------


def test_save_files_writes_below_dest(tmp_path: Path) -> None:
    dest = tmp_path / "new" / "dest"
    (tmp_path / "new").mkdir()
    paths = save_files(str(dest), {"r.csv": b"1", "d/e/f.txt": b"2"}, LIMITS)
    assert paths == [str(dest / "d/e/f.txt"), str(dest / "r.csv")]
    assert (dest / "d" / "e" / "f.txt").read_bytes() == b"2"
    save_files(str(dest), {"r.csv": b"again"}, overwrite=True)  # asked to: overwrites
    assert (dest / "r.csv").read_bytes() == b"again"


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "a/./b", "", "a//b",
                                  "x\n", "nul\0", "a\\..\\x", "lone\udcff", "/".join("d" * 65)])
def test_save_files_refuses_hostile_names_before_writing(tmp_path: Path, name: str) -> None:
    dest = tmp_path / "dest"
    with pytest.raises(UnsafePath) as info:
        save_files(str(dest), {"good.txt": b"fine", name: b"evil"})
    assert info.value.reason == check_path(name, WIDEST_LIMITS)
    assert not dest.exists() or os.listdir(dest) == []
    assert sorted(os.listdir(tmp_path)) == (["dest"] if dest.exists() else [])


def test_save_files_refuses_a_symlink_planted_in_dest(tmp_path: Path, outside: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / "sub")
    os.symlink(outside / "secret", dest / "leaf")
    (dest / "sub" / "probe").write_bytes(b"")  # control: a write through it lands outside
    assert (outside / "probe").exists()
    (outside / "probe").unlink()
    with pytest.raises(UnsafePath, match=r"'sub' in .* is a symlink") as info:
        save_files(str(dest), {"a.txt": b"", "sub/x": b"evil"})
    assert info.value.path == "sub/x"
    with pytest.raises(UnsafePath, match="a symlink is in the way"):
        save_files(str(dest), {"a.txt": b"", "leaf": b"evil"})
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_bytes() == b"the secret outside the tree"
    assert sorted(os.listdir(dest)) == ["leaf", "sub"]  # nothing written, links left alone


def test_save_files_write_phase_never_follows_a_late_symlink(
        tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link planted after the check (a race) is still not followed by the writes."""
    import jaild.transfer

    dest = tmp_path / "dest"
    dest.mkdir()
    monkeypatch.setattr(jaild.transfer, "_check_existing", lambda *args: set())
    os.symlink(outside, dest / "sub")
    os.symlink(outside / "planted", dest / "leaf")
    for files in ({"sub/x": b"evil"}, {"leaf": b"evil"}):
        with pytest.raises(UnsafePath, match="symlink"):
            save_files(str(dest), files)
    assert sorted(os.listdir(outside)) == ["secret"]


def test_save_files_refuses_a_hard_link_in_the_way(tmp_path: Path, outside: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    os.link(outside / "secret", dest / "out.txt")
    with pytest.raises(UnsafePath, match="hard-linked"):
        save_files(str(dest), {"out.txt": b"evil"})
    assert (outside / "secret").read_bytes() == b"the secret outside the tree"


# --- validate_collected -------------------------------------------------------------------


def test_a_collection_survives_the_wire_unchanged(tree: Path) -> None:
    (tree / "d").mkdir()
    (tree / "d" / "r.csv").write_bytes(b"1,2")
    (tree / "n.txt").write_bytes(b"n")
    os.symlink("/etc/passwd", tree / "link")
    c = run(tree, patterns=("*.csv",))
    assert validate_collected(unpack(pack(c.to_wire())), LIMITS) == c


def entry(path: Any, data: bytes = b"x", **override: Any) -> dict[str, Any]:
    return {"path": path, "size": len(data), "sha256": sha(data), **override}


@pytest.mark.parametrize(
    ("wire", "refused"),
    [
        (None, {"": "the jail's file listing is not a map"}),
        ([1, 2], {"": "the jail's file listing is not a map"}),
        ({"files": "x"}, {"": "the listing is not a list"}),
        ({"data": [b"x"]}, {"": "the contents are not a map"}),
        ({"files": [entry("../x")]}, {"../x": "bad path: '..' component"}),
        ({"files": [entry("/etc/passwd")]}, {"/etc/passwd": "bad path: absolute path"}),
        ({"files": [entry(7)]}, {"7": "bad path: not a string"}),
        ({"files": [entry("a", extra=1)]}, {"a": "malformed listing entry"}),
        ({"files": [{"path": "a", "size": 1}]}, {"a": "malformed listing entry"}),
        ({"files": [entry("a", size=-1)]}, {"a": "bad size"}),
        ({"files": [entry("a", size=True)]}, {"a": "bad size"}),
        ({"files": [entry("a", size=1 << 64)]}, {"a": "bad size"}),
        ({"files": [entry("a", sha256="A" * 64)]}, {"a": "bad sha256"}),
        ({"files": [entry("a", sha256=b"0" * 64)]}, {"a": "bad sha256"}),
        ({"files": [entry("a"), entry("a"), entry("a")]}, {"a": "listed more than once"}),
        ({"files": [entry("a", b"xy")], "data": {"a": b"x"}},
         {"a": "the listed size disagrees with the contents"}),
        ({"files": [entry("a", b"y")], "data": {"a": b"x"}},
         {"a": "the listed sha256 disagrees with the contents"}),
        ({"data": {"a\nb": b"x"}}, {"a\\x0ab": "bad path: control character in name"}),
        ({"data": {"a": "text"}}, {"a": "contents are not bytes"}),
        ({"data": {"lone\udcff": b""}}, {"lone\\xff": "bad path: not valid UTF-8"}),
    ],
)
def test_validate_collected_refuses(wire: object, refused: dict[str, str]) -> None:
    c = validate_collected(wire, LIMITS)
    assert c.files == [] and c.data == {}
    prefix = "refused by the daemon: "
    assert {s["path"]: s["reason"].removeprefix(prefix) for s in c.skipped} == refused
    assert all(s["reason"].startswith(prefix) for s in c.skipped)


def test_validate_collected_enforces_max_files_and_max_bytes() -> None:
    limits = FileLimits(3, 10, 16, 255, 1024)
    wire = {"files": [entry(f"f{i}") for i in range(5)],
            "data": {"f0": b"x", "g": b"123456789", "h": b"zz"}}
    c = validate_collected(wire, limits)
    assert {e["path"] for e in c.files} | set(c.data) == {"f0", "f1", "f2"}
    assert c.data == {"f0": b"x"}
    wire = {"data": {"a": b"123456", "b": b"123456"}}
    c = validate_collected(wire, limits)
    assert c.data == {"a": b"123456"}
    assert reasons(c) == {"b": "refused by the daemon: contents over what is left of "
                               "10 bytes (max_bytes)"}


def test_validate_collected_sanitises_the_jails_skipped_entries() -> None:
    wire = {"skipped": [{"path": "\x1b[2Jx\u202e", "reason": "r" * 10_000}, "junk", {"path": 1}],
            "skipped_more": 5}
    c = validate_collected(wire, LIMITS)
    assert c.skipped == [{"path": "\\x1b[2Jx\\u202e", "reason": "r" * 509 + "..."}]
    assert c.skipped_more == 7
    many = {"files": [entry("../x")] * 150, "skipped": [{"path": "p", "reason": "r"}] * 150,
            "skipped_more": 1 << 70}
    c = validate_collected(many, LIMITS)
    assert len(c.skipped) == MAX_SKIPPED and c.skipped[0]["path"] == "../x"
    assert c.skipped_more == 50 + 150 + rf.MAX_WALK_ENTRIES  # the jail's claim, capped


def plain_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                        st.binary(max_size=8))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12)


def near_valid() -> st.SearchStrategy[Any]:
    paths = st.one_of(st.sampled_from(["a", "b/c", "../x", "/abs", "a/", "", "d/e/f"]),
                      st.text(max_size=6), st.integers())
    blobs = st.binary(max_size=12)
    listed = st.builds(lambda p, d, s, h: {"path": p, "size": s if s is not None else len(d),
                                           "sha256": h if h is not None else sha(d)},
                       paths, blobs, st.one_of(st.none(), st.integers(-2, 20), plain_values()),
                       st.one_of(st.none(), st.text(max_size=64), plain_values()))
    return st.fixed_dictionaries({
        "files": st.one_of(st.lists(st.one_of(listed, plain_values()), max_size=8), plain_values()),
        "data": st.one_of(st.dictionaries(paths, st.one_of(blobs, plain_values()), max_size=8),
                          plain_values()),
        "skipped": st.one_of(st.lists(st.one_of(st.fixed_dictionaries(
            {"path": st.text(max_size=8), "reason": st.text(max_size=8)}), plain_values()),
            max_size=4), plain_values()),
        "skipped_more": plain_values(),
    })


@settings(max_examples=300, deadline=None)
@given(wire=st.one_of(plain_values(), near_valid()))
def test_validate_collected_never_raises_and_always_respects_the_limits(wire: Any) -> None:
    limits = FileLimits(4, 24, 3, 8, 16)
    c = validate_collected(wire, limits)
    listed = [e["path"] for e in c.files]
    assert len(listed) == len(set(listed)) and listed == sorted(listed)
    for e in c.files:
        assert check_path(e["path"], limits) is None
        assert type(e["size"]) is int and e["size"] >= 0 and len(e["sha256"]) == 64
        if e["path"] in c.data:
            assert (e["size"], e["sha256"]) == (len(c.data[e["path"]]), sha(c.data[e["path"]]))
    assert all(check_path(p, limits) is None and type(v) is bytes for p, v in c.data.items())
    assert len(set(listed) | set(c.data)) <= limits.max_files
    assert sum(map(len, c.data.values())) <= limits.max_bytes
    assert len(c.skipped) <= MAX_SKIPPED and c.skipped_more >= 0
    assert all(s["path"].isprintable() and s["reason"].isprintable() for s in c.skipped)
    pack(c.to_wire())


# --- load_uploads -----------------------------------------------------------------------


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "local"
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.csv").write_bytes(b"a")
    (root / "data" / "sub" / "b.csv").write_bytes(b"b")
    (root / "script.py").write_bytes(b"print(1)")
    yield root


def test_load_uploads_from_a_map_and_from_paths(local: Path) -> None:
    assert load_uploads({"in/x.bin": b"\0", "s.py": str(local / "script.py"),
                         "d": local / "data"}) == {
        "in/x.bin": b"\0", "s.py": b"print(1)", "d/a.csv": b"a", "d/sub/b.csv": b"b"}
    assert load_uploads([local / "script.py", str(local / "data") + "/"]) == {
        "script.py": b"print(1)", "data/a.csv": b"a", "data/sub/b.csv": b"b"}
    assert load_uploads(str(local / "script.py")) == {"script.py": b"print(1)"}


def test_load_uploads_refuses_symlinks_inside_a_directory(local: Path, outside: Path) -> None:
    os.symlink(outside / "secret", local / "data" / "link")
    assert (local / "data" / "link").read_bytes().startswith(b"the secret")  # control
    with pytest.raises(UploadError, match="is a symlink") as info:
        load_uploads([local / "data"])
    assert info.value.path == "data/link"


def test_load_uploads_refuses_fifos_and_devices_without_blocking(local: Path) -> None:
    os.mkfifo(local / "pipe")
    with pytest.raises(UploadError, match="is a fifo, not a regular file"):
        within(5, load_uploads, [local / "pipe"])
    with pytest.raises(UploadError, match="is a device, not a regular file"):
        within(5, load_uploads, {"null": "/dev/null"})
    os.symlink(local / "pipe", local / "data" / "pipe-link")
    with pytest.raises(UploadError, match="is a symlink"):
        within(5, load_uploads, [local / "data"])


def test_load_uploads_refuses_bad_input(local: Path) -> None:
    with pytest.raises(UploadError, match=r"'\.\.' component"):
        load_uploads({"../x": b""})
    with pytest.raises(UploadError, match="given twice"):
        load_uploads([local / "script.py", local / "script.py"])
    with pytest.raises(UploadError, match="'a' is also a file"):
        load_uploads({"a": b"", "a/b": b""})
    with pytest.raises(UploadError, match="expected a local path"):
        load_uploads([b"contents"])  # type: ignore[list-item]
    with pytest.raises(UploadError, match="No such file"):
        load_uploads([local / "missing"])
    with pytest.raises(UploadError, match="max_files"):
        load_uploads([local / "data"], FileLimits(1, 100, 16, 255, 1024))
    with pytest.raises(UploadError, match="max_bytes"):
        load_uploads({"x": b"12345"}, FileLimits(9, 4, 16, 255, 1024))
