"""A jail's output pipes (jaild.daemon.jails.launch.handle._Pipe): each descriptor is closed once,
by its owner, and nothing reads a pipe's number after it was closed -- whatever event loop
the daemon runs. The controls show what the pipe replaced does: under uvloop,
``connect_read_pipe`` over a file object closes the descriptor twice (libuv, then the file
object), so a file opened in between (by any thread) loses its descriptor; and a number read
after its close reads whoever holds it now."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Callable
from typing import Any

import pytest
import uvloop  # the test extra's: jaild's other loop

from jaild.daemon.jails.launch.handle import _Pipe

LOOPS: dict[str, Callable[[Any], Any]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


def _open_in_between() -> int:
    """A file of someone else's, opened in a window where a number was just freed."""
    return os.open("/dev/null", os.O_RDONLY)


def _fd_alive(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_pipe_is_read_to_eof_and_closed_once_and_its_number_never_read_again(
    loop: str,
) -> None:
    async def main() -> tuple[list[bytes], int, list[bytes], bool]:
        r, w = os.pipe()
        got: list[bytes] = []
        closed: list[bool] = []
        ended = asyncio.Event()

        def on_closed() -> None:
            closed.append(True)
            ended.set()

        pipe = _Pipe(asyncio.get_running_loop(), r, got.append, on_closed)
        os.write(w, b"hello")
        os.close(w)
        await asyncio.wait_for(ended.wait(), 5)
        pipe.close()  # again: nothing
        other_r, other_w = os.pipe()  # takes the freed number
        try:
            os.write(other_w, b"someone else's")
            stale = pipe.read_now()
            alive = _fd_alive(other_r)
        finally:
            os.close(other_r)
            os.close(other_w)
        return got, len(closed), stale, alive and other_r == r

    got, closes, stale, reused = LOOPS[loop](main())
    assert b"".join(got) == b"hello" and closes == 1
    assert stale == [] and reused  # the number was reused, and not read


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_paused_pipe_is_not_read_until_resumed(loop: str) -> None:
    async def main() -> tuple[list[bytes], list[bytes]]:
        r, w = os.pipe()
        got: list[bytes] = []
        ended = asyncio.Event()
        pipe = _Pipe(asyncio.get_running_loop(), r, got.append, ended.set)
        pipe.pause()
        os.write(w, b"held")
        await asyncio.sleep(0.05)
        before = list(got)
        pipe.resume()
        os.close(w)
        await asyncio.wait_for(ended.wait(), 5)
        return before, got

    before, after = LOOPS[loop](main())
    assert before == [] and b"".join(after) == b"held"


class _Witness(io.FileIO):
    """A pipe's file object that opens someone else's file just before it closes its own
    descriptor, as another thread may: the number is free then only if it was closed
    already."""

    victim: int | None = None

    def close(self) -> None:
        if not self.closed and _Witness.victim is None:
            _Witness.victim = _open_in_between()
        super().close()


def test_control_uvloop_connect_read_pipe_closes_the_descriptor_twice() -> None:
    async def main() -> bool:
        r, w = os.pipe()
        lost = asyncio.get_running_loop().create_future()

        class Reader(asyncio.Protocol):
            def connection_lost(self, exc: Exception | None) -> None:
                lost.set_result(None)

        _Witness.victim = None
        _transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            Reader, _Witness(r, "rb", closefd=True)
        )
        os.close(w)  # EOF: the transport closes
        await asyncio.wait_for(lost, 5)
        await asyncio.sleep(0.01)
        victim = _Witness.victim
        assert victim is not None
        alive = _fd_alive(victim)
        if alive:
            os.close(victim)
        return alive

    assert uvloop.run(main()) is False  # the file opened in between lost its descriptor
    assert asyncio.run(main()) is True  # asyncio's loop closes it once: the file keeps it
