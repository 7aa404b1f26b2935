"""Two jaild instances never share a uid block (jaild/daemon/uidblock.py): a daemon whose
socket path hashes to the block another instance holds refuses to start, naming that
instance and what to do. No override is needed to force two daemons onto one block: two
socket paths that hash to one are found by trying names (about 80 of them; a pair meets one
time in 4,095), and both daemons run for real on them."""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

from jaild.daemon.config import DaemonConfig
from jaild.daemon.selftest import UID_BLOCK
from jaild.daemon.uidblock import lock_path
from tests.conftest import block_in_use, guard, start_daemon, sweep_cgroups

MINIMAL = {"default": ""}
"""One policy, all defaults: the quickest daemon to start."""


def one_block(directory: Path) -> tuple[Path, Path]:
    """Two directories under ``directory`` whose ``jaild.sock`` sockets have one uid block,
    and one that no daemon holds now."""
    seen: dict[int, Path] = {}
    for n in itertools.count():
        where = directory / f"d{n}"
        base = DaemonConfig(socket_path=str(where / "jaild.sock")).uid_base
        if base in seen and not block_in_use(base):
            return seen[base], where
        seen.setdefault(base, where)
    raise AssertionError("unreachable")


def test_a_second_instance_on_a_held_block_refuses_to_start_until_the_first_is_gone(
    tmp_path: Path,
) -> None:
    first_dir, second_dir = one_block(tmp_path)
    sockets = str(first_dir / "jaild.sock"), str(second_dir / "jaild.sock")
    assert DaemonConfig(socket_path=sockets[0]).instance != DaemonConfig(
        socket_path=sockets[1]).instance  # two instances ...
    first = start_daemon(first_dir, MINIMAL, with_repo_policies=False, socket=sockets[0])
    second = None
    try:
        base = first.config.uid_base
        second = start_daemon(second_dir, MINIMAL, with_repo_policies=False, socket=sockets[1],
                              wait=False)
        assert second.config.uid_base == base  # ... on one block
        assert second.proc.wait(timeout=guard(60)) != 0
        log = second.log()
        assert (f"cannot start: the jails' uid block {base}..{base + UID_BLOCK - 1} is in use "
                f"by another jaild instance (socket {sockets[0]}, pid {first.proc.pid}; "
                f"{lock_path(base)}): two instances must not run jails as the same host uids. "
                "The block is picked from the socket path: serve another socket path") in log, \
            log[-2000:]
        first.assert_serving()  # the refused start took nothing of the first's
        # the control: once the first is gone -- killed, so that only the kernel lets go of
        # its claim -- the second starts on the same block, with nothing cleaned up between
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(guard(10))
        second = start_daemon(second_dir, MINIMAL, with_repo_policies=False, socket=sockets[1])
        second.assert_serving()
        assert f'"socket": "{sockets[1]}"' in Path(lock_path(base)).read_text()
    finally:
        for d in (first, second):
            if d is not None:
                if d.proc.poll() is None:
                    assert d.stop() == 0, d.log()[-2000:]
                sweep_cgroups(d)
