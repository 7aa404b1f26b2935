"""A forked jail's move into its job's cgroup runs in a worker thread (the kernel makes the
write wait for an RCU grace period): what happens around it, without root or a kernel cgroup.

The jail, here the test, sends the preamble byte with its credentials; the daemon moves its
pid into the cgroup and answers GO. A kill while the move is under way must not send GO (the
jail exits at EOF), and releasing the cgroup must wait for the move, or the cgroup would be
removed before the jail lands in it (and outlive the job).

A jail the zygote forked straight into its job's cgroup (cgroup v2, ``clone3``) says so
(``PLACED``): nothing is moved and no GO is sent -- but only a jail that was sent its cgroup
may say it; a jail sent one that still asks to be moved was forked (the zygote could not
``clone3``), is moved, and the daemon says so once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jaild.daemon.core.machine import StartFailed, StreamClosed
from jaild.daemon.jails.launch import forked
from jaild.daemon.jails.launch.handle import JailHandle
from jaild.runtime.zygote import GO, PLACED, PREAMBLE
from tests.conftest import guard


class SlowCgroup:
    """A cgroup whose ``adopt`` waits for the test (a grace period that takes its time)."""

    def __init__(self, fail: bool = False, leaf: str = "") -> None:
        self.leaf = leaf  # set: the zygote was sent it, to fork the jail into
        self.gate = threading.Event()
        self.calls: list[str] = []
        self.fail = fail

    def adopt(self, pid: int) -> None:
        self.calls.append("adopt started")
        self.gate.wait(timeout=guard(30))
        self.calls.append(f"adopted {pid}")
        if self.fail:
            raise PermissionError("no")

    def kill_all(self) -> int:
        self.calls.append("kill_all")
        return 0

    def kill_jail(self) -> int:
        self.calls.append("kill_jail")
        return 0

    def remove(self) -> None:
        self.calls.append("remove")


class FakeZygote:
    def __init__(self) -> None:
        self.uid = os.getuid()  # the preamble's sender: this process
        self.settled_ids: list[int] = []
        self.moved_not_placed_calls = 0

    def settled(self, ident: int) -> None:
        self.settled_ids.append(ident)

    def moved_not_placed(self) -> None:
        self.moved_not_placed_calls += 1


class Env:
    def release_uid(self, uid: int) -> None:
        pass


def _sent(cgroup: SlowCgroup, preamble: bytes
          ) -> tuple[JailHandle, socket.socket, list[Any], FakeZygote]:
    """The daemon's side after the jail sent ``preamble``: read at once."""
    events: list[Any] = []
    handle = JailHandle(Env(), "job-1", events.append, 1 << 20)  # type: ignore[arg-type]
    handle.cgroup = cgroup  # type: ignore[assignment]
    handle.spawn_id = 7
    daemon_end, jail_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon_end.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    daemon_end.setblocking(False)
    handle.preamble_sock = daemon_end
    zy = FakeZygote()
    jail_end.send(preamble)
    forked._preamble(handle, zy)  # type: ignore[arg-type]
    return handle, jail_end, events, zy


async def _started(cgroup: SlowCgroup
                   ) -> tuple[JailHandle, socket.socket, list[Any], FakeZygote]:
    handle, jail_end, events, zy = _sent(cgroup, PREAMBLE)
    await _until(lambda: bool(cgroup.calls), "the move's start in a worker thread")
    return handle, jail_end, events, zy


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait on the loop for ``condition()`` (a worker thread's doing); a liveness guard."""
    deadline = time.monotonic() + guard(30)
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        await asyncio.sleep(0.005)


async def _removed(cgroup: SlowCgroup) -> None:
    """Until the release's worker thread removed the cgroup."""
    await _until(lambda: "remove" in cgroup.calls, "the cgroup's removal")


async def _finish(cgroup: SlowCgroup, handle: JailHandle) -> None:
    cgroup.gate.set()
    await _until(lambda: handle.adopting is None, "the move's end")


def test_the_jail_gets_go_once_it_is_in_its_cgroup() -> None:
    async def scenario() -> None:
        cgroup = SlowCgroup()
        handle, jail_end, _, zy = await _started(cgroup)
        assert handle.adopting is not None and handle.preamble_sock is not None
        assert cgroup.calls == ["adopt started"]  # the loop went on while the move waits
        await _finish(cgroup, handle)
        assert jail_end.recv(1) == GO
        assert handle.jail_pid == os.getpid() and zy.settled_ids == [7]
        assert handle.channel is not None
        handle.teardown()
        handle.release()  # the cgroup is removed in a worker thread
        await _removed(cgroup)
        assert cgroup.calls[-2:] == ["kill_jail", "remove"]
        jail_end.close()

    asyncio.run(scenario())


def test_a_kill_during_the_move_sends_no_go_and_release_waits_for_the_move() -> None:
    async def scenario() -> None:
        cgroup = SlowCgroup()
        handle, jail_end, events, zy = await _started(cgroup)
        handle.kill()  # the job is cancelled while the jail moves
        assert handle.preamble_sock is None
        assert [type(e) for e in events] == [StreamClosed]
        handle.teardown()
        handle.release()  # must not remove the cgroup while the jail may still land in it
        assert "remove" not in cgroup.calls
        await _finish(cgroup, handle)
        await _removed(cgroup)
        # the teardown's kill finds nothing yet; the removal comes after the move (and
        # kills whatever the move put there: JobCgroup.remove)
        assert cgroup.calls[-3:] == ["kill_jail", f"adopted {os.getpid()}", "remove"]
        assert jail_end.recv(1) == b""  # EOF, no GO: the jail exits
        assert handle.jail_pid is None and zy.settled_ids == []
        jail_end.close()

    asyncio.run(scenario())


def test_a_move_that_fails_ends_the_start_with_the_reason() -> None:
    async def scenario() -> None:
        cgroup = SlowCgroup(fail=True)
        handle, jail_end, events, _ = await _started(cgroup)
        await _finish(cgroup, handle)
        failed = [e for e in events if isinstance(e, StartFailed)]
        assert failed and "could not move the jail into its cgroup" in failed[0].detail
        assert isinstance(events[-1], StreamClosed)
        assert jail_end.recv(1) == b""
        jail_end.close()

    asyncio.run(scenario())


def test_a_jail_forked_into_its_cgroup_is_not_moved_and_gets_no_go() -> None:
    async def scenario() -> None:
        cgroup = SlowCgroup(leaf="/sys/fs/cgroup/jaild/zygote-x/job-1/jail")
        handle, jail_end, events, zy = _sent(cgroup, PLACED)
        assert cgroup.calls == [] and handle.adopting is None  # no move, no worker thread
        assert handle.jail_pid == os.getpid() and zy.settled_ids == [7]
        assert handle.channel is not None and handle.preamble_sock is None
        assert not [e for e in events if isinstance(e, StartFailed)]
        jail_end.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            assert jail_end.recv(1) != GO, "a placed jail is sent no go"
        handle.teardown()
        handle.release()
        await _removed(cgroup)
        jail_end.close()

    asyncio.run(scenario())


def test_a_jail_sent_no_cgroup_may_not_say_it_was_forked_into_one() -> None:
    async def scenario() -> None:
        cgroup = SlowCgroup()  # positive control: the same PLACED is taken with a leaf (above)
        handle, jail_end, events, zy = _sent(cgroup, PLACED)
        failed = [e for e in events if isinstance(e, StartFailed)]
        assert failed and "was not sent" in failed[0].detail, events
        assert isinstance(events[-1], StreamClosed)
        assert handle.channel is None and handle.jail_pid is None and zy.settled_ids == []
        assert jail_end.recv(1) == b""  # closed: the jail exits
        jail_end.close()

    asyncio.run(scenario())


def test_a_jail_sent_its_cgroup_but_forked_is_moved_and_it_is_said_once() -> None:
    async def scenario() -> None:
        cgroup = SlowCgroup(leaf="/sys/fs/cgroup/jaild/zygote-x/job-1/jail")
        handle, jail_end, _, zy = await _started(cgroup)
        assert zy.moved_not_placed_calls == 1
        await _finish(cgroup, handle)
        assert jail_end.recv(1) == GO and handle.channel is not None
        handle.teardown()
        handle.release()
        await _removed(cgroup)
        jail_end.close()

    asyncio.run(scenario())
