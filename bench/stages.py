"""Where a warm job's time goes: timestamps at each stage, across client, daemon and jail.

Run as a daemon (``python bench/stages.py serve ...``, in place of ``python -m jaild serve``),
this module wraps five of the daemon's functions to note ``time.perf_counter_ns()`` (the
host's CLOCK_MONOTONIC, one clock for every process here) as a job passes, and writes them
to ``$JAILD_STAGES_OUT`` when the daemon stops. :func:`measure` runs paced warm jobs against
such a daemon with the same notes taken in the client, and splits each job's time:

=================  ==============================================================
stage              from -> to
=================  ==============================================================
client send        ``AsyncClient.run`` called -> the daemon has read ``RunJob``
admit + place      ``RunJob`` read -> the pooled jail's ``RunCode`` being written
jail               ``RunCode`` being written -> the jail's ``CodeFinished`` read (two
                   hops, the jail's decode, run, files and reply)
record             ``CodeFinished`` read -> ``JobFinished`` being written
to client          ``JobFinished`` being written -> the client has decoded it
client return      decoded -> ``run`` returns to its caller
=================  ==============================================================

A write is noted as it starts (the reader, in another process, may be done with it
before the writer's ``send`` returns). A job whose code was not written to a pooled jail
within its ``submit`` found the pool empty (on a slow host it may not refill between two
paced jobs): it is a cold job, left out; :func:`measure` runs jobs until it has ``runs``
warm ones. The wrappers cost well under a microsecond per note.
Only the bench uses this (its smoke run in ``make test`` too); the daemon never imports it.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = ("client send", "admit + place", "jail", "record", "to client", "client return")
ENV = "JAILD_STAGES_OUT"


def _note(notes: list[tuple[int, str, int]], what: str, key: int = 0) -> None:
    notes.append((time.perf_counter_ns(), what, key))


def _wrap(owner: Any, name: str, before: Callable[..., None] | None = None,
          after: Callable[..., None] | None = None) -> None:
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args)
        out = inner(*args, **kwargs)
        if after is not None:
            after(*args)
        return out

    setattr(owner, name, wrapper)


def install_daemon_notes(notes: list[tuple[int, str, int]]) -> None:
    """Wrap the daemon's functions a warm job passes (see the module docstring)."""
    from jaild.daemon import pipeline, server
    from jaild.daemon.jails.launch import handle
    from jaild.protocol.messages import JobFinished, RunJob

    in_submit: list[bool] = [False]

    def submit_before(_self: Any, _client: Any, req: Any) -> None:
        if isinstance(req, RunJob):
            _note(notes, "runjob read")
            in_submit[0] = True

    def submit_after(*_: Any) -> None:
        if in_submit[0]:
            _note(notes, "submit end")
        in_submit[0] = False

    def channel_write(channel: Any, _data: bytes) -> None:
        if in_submit[0]:
            _note(notes, "runcode written", id(channel))

    def channel_readable(channel: Any) -> None:
        _note(notes, "jail readable", id(channel))

    def client_send(_session: Any, msg: Any) -> None:
        if isinstance(msg, JobFinished):
            _note(notes, "jobfinished written")

    _wrap(pipeline.Pipeline, "submit", submit_before, submit_after)
    _wrap(handle._Channel, "write", channel_write)
    _wrap(handle._Channel, "_readable", channel_readable)
    _wrap(server.ServedConnection, "send", client_send)


def serve(argv: list[str]) -> int:
    """``jaild serve`` with notes, written to ``$JAILD_STAGES_OUT`` at exit."""
    notes: list[tuple[int, str, int]] = []
    install_daemon_notes(notes)
    out = Path(os.environ[ENV])

    def dump() -> None:
        out.write_text("".join(f"{t} {what} {key}\n" for t, what, key in notes))

    atexit.register(dump)
    from jaild.cli import main

    return main(argv)


def split(client: list[tuple[int, int, int]], daemon: list[tuple[int, str, int]]
          ) -> dict[str, list[float]]:
    """Each warm job's stages in seconds: ``client`` holds (called, decoded, returned) per
    job; a job whose code no pooled jail took within its submit is left out."""
    out: dict[str, list[float]] = {s: [] for s in STAGES}
    events = sorted(daemon)
    i = 0
    for called, decoded, returned in client:
        while i < len(events) and not (events[i][0] >= called and events[i][1] == "runjob read"):
            i += 1
        if i == len(events):
            break
        read = events[i][0]
        end = next((e[0] for e in events[i:] if e[1] == "submit end"), None)
        written = next((e for e in events[i:] if e[1] == "runcode written"), None)
        if end is None or written is None or written[0] > end:
            i += 1  # the pool was empty: a cold job, not a warm one
            continue
        back = next(e for e in events[i:] if e[1] == "jail readable" and e[2] == written[2]
                    and e[0] > written[0])
        finished = next(e[0] for e in events[i:] if e[1] == "jobfinished written"
                        and e[0] > back[0])
        stamps = [called, read, written[0], back[0], finished, decoded, returned]
        for stage, a, b in zip(STAGES, stamps, stamps[1:], strict=False):
            out[stage].append((b - a) / 1e9)
    return out


async def _client_jobs(socket: str, policy: str, code: str, runs: int, pause_s: float
                       ) -> list[tuple[int, int, int]]:
    from jaild.client import AsyncClient
    from jaild.protocol.messages import JobFinished

    decoded: list[int] = []
    stamps: list[tuple[int, int, int]] = []
    async with AsyncClient(socket) as c:
        wire = c._wire  # what the client's wire hands each decoded message to
        inner = wire._deliver

        def handle(msg: Any) -> None:
            if isinstance(msg, JobFinished):
                decoded.append(time.perf_counter_ns())
            inner(msg)

        wire._deliver = handle
        for _ in range(runs):
            await asyncio.sleep(pause_s)
            called = time.perf_counter_ns()
            r = await c.run(code, policy)
            returned = time.perf_counter_ns()
            if r.status != "ok":
                raise RuntimeError(f"job {r.status}: {r.error}")
            stamps.append((called, decoded[-1], returned))
    return stamps


def measure(variant: Any, code: str, runs: int, pause_s: float, workdir: Path
            ) -> dict[str, list[float]]:
    """Paced warm jobs against a traced daemon; each stage's times (see :func:`split`)."""
    from jaildrun import PrivateDaemon

    out = workdir / "stages.txt"
    os.environ[ENV] = str(out)
    try:
        with PrivateDaemon(variant, entry=(str(Path(__file__).resolve()),)) as d:
            client = asyncio.run(_client_jobs(d.socket, d.policy, code, 4 * runs + 5, pause_s))
    finally:
        del os.environ[ENV]
    notes = []
    for line in out.read_text().splitlines():
        t, rest = line.split(" ", 1)
        what, key = rest.rsplit(" ", 1)
        notes.append((int(t), what, int(key)))
    stages = split(client[5:], notes)
    warm = len(stages[STAGES[0]])
    if warm < runs:
        raise RuntimeError(f"only {warm} of {len(client) - 5} paced jobs found a pooled jail")
    return {stage: times[:runs] for stage, times in stages.items()}


def summary(stages: dict[str, list[float]]) -> list[tuple[str, float]]:
    """Each stage's median, in seconds."""
    return [(s, statistics.median(v)) for s, v in stages.items() if v]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(serve(sys.argv[1:]))
