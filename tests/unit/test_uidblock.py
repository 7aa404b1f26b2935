"""A daemon's claim on its uid block (jaild/daemon/uidblock.py): one holder at a time, the
refusal naming the holder and what to do, nothing to clean up after a crash. Root is not
needed: each test claims in a directory of its own."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.daemon.selftest import UID_BLOCK
from jaild.daemon.uidblock import (
    claim_record,
    claim_uid_block,
    describe_holder,
    flock_holders,
    lock_path,
)
from jaild.errors import StartupError

BASE = 0x4000_0000 + 7 * UID_BLOCK
BLOCK = f"{BASE}..{BASE + UID_BLOCK - 1}"


@pytest.fixture
def lock_dir(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "uid-blocks")  # neither made yet: the claim makes both


class Holder:
    """Another process holding a claim (an instance of jaild, as far as the lock goes) until
    it is told to let go or killed."""

    def __init__(self, base: int, socket: str, lock_dir: str) -> None:
        code = ("import sys\nfrom jaild.daemon.uidblock import claim_uid_block\n"
                "claim = claim_uid_block(int(sys.argv[1]), sys.argv[2], sys.argv[3])\n"
                "print('held', flush=True)\nsys.stdin.read()\nclaim.release()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(base), socket, lock_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "held\n"

    def end(self, sig: int | None = None) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if sig is not None:
            self.proc.send_signal(sig)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc.wait(timeout=60)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        if holder.proc.poll() is None:
            holder.end(signal.SIGKILL)


def test_a_claim_makes_its_directory_and_writes_who_holds_it(lock_dir: str) -> None:
    claim = claim_uid_block(BASE, "/srv/a/jaild.sock", lock_dir)
    try:
        assert claim.held and claim.path == lock_path(BASE, lock_dir) == f"{lock_dir}/{BASE}.lock"
        assert stat.S_IMODE(os.stat(lock_dir).st_mode) == 0o700
        assert Path(claim.path).read_text() == claim_record("/srv/a/jaild.sock", os.getpid())
        assert not os.get_inheritable(claim.fd)  # nsjail and the zygotes never get it
    finally:
        claim.release()
    assert not claim.held
    claim.release()  # idempotent
    assert os.path.exists(lock_path(BASE, lock_dir))  # never removed: see the module


def test_a_held_block_refuses_another_instance_naming_it(lock_dir: str) -> None:
    first = claim_uid_block(BASE, "/srv/a/jaild.sock", lock_dir)
    try:
        # a second claim in the same process: a flock is the open file's, so it is refused too
        with pytest.raises(StartupError) as refused:
            claim_uid_block(BASE, "/srv/b/jaild.sock", lock_dir)
        message = refused.value.message
        assert message.startswith(f"the jails' uid block {BLOCK} is in use by another jaild "
                                  f"instance (socket /srv/a/jaild.sock, pid {os.getpid()}; ")
        assert "serve another socket path" in message and "or stop the other one" in message
        # the refused claim changed nothing: the record is still the holder's
        assert Path(first.path).read_text() == claim_record("/srv/a/jaild.sock", os.getpid())
        # the control: another block is free beside it
        other = claim_uid_block(BASE + UID_BLOCK, "/srv/b/jaild.sock", lock_dir)
        other.release()
    finally:
        first.release()
    again = claim_uid_block(BASE, "/srv/b/jaild.sock", lock_dir)  # released: free again
    again.release()


def test_another_process_holds_it_until_it_dies_however_it_dies(
    lock_dir: str, holders: list[Holder],
) -> None:
    holder = Holder(BASE, "/srv/a/jaild.sock", lock_dir)
    holders.append(holder)
    with pytest.raises(StartupError, match=f"socket /srv/a/jaild.sock, pid {holder.proc.pid}; "):
        claim_uid_block(BASE, "/srv/b/jaild.sock", lock_dir)
    holder.end(signal.SIGKILL)  # a crash: the kernel drops the lock, nothing is left to clean
    claim = claim_uid_block(BASE, "/srv/b/jaild.sock", lock_dir)
    claim.release()
    holder = Holder(BASE, "/srv/c/jaild.sock", lock_dir)  # and an orderly release
    holders.append(holder)
    holder.end()
    claim_uid_block(BASE, "/srv/b/jaild.sock", lock_dir).release()


def test_a_lock_held_by_something_else_is_named_by_its_pid(lock_dir: str) -> None:
    """A process holding the file without having claimed it (the record is an old claimant's)
    is named from /proc/locks, with its command line."""
    claim_uid_block(BASE, "/srv/a/jaild.sock", lock_dir).release()  # the record of a past claim
    code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_SH)\nprint('held', flush=True)\nsys.stdin.read()\n")
    with subprocess.Popen([sys.executable, "-c", code, lock_path(BASE, lock_dir)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as squatter:
        assert squatter.stdout is not None and squatter.stdin is not None
        try:
            assert squatter.stdout.readline() == "held\n"
            with pytest.raises(StartupError) as refused:
                claim_uid_block(BASE, "/srv/b/jaild.sock", lock_dir)
        finally:
            squatter.stdin.close()
    assert (f"(socket /srv/a/jaild.sock, pid {os.getpid()}; the lock held by pid "
            f"{squatter.pid}: {sys.executable} -c import fcntl") in refused.value.message


def test_an_unsafe_lock_directory_or_file_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(StartupError, match="must be a directory of uid .* with mode 0700; it is "
                                           r"not \(mode drwxr-xr-x"):
        claim_uid_block(BASE, "/srv/a/jaild.sock", str(loose))
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StartupError, match="must be a directory"):
        claim_uid_block(BASE, "/srv/a/jaild.sock", str(tmp_path / "link"))
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    Path(lock_path(BASE, str(safe))).symlink_to(tmp_path / "target")
    with pytest.raises(StartupError, match=f"{BASE}.lock: it is a symbolic link"):
        claim_uid_block(BASE, "/srv/a/jaild.sock", str(safe))
    assert not (tmp_path / "target").exists()
    os.mkfifo(lock_path(BASE + UID_BLOCK, str(safe)))
    with pytest.raises(StartupError, match="is not a regular file; remove it"):
        claim_uid_block(BASE + UID_BLOCK, "/srv/a/jaild.sock", str(safe))
    # the control: the same directory claims a block whose file is its own
    claim_uid_block(BASE + 2 * UID_BLOCK, "/srv/a/jaild.sock", str(safe)).release()


def test_proc_locks_holders_are_read_for_the_file_only() -> None:
    device = os.makedev(0xFE, 0)
    text = "\n".join([
        "1: POSIX  ADVISORY  WRITE 10 fe:00:99 0 EOF",  # a POSIX lock on it: not a claim
        "2: FLOCK  ADVISORY  WRITE 11 fe:00:99 0 EOF",
        "2: -> FLOCK  ADVISORY  WRITE 12 fe:00:99 0 EOF",  # waiting: holds nothing
        "3: FLOCK  ADVISORY  READ 13 fe:00:99 0 EOF",
        "4: FLOCK  ADVISORY  WRITE 14 fe:00:999 0 EOF",  # another inode
        "5: FLOCK  ADVISORY  WRITE 15 fe:01:99 0 EOF",  # another device
        "6: OFDLCK ADVISORY  WRITE -1 fe:00:99 0 EOF",
        "garbage",
    ])
    assert flock_holders(text, device, 99) == [11, 13]


def test_the_holder_is_described_from_the_record_and_the_locks() -> None:
    def command_line(pid: int) -> str:
        return {7: "jaild serve --socket /srv/a/jaild.sock"}.get(pid, "")

    record = claim_record("/srv/a/jaild.sock", 7)
    assert describe_holder(record, [7], command_line) == "socket /srv/a/jaild.sock, pid 7"
    assert describe_holder(record, [], command_line) == "socket /srv/a/jaild.sock, pid 7"
    assert describe_holder(record, [8], command_line) == (
        "socket /srv/a/jaild.sock, pid 7; the lock held by pid 8: ?")
    assert describe_holder("", [7], command_line) == (
        "held by pid 7: jaild serve --socket /srv/a/jaild.sock")
    for junk in ("", "[]", '"x"', '{"socket": "/s"}', '{"socket": "/s", "pid": "x"}', "{"):
        assert describe_holder(junk, [], command_line) == "it wrote nothing into the lock file"


def test_a_claim_takes_the_lock_without_waiting(lock_dir: str) -> None:
    """Non-blocking: a held block refuses at once; the lock taken is exclusive (a shared
    lock beside it is refused too)."""
    claim = claim_uid_block(BASE, "/srv/a/jaild.sock", lock_dir)
    try:
        fd = os.open(claim.path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        claim.release()
